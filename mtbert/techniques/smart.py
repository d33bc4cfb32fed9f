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
and the teacher forwards replay the dropout masks of the trainer's clean forward (the
place of its first mask, remembered before it and set back around each of these forwards:
:meth:`mtbert.core.trial_streams.MaskStream.replay`), so R_s is exactly 0 for δ = 0 and
D_Breg exactly 0 for θ̃ = θ even in train mode, and the ascent direction is not swamped
by dropout noise.  The initial noise ν is drawn from the trial's stream (:func:`draw_noise`,
in the trial's own batch shape, alone or stacked: alone after its clean forward, stacked
when the step begins; either way after its masks' seed and before PCGrad's orders).

One trial and N.  The ascent (:func:`ascend`), its start (:func:`start_perturbation`), the
divergences and the teacher's EMA (:func:`teacher_ema_`) are written once, for one
trial's ``[rows, tokens, hidden]`` embeddings and for N stacked trials'
``[N, rows, tokens, hidden]`` with each trial's η, ε and β as tensors, and so is the term
that runs them: :class:`SmartRegulariser`, of one trial (its model) or of the trials of a
fused step (:meth:`SmartRegulariser.stacked`, :mod:`mtbert.loop.training_group`).

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
from mtbert.techniques.losses import _wide, loss_and_output, weighted_mean
from mtbert.model.model import TaskOutput
from mtbert.core.tasks import TASK_NAMES
from mtbert.core.trial_streams import MaskStream

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


# ---------------------------------------------------------------------- noise
def draw_noise(batches: dict[str, dict[str, torch.Tensor]], generator: torch.Generator | None,
               hidden: int, dtype: torch.dtype, device: torch.device, pair_encoding: str,
               lambda_on: dict[str, bool], std: float) -> dict[str, list[torch.Tensor]]:
    """ν ~ N(0, σ² I) (Algorithm 1's start) for each task batch of a step whose λ_t > 0, in
    the batch's own shape ``[rows, tokens, hidden]``, one per input (``input``, or ``a``
    then ``b``), drawn in that order from ``generator`` (the trial's stream)."""
    noise = {}
    for task, batch in batches.items():
        if not lambda_on[task]:
            continue
        keys = (["input_ids_a", "input_ids_b"] if encoding_for(task, pair_encoding) == "siamese"
                else ["input_ids"])
        noise[task] = [torch.randn(tuple(batch[k].shape) + (hidden,), dtype=dtype,
                                   device=device, generator=generator) * std for k in keys]
    return noise


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
                 one_minus_beta: float | list[torch.Tensor]) -> None:
    """θ̃ ← β θ̃ + (1 − β) θ (momentum Bregman proximal point, Jiang et al. 2020 §3), in
    place, as θ̃ + (1 − β)(θ − θ̃): one ``lerp_`` a tensor, one pass over the weights (three
    passes and a copy of the weights took 47 ms a step for MiniLM on one CPU thread, the lerp
    9 ms).  1 − β a number (one trial), or per tensor each trial's shaped against it
    (``[N, 1, ...]``; 0 for a trial that did not step, whose teacher then stays)."""
    torch._foreach_lerp_(teacher, params, one_minus_beta)


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


class _OneModel:
    """One trial's forwards (no trial axis, as HFTA's B = 0 is the plain module): its own
    model; ℓ_s a number."""
    lead = 1  # the leading axes that index an example: rows

    def __init__(self, smart: SmartRegulariser, model: nn.Module):
        self.smart, self.model = smart, model

    def embed(self, task, batch):
        return self.model.embed_inputs(task, batch)

    def noise(self, task, key, x):
        return self.smart.initial_noise(x)

    def compared(self, task, batch, rng, embeds=None, tensors=None) -> torch.Tensor:
        """What ℓ_s compares of the model's forward at ``embeds`` (or of the weights
        ``tensors``, the teacher's), on the clean forward's dropout masks where ``rng``."""
        self.smart._busy = True  # not a clean forward: the pre-hook remembers nothing
        try:
            with self.smart.replay(rng):
                out = (self.model(task, batch, embeds=embeds) if tensors is None else
                       functional_call(self.model, tensors, (task, batch), {"embeds": embeds}))
        finally:
            self.smart._busy = False
        return smart_output(task, out)

    def divergence(self, task, p, q, batch) -> torch.Tensor:
        return divergence(task, p, q, batch.get(ROW_WEIGHTS))


