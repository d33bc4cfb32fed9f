"""SMART regularisation (Jiang et al. 2020; report 001 eqs. 6-8, report 004 eqs. 2-6).

For task ``t`` the trainer adds to the task loss

    λ_t · R_s(θ) + μ · D_Breg(θ, θ̃)

* smoothness-inducing adversarial regulariser (eq. 7 of 001 / eq. 4 of 004):
  ``R_s(θ) = 1/n Σ_i max_{‖x̃_i − x_i‖∞ ≤ ε} ℓ_s(f(x̃_i; θ), f(x_i; θ))``, with x the
  *word embeddings* of the input.  The max is approximated as in Jiang et al.'s
  Algorithm 1: x̃ = x + ν, ν ~ N(0, σ²I) with σ² = ``smart_noise``; then
  ``smart_steps`` times x̃ ← Π_{‖x̃−x‖∞≤ε}(x̃ + η g̃ / ‖g̃‖∞) with
  g̃ = ∇_x̃ ℓ_s(f(x̃; θ), f(x; θ)), η = ``smart_step_size``, ε = ``smart_eps``
  (the norm of g̃ is taken per example, the projection is an element-wise clamp).
  Only real tokens are perturbed (padding positions keep δ = 0).
* Bregman proximal point with momentum (eqs. 5-6 of 004):
  ``D_Breg(θ, θ̃) = 1/n Σ_i ℓ_s(f(x_i; θ), f(x_i; θ̃))``, the teacher θ̃ an EMA of θ:
  θ̃ ← β θ̃ + (1 − β) θ after every optimizer step (β = ``smart_beta``); θ̃_0 is the
  model when the regulariser is built (after any pre-training stage).
* ℓ_s (eq. 8 of 001): symmetric KL D(P‖Q) + D(Q‖P) for SST (5-class softmax of the
  logits) and QQP (the Bernoulli σ(logit)); squared error for the STS score.

Dropout.  ``f(·; θ)`` in R_s and D_Breg is one function: the perturbed, the ascent
and the teacher forwards replay the dropout masks of the trainer's clean forward
(the regulariser records torch's RNG state in a forward pre-hook and restores it
around its own forwards), so R_s is exactly 0 for δ = 0 and D_Breg exactly 0 for
θ̃ = θ even in train mode, and the ascent direction is not swamped by dropout noise.
The global RNG then continues as if those forwards had not consumed it; only the
initial noise ν is drawn from it (so checkpoint resume stays exact).

One trial and N.  The ascent (:func:`ascend`), its start (:func:`start_perturbation`), the
divergences and the teacher's EMA (:func:`teacher_ema_`) are written once, for one
trial's ``[rows, tokens, hidden]`` embeddings and for N stacked trials'
``[N, rows, tokens, hidden]`` with each trial's η, ε and β as tensors:
:class:`SmartRegulariser` runs them for one trial, :class:`TrialAxisSmart` for the trials
of a fused step (:mod:`mtbert.step.fused_training`).

Cost.  One SMART step adds an ascent forward + a backward to the embeddings only,
an adversarial forward + its backward, and (μ > 0) one no-grad teacher forward.
Memory: the teacher is one detached copy of every trainable parameter of the model
(for MiniLM-L6 about 22.7 M floats, ~91 MB in fp32), evaluated with
``torch.func.functional_call`` (buffers are shared with the model); nothing is kept
when μ = 0.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, vmap

from mtbert.core.config import TrainConfig
from mtbert.data import ROW_WEIGHTS, encoding_for
from mtbert.techniques.losses import _wide, task_loss, weighted_mean
from mtbert.model.model import TaskOutput
from mtbert.core.tasks import TASK_NAMES
from mtbert.core.trial_streams import _rng_state, _set_rng_state

_TINY = 1e-12


# ---------------------------------------------------------------------- divergences ℓ_s
def symmetric_kl_logits(p_logits: torch.Tensor, q_logits: torch.Tensor,
                        weights: torch.Tensor | None = None) -> torch.Tensor:
    """Mean over rows of KL(P‖Q) + KL(Q‖P), P = softmax(p), Q = softmax(q) (001 eq. 8).
    Written as Σ_k (P_k − Q_k)(log P_k − log Q_k): every term is ≥ 0."""
    lp, lq = F.log_softmax(_wide(p_logits), -1), F.log_softmax(_wide(q_logits), -1)
    return weighted_mean(((lp.exp() - lq.exp()) * (lp - lq)).sum(-1), weights)


def symmetric_kl_bernoulli(a: torch.Tensor, b: torch.Tensor,
                           weights: torch.Tensor | None = None) -> torch.Tensor:
    """Mean of KL + reverse KL between Bernoulli(σ(a)) and Bernoulli(σ(b)).
    Since log σ(z) − log σ(−z) = z, the four log terms collapse to (σ(a) − σ(b))·(a − b)."""
    a, b = _wide(a), _wide(b)
    return weighted_mean((torch.sigmoid(a) - torch.sigmoid(b)) * (a - b), weights)


def squared_error(a: torch.Tensor, b: torch.Tensor,
                  weights: torch.Tensor | None = None) -> torch.Tensor:
    """Mean of (a − b)² (ℓ_s for regression, 004 §4.3)."""
    return weighted_mean((_wide(a) - _wide(b)).pow(2), weights)


def smart_output(task: str, out: TaskOutput) -> torch.Tensor:
    """What ℓ_s compares: SST 5-class logits, QQP logit, STS score."""
    return out.score if task == "sts" else out.logits


def divergence(task: str, p: torch.Tensor, q: torch.Tensor,
               weights: torch.Tensor | None = None) -> torch.Tensor:
    """ℓ_s for ``task`` on two ``smart_output`` tensors (symmetric in p, q), a mean over the
    rows (``weights``: 0 for a fixed-size batch's filler rows)."""
    if task == "sst":
        return symmetric_kl_logits(p, q, weights)
    if task == "qqp":
        return symmetric_kl_bernoulli(p, q, weights)
    return squared_error(p, q, weights)


# ---------------------------------------------------------------------- RNG replay
class EagerRngReplay:
    """Replays the clean forward's random numbers by saving torch's RNG state before it and
    setting it again around each replaying forward (host copies of the state: eager only;
    :class:`mtbert.step.step_graphs.GraphRngReplay` is the capturable twin)."""

    def remember(self, device: torch.device):
        return _rng_state(device)

    @contextlib.contextmanager
    def replay(self, remembered):
        """Run the block on the remembered stream; the global stream is left as it was."""
        after = _rng_state(remembered[2])
        _set_rng_state(remembered)
        try:
            yield
        finally:
            _set_rng_state(after)


def _batch_device(batch: dict[str, torch.Tensor]) -> torch.device:
    return next(iter(batch.values())).device


_MASK_KEY = {"input": "attention_mask", "a": "attention_mask_a", "b": "attention_mask_b"}


# ---------------------------------------------------------------------- written once
# for one trial (x: [rows, tokens, hidden], ``lead`` = 1) and for N stacked trials
# (x: [N, rows, tokens, hidden], ``lead`` = 2, the values [N, 1, 1, 1] tensors)
def start_perturbation(embeds: dict[str, torch.Tensor], batch: dict[str, torch.Tensor],
                       noise) -> tuple[dict, dict, dict]:
    """(x detached, the real tokens' masks, δ₀ = ν on real tokens only) for the embeddings
    ``embeds``; ``noise(key, x)``: ν for one input's embeddings, drawn in the key order."""
    x = {k: e.detach() for k, e in embeds.items()}
    masks = {k: batch[_MASK_KEY[k]].unsqueeze(-1).to(x[k].dtype) for k in x}
    return x, masks, {k: noise(k, x[k]) * masks[k] for k in x}


def ascend(x: dict[str, torch.Tensor], delta: dict[str, torch.Tensor],
           masks: dict[str, torch.Tensor], divergence_at, steps: int,
           step_size: float | torch.Tensor, eps: float | torch.Tensor,
           lead: int = 1) -> dict[str, torch.Tensor]:
    """δ* of Jiang et al.'s Algorithm 1: ``steps`` times x̃ ← Π_{‖x̃−x‖∞≤ε}(x̃ + η g̃/‖g̃‖∞),
    g̃ the gradient of ``divergence_at(x + δ)`` (a number: with a trial axis the trials' sum,
    each trial's slice of δ getting its own), ‖g̃‖∞ per example over every perturbed token of
    it, the projection an element-wise clamp, δ kept on real tokens (``masks``).  ``lead``:
    the leading axes that index an example (1: rows; 2: trials and rows)."""
    for _ in range(steps):
        delta = {k: d.requires_grad_(True) for k, d in delta.items()}
        div = divergence_at({k: x[k] + delta[k] for k in x})
        keys = list(delta)
        grads = torch.autograd.grad(div, [delta[k] for k in keys], allow_unused=True)
        grads = {k: (g if g is not None else torch.zeros_like(delta[k]))
                 for k, g in zip(keys, grads)}
        # per-example ‖g̃‖∞ over every perturbed token of the example
        norm = torch.stack([g.abs().flatten(lead).amax(lead) for g in grads.values()]).amax(0)
        norm = norm.view(norm.shape + (1, 1)) + _TINY
        # x̃ ← Π_{‖x̃−x‖∞≤ε}(x̃ + η g̃/‖g̃‖∞): ascent step, then element-wise clamp
        delta = {k: (torch.clamp(delta[k].detach() + step_size * grads[k] / norm,
                                 -eps, eps) * masks[k]) for k in keys}
    return delta


@torch.no_grad()
def teacher_ema_(teacher: list[torch.Tensor], params: list[torch.Tensor],
                 beta: float | list[torch.Tensor],
                 one_minus_beta: float | list[torch.Tensor]) -> None:
    """θ̃ ← β θ̃ + (1 − β) θ (momentum Bregman proximal point, Jiang et al. 2020 §3), in
    place: β a number (one trial), or per tensor each trial's β shaped against it
    (``[N, 1, ...]``; 1 for a trial that did not step, whose teacher then stays)."""
    torch._foreach_mul_(teacher, beta)
    torch._foreach_add_(teacher, torch._foreach_mul(params, one_minus_beta))


@dataclass(frozen=True)
class SmartSettings:
    """SMART's numbers as a run's config gives them."""
    lambdas: dict[str, float]
    eps: float
    noise_std: float
    steps: int
    step_size: float
    mu: float
    beta: float

    @classmethod
    def of(cls, cfg: TrainConfig) -> SmartSettings:
        return cls(lambdas={t: float(cfg.smart_lambda(t)) for t in TASK_NAMES},
                   eps=float(cfg.smart_eps),
                   noise_std=math.sqrt(cfg.smart_noise),  # smart_noise is the variance σ²
                   steps=int(cfg.smart_steps), step_size=float(cfg.smart_step_size),
                   mu=float(cfg.smart_mu), beta=float(cfg.smart_beta))

    def structure(self) -> tuple:
        """What a captured term is built from and a new value cannot change: which terms
        are on (λ_t > 0, μ > 0) and the ascent's settings."""
        return (tuple(sorted((t, lam > 0) for t, lam in self.lambdas.items())), self.mu > 0,
                self.steps, self.step_size, self.noise_std)

    def values(self) -> dict[str, float]:
        """The values a captured term reads from tensors: λ_t, ε and μ."""
        return {**{f"lambda_{t}": lam for t, lam in self.lambdas.items()},
                "eps": self.eps, "mu": self.mu}


class SmartRegulariser:
    """``term(model, task, batch, clean_output)`` = λ_task·R_s + μ·D_Breg for one task batch;
    ``after_step(model)`` updates the EMA teacher; ``state_dict`` holds the teacher."""

    def __init__(self, cfg: TrainConfig, model: nn.Module):
        self.settings = SmartSettings.of(cfg)
        self.teacher: dict[str, torch.Tensor] | None = None
        if self.settings.mu > 0:
            self.teacher = {n: p.detach().clone() for n, p in model.named_parameters()
                            if p.requires_grad}
        # the values the term multiplies and clamps by: these floats, or after
        # hold_in_tensors() 0-d device tensors that a captured step reads at each replay
        self.values: dict[str, float | torch.Tensor] = self.settings.values()
        self._busy = False
        self._seen: tuple | None = None  # (task, batch, rng state before that forward)
        self.rng = EagerRngReplay()  # the trainer's step graphs swap in GraphRngReplay
        self._hook = model.register_forward_pre_hook(self._remember_rng, with_kwargs=True)

    # -------------------------------------------------------------- tensor values
    def hold_in_tensors(self, device: torch.device) -> None:
        """λ_t, ε and μ from 0-d float32 tensors on ``device`` from now on (the same
        products and clamp as with the floats), so that :meth:`refill` changes what a
        captured step computes without capturing it again."""
        self.values = {k: torch.tensor(float(v), dtype=torch.float32, device=device)
                       for k, v in self.values.items()}

    def refill(self, cfg: TrainConfig, model: nn.Module) -> None:
        """Take ``cfg``'s λ_t, ε, μ and β and start the teacher anew at ``model`` (in place:
        a captured step keeps reading the same tensors), for a new run of the same
        :meth:`SmartSettings.structure`; ValueError where the structure differs."""
        settings = SmartSettings.of(cfg)
        if settings.structure() != self.settings.structure():
            raise ValueError("the new SMART settings switch a term on or off, or change the "
                             "ascent: a captured step cannot take them")
        self.settings = settings  # β is read by the teacher's update, outside the graphs
        for key, value in settings.values().items():
            if isinstance(self.values[key], torch.Tensor):
                self.values[key].fill_(value)
            else:
                self.values[key] = value
        if self.teacher is not None:
            params = dict(model.named_parameters())
            with torch.no_grad():
                for name, tensor in self.teacher.items():
                    tensor.copy_(params[name])
        self._seen = None

    # -------------------------------------------------------------- hooks / state
    def _remember_rng(self, module, args, kwargs):
        """Record torch's RNG state before each training forward of the model (the trainer's
        clean forward) so the regulariser's forwards can replay its dropout masks."""
        if self._busy or not module.training or not torch.is_grad_enabled():
            return None
        task = args[0] if args else kwargs.get("task")
        batch = args[1] if len(args) > 1 else kwargs.get("batch")
        if isinstance(batch, dict) and batch:
            self._seen = (task, batch, self.rng.remember(_batch_device(batch)))
        return None

    def state_dict(self) -> dict:
        return {"teacher": dict(self.teacher)} if self.teacher is not None else {}

    def load_state_dict(self, state: dict) -> None:
        if self.teacher is None:
            return
        saved = state["teacher"]
        if set(saved) != set(self.teacher):
            raise ValueError("SMART teacher state does not match the model's parameters")
        with torch.no_grad():
            for name, tensor in self.teacher.items():
                tensor.copy_(saved[name])

    def after_step(self, model: nn.Module) -> None:
        """θ̃ ← β θ̃ + (1 − β) θ (:func:`teacher_ema_`)."""
        if self.teacher is None:
            return
        params = dict(model.named_parameters())
        names = list(self.teacher)
        beta = self.settings.beta
        teacher_ema_([self.teacher[n] for n in names], [params[n] for n in names], beta,
                     1.0 - beta)

    # -------------------------------------------------------------- the term
    def term(self, model: nn.Module, task: str, batch: dict[str, torch.Tensor],
             clean: TaskOutput) -> torch.Tensor:
        """λ_task · R_s(θ) + μ · D_Breg(θ, θ̃) for this batch (eqs. 2 and 5 of report 004)."""
        ref = smart_output(task, clean)
        lam, mu = self.settings.lambdas[task], self.settings.mu
        total = ref.new_zeros((), dtype=torch.float32)
        if lam == 0 and mu == 0:
            return total
        rng = self._replay_state(task, batch)
        if lam > 0:
            total = total + self.values[f"lambda_{task}"] * self.smoothness(model, task, batch,
                                                                           clean, rng)
        if mu > 0:
            total = total + self.values["mu"] * self.bregman(model, task, batch, clean, rng)
        return total

    def _replay_state(self, task: str, batch: dict[str, torch.Tensor]):
        seen, self._seen = self._seen, None
        if seen is not None and seen[0] == task and seen[1] is batch:
            return seen[2]
        return None  # clean forward not observed: our forwards draw fresh dropout masks

    def _forward(self, model, task, batch, rng, embeds=None, params=None) -> TaskOutput:
        """One forward of the model (or of the teacher weights ``params``) that reuses the
        dropout masks of the clean forward when ``rng`` is known, leaving the global RNG as
        it was."""
        self._busy = True
        try:
            with self.rng.replay(rng) if rng is not None else contextlib.nullcontext():
                if params is None:
                    return model(task, batch, embeds=embeds)
                return functional_call(model, params, (task, batch), {"embeds": embeds})
        finally:
            self._busy = False

    def initial_noise(self, x: torch.Tensor) -> torch.Tensor:
        """ν ~ N(0, σ² I) shaped like the embeddings ``x``, from torch's global RNG."""
        return torch.randn_like(x) * self.settings.noise_std

    def perturbation(self, model: nn.Module, task: str, batch: dict[str, torch.Tensor],
                     clean: TaskOutput, rng=None) -> tuple[dict, dict]:
        """The embeddings x (detached) and the adversarial δ with ‖δ‖∞ ≤ ε (Algorithm 1)."""
        x, masks, delta = start_perturbation(model.embed_inputs(task, batch), batch,
                                             lambda k, e: self.initial_noise(e))
        target = smart_output(task, clean).detach()
        weights = batch.get(ROW_WEIGHTS)

        def divergence_at(embeds):
            out = self._forward(model, task, batch, rng, embeds)
            return divergence(task, smart_output(task, out), target, weights)

        delta = ascend(x, delta, masks, divergence_at, self.settings.steps,
                       self.settings.step_size, self.values["eps"])
        return x, delta

    def smoothness(self, model: nn.Module, task: str, batch: dict[str, torch.Tensor],
                   clean: TaskOutput, rng=None) -> torch.Tensor:
        """R_s(θ) = ℓ_s(f(x + δ*; θ), f(x; θ)) with δ* from :meth:`perturbation` (001 eq. 7);
        gradients reach θ through both outputs."""
        x, delta = self.perturbation(model, task, batch, clean, rng)
        return self.divergence_at(model, task, batch, clean, x, delta, rng)

    def divergence_at(self, model, task, batch, clean, x, delta, rng=None) -> torch.Tensor:
        """ℓ_s(f(x + δ; θ), f(x; θ)) for a given perturbation δ."""
        out = self._forward(model, task, batch, rng, {k: x[k] + delta[k] for k in x})
        return divergence(task, smart_output(task, out), smart_output(task, clean),
                          batch.get(ROW_WEIGHTS))

    def bregman(self, model: nn.Module, task: str, batch: dict[str, torch.Tensor],
                clean: TaskOutput, rng=None) -> torch.Tensor:
        """D_Breg(θ, θ̃) = ℓ_s(f(x; θ), f(x; θ̃)) (004 eq. 6); the teacher runs under no_grad."""
        with torch.no_grad():
            out = self._forward(model, task, batch, rng, params=self.teacher)
        return divergence(task, smart_output(task, clean), smart_output(task, out).detach(),
                          batch.get(ROW_WEIGHTS))


# ---------------------------------------------------------------------- N stacked trials
def _loss_and_compared(model, task: str, batch: dict[str, torch.Tensor], cfg):
    """One trial's task loss (as :func:`mtbert.techniques.losses.batch_loss`, before its SMART term)
    and what ℓ_s compares of its clean output."""
    out = model(task, batch)
    return (task_loss(task, out, batch["labels"], cfg, batch.get(ROW_WEIGHTS)),
            smart_output(task, out))


class TrialAxisSmart:
    """SMART over N stacked trials (a fused step): each trial's loss on a task batch is its
    solo ``batch_loss`` with its SMART term, L_t + λ_t · R_s(θ) + μ · D_Breg(θ, θ̃), with
    λ_t, ε, μ, β, the noise σ and the ascent step η each trial's own (``[N]`` tensors);
    which terms are on (λ_t > 0, μ > 0) and the number of ascent steps are the group's
    structure (:func:`mtbert.run.graph_reuse.structure`).  The ascent (:func:`ascend`), the
    divergences and the teacher's EMA (:func:`teacher_ema_`) are the one-trial
    regulariser's, over the trial axis; the forwards are the fused model's
    (:meth:`mtbert.step.fused_model.FusedModel.map`), and one ``autograd.grad`` of the sum of
    the trials' divergences gives each trial's slice of δ its own gradient.

    Noise.  A solo run draws ν from torch's global RNG, seeded by its trainer; here each
    trial draws its ν from its own copy of that stream (:mod:`mtbert.core.trial_streams`) in its
    solo batch's shape and task order, so with dropout 0 a fused trial's noise, and so its
    run, is its solo run's (on a CPU: a solo run on CUDA holds its dropout rate in a device
    tensor and draws masks from that stream even at rate 0, so there the two draw their
    noise at other points of it).  Dropout masks come from the process's RNG
    (:mod:`mtbert.step.fused_model`); the forwards replay the clean forward's masks as the solo
    regulariser's do.  The teacher: ``[N, ...]`` copies of the trainable weights; each
    trial's own :class:`SmartRegulariser` holds views of its slices (its checkpoint's)."""

    def __init__(self, fused, regularisers: list[SmartRegulariser], streams, trials: list,
                 cfg):
        """``fused``: the :class:`~mtbert.step.fused_model.FusedModel`; ``streams``: the trials'
        :class:`~mtbert.core.trial_streams.TrialStreams`; ``trials``: their keys, by slot."""
        self.fused, self.streams, self.trials, self.cfg = fused, streams, trials, cfg
        settings = [r.settings for r in regularisers]
        device = next(iter(fused.params.values())).device

        def per_trial(values):
            return torch.tensor(values, dtype=torch.float64, device=device)

        self.lambdas = {t: per_trial([s.lambdas[t] for s in settings]) for t in TASK_NAMES}
        self.lambda_on = {t: settings[0].lambdas[t] > 0 for t in TASK_NAMES}
        self.eps = per_trial([s.eps for s in settings])
        self.step_size = per_trial([s.step_size for s in settings])
        self.mu = per_trial([s.mu for s in settings])
        self.noise_std = [s.noise_std for s in settings]
        self.betas = per_trial([s.beta for s in settings])
        self.steps = settings[0].steps
        self.teacher: dict[str, torch.Tensor] | None = None
        if regularisers[0].teacher is not None:
            self.teacher = {k: torch.stack([r.teacher[k] for r in regularisers])
                            for k in regularisers[0].teacher}
            for n, r in enumerate(regularisers):
                r.teacher = {k: t[n] for k, t in self.teacher.items()}
        skeleton = fused.skeleton
        table = skeleton.encoder.get_input_embeddings().weight
        name = next(k for k, p in skeleton.named_parameters() if p is table)
        self.embedding = fused.params[name]  # [N, vocab, hidden]: the noise's dtype and width
        self.rng = EagerRngReplay()
        #: this step's ν: task -> its input's place (0, or 1 for ``b``) -> ``[N, rows,
        #: tokens, hidden]`` in the stacked batch's shape (:meth:`draw_noise`)
        self._noise: dict[str, dict[int, torch.Tensor]] = {}

    # -------------------------------------------------------------- noise
    def draw_noise(self, batches: dict[int, dict[str, dict[str, torch.Tensor]]],
                   stacked: dict[str, dict[str, torch.Tensor]]) -> None:
        """ν ~ N(0, σ_n² I) for every trial's task batches of this step (``batches``: slot ->
        its host batches), from the trial's stream, in its solo shape and order (its tasks,
        then ``a`` before ``b``), placed in the stacked batch's shape (``stacked``: task ->
        the step's stacked batch; 0 in the padding and where a trial lacks the task): the
        step's noise, drawn before its first op as the rest of its inputs are."""
        self._noise = {}
        if not any(self.lambda_on.values()):
            return
        hidden, dtype = self.embedding.shape[-1], self.embedding.dtype
        device = self.embedding.device
        for n, trial_batches in batches.items():
            with self.streams.of(self.trials[n]):
                for task, batch in trial_batches.items():
                    if not self.lambda_on[task]:
                        continue
                    keys = (["input_ids_a", "input_ids_b"]
                            if encoding_for(task, self.cfg.pair_encoding) == "siamese"
                            else ["input_ids"])
                    noise = self._noise.setdefault(task, {})
                    for place, k in enumerate(keys):
                        if place not in noise:
                            noise[place] = torch.zeros(stacked[task][k].shape + (hidden,),
                                                       dtype=dtype, device=device)
                        rows, width = batch[k].shape
                        noise[place][n, :rows, :width] = torch.randn(
                            (rows, width, hidden), dtype=dtype, device=device) * self.noise_std[n]

    def _initial_noise(self, task: str, key: str, x: torch.Tensor) -> torch.Tensor:
        """The step's drawn ν for ``key``'s embeddings ``x`` (``[N, rows, tokens, hidden]``)."""
        nu = self._noise.get(task, {}).get({"input": 0, "a": 0, "b": 1}[key])
        return torch.zeros_like(x) if nu is None else nu.to(x.dtype)

    # -------------------------------------------------------------- the term
    def task_losses(self, task: str, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """``[N]``: L_t + λ_t·R_s + μ·D_Breg of each trial on its slice of ``batch``."""
        remembered = self.rng.remember(self.embedding.device)
        losses, compared = self.fused.map(
            lambda model, b: _loss_and_compared(model, task, b, self.cfg), batch)
        term = torch.zeros_like(losses)
        if self.lambda_on[task]:
            smooth = self.smoothness(task, batch, compared, remembered)
            term = term + self.lambdas[task].to(smooth.dtype) * smooth
        if self.teacher is not None:
            breg = self.bregman(task, batch, compared, remembered)
            term = term + self.mu.to(breg.dtype) * breg
        return losses + term

    def _compared(self, task, batch, remembered, embeds=None, tensors=None) -> torch.Tensor:
        """What ℓ_s compares of each trial's forward at ``embeds`` (or of the weights
        ``tensors``), on the clean forward's dropout masks."""
        with self.rng.replay(remembered):
            return self.fused.map(lambda model, b, e: smart_output(task, model(task, b, e or None)),
                                  batch, embeds or {}, tensors=tensors)

    def _divergence(self, task, p, q, batch) -> torch.Tensor:
        """ℓ_s of each trial (``[N]``), a mean over its real rows."""
        return vmap(lambda a, c, w: divergence(task, a, c, w))(p, q, batch[ROW_WEIGHTS])

    def smoothness(self, task, batch, compared, remembered) -> torch.Tensor:
        """R_s = ℓ_s(f(x + δ*; θ), f(x; θ)) per trial, δ* from :func:`ascend`."""
        x, masks, delta = start_perturbation(
            self.fused.map(lambda model, b: model.embed_inputs(task, b), batch), batch,
            lambda k, e: self._initial_noise(task, k, e))
        target = compared.detach()
        shape = (-1,) + (1,) * 3  # a per-trial value against [N, rows, tokens, hidden]
        step = self.step_size.to(next(iter(x.values())).dtype).view(shape)
        eps = self.eps.to(step.dtype).view(shape)

        def divergence_at(embeds):
            return self._divergence(task, self._compared(task, batch, remembered, embeds),
                                    target, batch).sum()

        delta = ascend(x, delta, masks, divergence_at, self.steps, step, eps, lead=2)
        out = self._compared(task, batch, remembered, {k: x[k] + delta[k] for k in x})
        return self._divergence(task, out, compared, batch)

    def bregman(self, task, batch, compared, remembered) -> torch.Tensor:
        """D_Breg = ℓ_s(f(x; θ), f(x; θ̃)) per trial; the teachers run under no_grad."""
        with torch.no_grad():
            out = self._compared(task, batch, remembered, tensors=self.teacher)
        return self._divergence(task, compared, out.detach(), batch)

    def after_step(self, stepping: torch.Tensor) -> None:
        """:func:`teacher_ema_` of each trial that stepped (``stepping``: ``[N]`` bool on the
        device); a trial that did not step has β = 1 and keeps its teacher.  No loop over
        the trials: one β a tensor shape, a few ops for all the parameters."""
        if self.teacher is None:
            return
        names = list(self.teacher)
        teacher = [self.teacher[k] for k in names]
        dtype = teacher[0].dtype
        beta = torch.where(stepping, self.betas, 1.0).to(dtype)
        one_minus = torch.where(stepping, 1.0 - self.betas, 0.0).to(dtype)
        shaped = {}
        for t in teacher:
            if t.dim() not in shaped:
                view = (-1,) + (1,) * (t.dim() - 1)
                shaped[t.dim()] = (beta.view(view), one_minus.view(view))
        teacher_ema_(teacher, [self.fused.params[k] for k in names],
                     [shaped[t.dim()][0] for t in teacher], [shaped[t.dim()][1] for t in teacher])


def build_regulariser(cfg: TrainConfig, model) -> SmartRegulariser | None:
    """None when every λ and μ are 0: the trainer then adds nothing (the plain loss)."""
    if all(cfg.smart_lambda(t) == 0 for t in TASK_NAMES) and cfg.smart_mu == 0:
        return None
    return SmartRegulariser(cfg, model)