class _Stacked:
    """N stacked trials' forwards: the fused model's (:meth:`FusedModel.map`), each trial
    on its slice of the batch; ℓ_s ``[N]``."""
    lead = 2  # trials and rows

    def __init__(self, smart: SmartRegulariser, fused):
        self.smart, self.fused = smart, fused

    def embed(self, task, batch):
        return self.fused.map(lambda model, b: model.embed_inputs(task, b), batch)

    def noise(self, task, key, x):
        return self.smart.drawn_noise(task, key, x)

    def compared(self, task, batch, rng, embeds=None, tensors=None) -> torch.Tensor:
        with self.smart.replay(rng):
            return self.fused.map(lambda model, b, e: smart_output(task, model(task, b, e or None)),
                                  batch, embeds or {}, tensors=tensors)

    def divergence(self, task, p, q, batch) -> torch.Tensor:
        return vmap(lambda a, c, w: divergence(task, a, c, w))(p, q, batch[ROW_WEIGHTS])


def _against(value, like: torch.Tensor):
    """A per-trial value against ``like``: a number or 0-d tensor (one trial) as it is; an
    ``[N]`` tensor as ``[N, 1, ...]`` in ``like``'s dtype."""
    if isinstance(value, torch.Tensor) and value.dim() == 1:
        return value.to(like.dtype).view((-1,) + (1,) * (like.dim() - 1))
    return value


class SmartRegulariser:
    """SMART's term λ_t · R_s(θ) + μ · D_Breg(θ, θ̃) (eqs. 2 and 5 of report 004), written
    once over a leading trial axis, for one trial or N stacked ones.

    One trial (built from its config and model: what its run holds, refills and
    checkpoints) skips the axis: its own model's forwards, λ_t, ε and μ numbers or 0-d
    tensors (:meth:`hold_in_tensors`); :meth:`term` from :func:`batch_loss`,
    :meth:`after_step` with its model, ``state_dict`` its teacher.  N trials
    (:meth:`stacked`, from the trials' own): the fused model's forwards, each value an
    ``[N]`` tensor, the teacher ``[N, ...]`` (each trial's own holding views of its slices);
    :meth:`task_losses` gives each trial's L_t plus its term, :meth:`after_step` the
    stacked weights and who stepped.  Which terms are on (λ_t > 0, μ > 0) and the number of
    ascent steps are the trials' structure (:func:`mtbert.loop.graph_reuse.structure`)."""

    def __init__(self, cfg: TrainConfig, model: nn.Module):
        self.settings = SmartSettings.of(cfg)
        self.lambda_on = {t: lam > 0 for t, lam in self.settings.lambdas.items()}
        self.teacher: dict[str, torch.Tensor] | None = None
        if self.settings.mu > 0:
            self.teacher = {n: p.detach().clone() for n, p in model.named_parameters()
                            if p.requires_grad}
        # the values the term multiplies and clamps by: these floats, or after
        # hold_in_tensors() 0-d device tensors that a captured step reads at each replay
        self.values: dict[str, float | torch.Tensor] = self.settings.values()
        self.step_size: float | torch.Tensor = self.settings.step_size
        self._busy = False
        self._seen: tuple | None = None  # (task, batch, the place of that forward's masks)
        #: the trial's stream (ν) and dropout masks (replayed), set by the trial
        #: (:meth:`draw_from`); a regulariser of no trial (a bare model's) draws ν on
        #: torch's default generator and replays no masks
        self.generator: torch.Generator = torch.default_generator
        self.masks: MaskStream | None = None
        self._hook = model.register_forward_pre_hook(self._remember_rng, with_kwargs=True)

    @classmethod
    def stacked(cls, fused, regularisers: list[SmartRegulariser],
                generators: list[torch.Generator], cfg) -> SmartRegulariser:
        """SMART of N stacked trials (a fused step; ``fused``: the
        :class:`~mtbert.step.fused_model.FusedModel`), each with its own λ_t, ε, μ, β, noise
        σ and ascent step η (``[N]`` tensors), from the trials' own ``regularisers``, whose
        teachers become views of the stacked teacher's slices (their checkpoints').  Each
        trial's ν is drawn from its own stream (``generators``, by slot) when the step
        begins (:meth:`draw_noise`); the forwards replay the clean forward's dropout masks
        (the fused model's mask stream)."""
        self = cls.__new__(cls)
        settings = [r.settings for r in regularisers]
        device = next(iter(fused.params.values())).device

        def per_trial(values):
            return torch.tensor(values, dtype=torch.float64, device=device)

        self.settings = settings[0]  # the structure: which terms are on, the ascent's steps
        self.lambda_on = {t: settings[0].lambdas[t] > 0 for t in TASK_NAMES}
        self.values = {**{f"lambda_{t}": per_trial([s.lambdas[t] for s in settings])
                          for t in TASK_NAMES},
                       "eps": per_trial([s.eps for s in settings]),
                       "mu": per_trial([s.mu for s in settings])}
        self.step_size = per_trial([s.step_size for s in settings])
        self.betas = per_trial([s.beta for s in settings])
        self.noise_std = [s.noise_std for s in settings]
        self.teacher = None
        if regularisers[0].teacher is not None:
            self.teacher = {k: torch.stack([r.teacher[k] for r in regularisers])
                            for k in regularisers[0].teacher}
            for n, r in enumerate(regularisers):
                r.teacher = {k: t[n] for k, t in self.teacher.items()}
        self.fused, self.generators, self.cfg = fused, generators, cfg
        skeleton = fused.skeleton
        table = skeleton.encoder.get_input_embeddings().weight
        name = next(k for k, p in skeleton.named_parameters() if p is table)
        self.embedding = fused.params[name]  # [N, vocab, hidden]: the noise's dtype and width
        self.masks = fused.masks  # the trials' dropout masks, replayed
        self._busy, self._seen = False, None
        #: this step's ν: task -> its input's place (0, or 1 for ``b``) -> ``[N, rows,
        #: tokens, hidden]`` in the stacked batch's shape (:meth:`draw_noise`)
        self._noise: dict[str, dict[int, torch.Tensor]] = {}
        return self

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

    # -------------------------------------------------------------- the stream
    def draw_from(self, generator: torch.Generator, masks: MaskStream | None = None) -> None:
        """Draw ν from ``generator`` (the trial's stream) and replay ``masks`` (its dropout
        masks; None: keep those set)."""
        self.generator = generator
        if masks is not None:
            self.masks = masks

    def _remember_rng(self, module, args, kwargs):
        """Remember the place of the masks before each training forward of the model (the
        trainer's clean forward) so the regulariser's forwards can replay its masks."""
        if self._busy or not module.training or not torch.is_grad_enabled():
            return None
        task = args[0] if args else kwargs.get("task")
        batch = args[1] if len(args) > 1 else kwargs.get("batch")
        if not self._has_term(task):
            return None  # nothing to replay
        if isinstance(batch, dict) and batch:
            self._seen = (task, batch, None if self.masks is None else self.masks.remember())
        return None

    def replay(self, remembered):
        """The block's forwards draw the masks of the forward ``remembered`` (None: their
        own)."""
        if remembered is None or self.masks is None:
            return contextlib.nullcontext()
        return self.masks.replay(remembered)

    def _has_term(self, task: str) -> bool:
        """Whether ``task`` gets a term: smoothness (λ on) or Bregman (a teacher)."""
        return bool(self.lambda_on.get(task)) or self.teacher is not None

    def _replay_state(self, task: str, batch: dict[str, torch.Tensor]):
        seen, self._seen = self._seen, None
        if seen is not None and seen[0] == task and seen[1] is batch:
            return seen[2]
        return None  # clean forward not observed: our forwards draw fresh dropout masks

    def initial_noise(self, x: torch.Tensor) -> torch.Tensor:
        """One trial's ν ~ N(0, σ² I) shaped like the embeddings ``x``, from its stream (as
        :func:`draw_noise` draws it; a bare regulariser's: torch's default generator)."""
        generator = self.generator
        if generator.device != x.device:  # a bare regulariser's model on CUDA
            return torch.randn_like(x) * self.settings.noise_std
        return torch.randn(x.shape, dtype=x.dtype, device=x.device,
                           generator=generator) * self.settings.noise_std

    def draw_noise(self, batches: dict[int, dict[str, dict[str, torch.Tensor]]],
                   stacked: dict[str, dict[str, torch.Tensor]]) -> None:
        """N trials' ν for the step (``batches``: slot -> its host batches), each from its
        stream in its solo shape and order (:func:`draw_noise`), placed in the stacked
        batch's shape (``stacked``: task -> the step's stacked batch; 0 in the padding and
        where a trial lacks the task): drawn before the step's first op, as its inputs."""
        self._noise = {}
        if not any(self.lambda_on.values()):
            return
        hidden, dtype = self.embedding.shape[-1], self.embedding.dtype
        device = self.embedding.device
        for n, trial_batches in batches.items():
            drawn = draw_noise(trial_batches, self.generators[n], hidden, dtype, device,
                               self.cfg.pair_encoding, self.lambda_on, self.noise_std[n])
            for task, inputs in drawn.items():
                noise = self._noise.setdefault(task, {})
                keys = (["input_ids_a", "input_ids_b"] if len(inputs) == 2 else ["input_ids"])
                for place, (k, nu) in enumerate(zip(keys, inputs)):
                    if place not in noise:
                        noise[place] = torch.zeros(stacked[task][k].shape + (hidden,),
                                                   dtype=dtype, device=device)
                    rows, width = nu.shape[:2]
                    noise[place][n, :rows, :width] = nu

    def drawn_noise(self, task: str, key: str, x: torch.Tensor) -> torch.Tensor:
        """The step's drawn ν for ``key``'s embeddings ``x`` (``[N, rows, tokens, hidden]``)."""
        nu = self._noise.get(task, {}).get({"input": 0, "a": 0, "b": 1}[key])
        return torch.zeros_like(x) if nu is None else nu.to(x.dtype)

    # -------------------------------------------------------------- state
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

    def after_step(self, model: nn.Module | dict[str, torch.Tensor],
                   stepping: torch.Tensor | None = None) -> None:
        """θ̃ ← β θ̃ + (1 − β) θ (:func:`teacher_ema_`): one trial's ``model``; or the stacked
        weights (name -> ``[N, ...]``) of the trials ``stepping`` (``[N]`` bool on the
        device; β = 1 for a trial that did not step, whose teacher stays: one β a tensor
        shape, no loop over the trials)."""
        if self.teacher is None:
            return
        params = model if isinstance(model, dict) else dict(model.named_parameters())
        names = list(self.teacher)
        teacher = [self.teacher[n] for n in names]
        if stepping is None:
            teacher_ema_(teacher, [params[n] for n in names], 1.0 - self.settings.beta)
            return
        one_minus = torch.where(stepping, 1.0 - self.betas, 0.0).to(teacher[0].dtype)
        shaped = {}
        for t in teacher:
            if t.dim() not in shaped:
                shaped[t.dim()] = one_minus.view((-1,) + (1,) * (t.dim() - 1))
        teacher_ema_(teacher, [params[n] for n in names], [shaped[t.dim()] for t in teacher])

    # -------------------------------------------------------------- the term, written once
    def term(self, model: nn.Module, task: str, batch: dict[str, torch.Tensor],
             clean: TaskOutput) -> torch.Tensor:
        """One trial's λ_task · R_s(θ) + μ · D_Breg(θ, θ̃) on this batch (its clean output
        ``clean``; what :func:`mtbert.techniques.losses.batch_loss` adds)."""
        compared = smart_output(task, clean)
        total = compared.new_zeros((), dtype=torch.float32)
        rng = self._replay_state(task, batch)
        if not self._has_term(task):
            return total
        return self._term(_OneModel(self, model), task, batch, compared, rng, total)

    def task_losses(self, task: str, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """N stacked trials' ``[N]``: L_t + λ_t·R_s + μ·D_Breg of each on its slice of
        ``batch``, its L_t :func:`~mtbert.techniques.losses.loss_and_output`'s as
        :func:`~mtbert.techniques.losses.batch_loss` takes it."""
        remembered = self.masks.remember() if self.masks is not None else None

        def loss_and_compared(model, b):
            loss, out = loss_and_output(model, task, b, self.cfg)
            return loss, smart_output(task, out)

        losses, compared = self.fused.map(loss_and_compared, batch)
        return losses + self._term(_Stacked(self, self.fused), task, batch, compared,
                                   remembered, torch.zeros_like(losses))

    def _term(self, forwards, task, batch, compared, rng, total) -> torch.Tensor:
        if self.lambda_on[task]:
            smooth = self._smoothness(forwards, task, batch, compared, rng)
            total = total + _against(self.values[f"lambda_{task}"], smooth) * smooth
        if self.teacher is not None:
            breg = self._bregman(forwards, task, batch, compared, rng)
            total = total + _against(self.values["mu"], breg) * breg
        return total

    def _perturbation(self, forwards, task, batch, compared, rng) -> tuple[dict, dict]:
        """x (detached) and the adversarial δ with ‖δ‖∞ ≤ ε, each trial's with its own η
        and ε (Jiang et al.'s Algorithm 1, :func:`ascend`)."""
        x, masks, delta = start_perturbation(forwards.embed(task, batch), batch,
                                             lambda k, e: forwards.noise(task, k, e))
        target = compared.detach()
        like = next(iter(x.values()))
        step = _against(self.step_size, like)
        eps = _against(self.values["eps"], like)

        def divergence_at(embeds):  # the trials' sum: each slice of δ gets its own gradient
            return forwards.divergence(task, forwards.compared(task, batch, rng, embeds),
                                       target, batch).sum()

        delta = ascend(x, delta, masks, divergence_at, self.settings.steps, step, eps,
                       lead=forwards.lead)
        return x, delta

    def _smoothness(self, forwards, task, batch, compared, rng) -> torch.Tensor:
        """R_s(θ) = ℓ_s(f(x + δ*; θ), f(x; θ)) (001 eq. 7); gradients reach θ through both."""
        x, delta = self._perturbation(forwards, task, batch, compared, rng)
        out = forwards.compared(task, batch, rng, {k: x[k] + delta[k] for k in x})
        return forwards.divergence(task, out, compared, batch)

    def _bregman(self, forwards, task, batch, compared, rng) -> torch.Tensor:
        """D_Breg(θ, θ̃) = ℓ_s(f(x; θ), f(x; θ̃)) (004 eq. 6); the teacher under no_grad."""
        with torch.no_grad():
            out = forwards.compared(task, batch, rng, tensors=self.teacher)
        return forwards.divergence(task, compared, out.detach(), batch)

    # -------------------------------------------------------------- one trial's parts
    def perturbation(self, model, task, batch, clean: TaskOutput, rng=None) -> tuple[dict, dict]:
        """One trial's x and δ* (:meth:`_perturbation`)."""
        return self._perturbation(_OneModel(self, model), task, batch,
                                  smart_output(task, clean), rng)

    def smoothness(self, model, task, batch, clean: TaskOutput, rng=None) -> torch.Tensor:
        return self._smoothness(_OneModel(self, model), task, batch,
                                smart_output(task, clean), rng)

    def divergence_at(self, model, task, batch, clean: TaskOutput, x, delta,
                      rng=None) -> torch.Tensor:
        """One trial's ℓ_s(f(x + δ; θ), f(x; θ)) for a given perturbation δ."""
        forwards = _OneModel(self, model)
        out = forwards.compared(task, batch, rng, {k: x[k] + delta[k] for k in x})
        return forwards.divergence(task, out, smart_output(task, clean), batch)

    def bregman(self, model, task, batch, clean: TaskOutput, rng=None) -> torch.Tensor:
        return self._bregman(_OneModel(self, model), task, batch, smart_output(task, clean), rng)


def build_regulariser(cfg: TrainConfig, model) -> SmartRegulariser | None:
    """None when every λ and μ are 0: the trainer then adds nothing (the plain loss)."""
    if all(cfg.smart_lambda(t) == 0 for t in TASK_NAMES) and cfg.smart_mu == 0:
        return None
    return SmartRegulariser(cfg, model)
