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
from torch.func import functional_call

from mtbert.core.config import TrainConfig
from mtbert.data import ROW_WEIGHTS
from mtbert.techniques.losses import weighted_mean
from mtbert.model.model import TaskOutput
from mtbert.core.tasks import TASK_NAMES

_TINY = 1e-12


# ---------------------------------------------------------------------- divergences ℓ_s
def _wide(x: torch.Tensor) -> torch.Tensor:
    """fp32 for low-precision tensors, float64 kept (so tests can run in double)."""
    return x if x.dtype == torch.float64 else x.float()


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
def _rng_state(device: torch.device):
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda, device


def _set_rng_state(state) -> None:
    cpu, cuda, device = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda, device)


class EagerRngReplay:
    """Replays the clean forward's random numbers by saving torch's RNG state before it and
    setting it again around each replaying forward (host copies of the state: eager only;
    :class:`mtbert.step_graphs.GraphRngReplay` is the capturable twin)."""

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

    @torch.no_grad()
    def after_step(self, model: nn.Module) -> None:
        """θ̃ ← β θ̃ + (1 − β) θ (momentum Bregman proximal point, Jiang et al. 2020 §3)."""
        if self.teacher is None:
            return
        params = dict(model.named_parameters())
        names = list(self.teacher)
        teacher = [self.teacher[n] for n in names]
        beta = self.settings.beta
        torch._foreach_mul_(teacher, beta)
        torch._foreach_add_(teacher, [params[n].detach() for n in names], alpha=1.0 - beta)

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
        x = {k: e.detach() for k, e in model.embed_inputs(task, batch).items()}
        masks = {k: batch[_MASK_KEY[k]].unsqueeze(-1).to(x[k].dtype) for k in x}
        delta = {k: self.initial_noise(x[k]) * masks[k] for k in x}  # real tokens only
        target = smart_output(task, clean).detach()
        weights = batch.get(ROW_WEIGHTS)
        for _ in range(self.settings.steps):
            delta = {k: d.requires_grad_(True) for k, d in delta.items()}
            out = self._forward(model, task, batch, rng, {k: x[k] + delta[k] for k in x})
            div = divergence(task, smart_output(task, out), target, weights)
            keys = list(delta)
            grads = torch.autograd.grad(div, [delta[k] for k in keys], allow_unused=True)
            grads = {k: (g if g is not None else torch.zeros_like(delta[k]))
                     for k, g in zip(keys, grads)}
            # per-example ‖g̃‖∞ over every perturbed token of the example
            norm = torch.stack([g.abs().flatten(1).amax(1) for g in grads.values()]).amax(0)
            norm = norm.view(-1, 1, 1) + _TINY
            # x̃ ← Π_{‖x̃−x‖∞≤ε}(x̃ + η g̃/‖g̃‖∞): ascent step, then element-wise clamp
            eps = self.values["eps"]
            step = self.settings.step_size
            delta = {k: (torch.clamp(delta[k].detach() + step * grads[k] / norm,
                                     -eps, eps) * masks[k]) for k in keys}
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


def build_regulariser(cfg: TrainConfig, model) -> SmartRegulariser | None:
    """None when every λ and μ are 0: the trainer then adds nothing (the plain loss)."""
    if all(cfg.smart_lambda(t) == 0 for t in TASK_NAMES) and cfg.smart_mu == 0:
        return None
    return SmartRegulariser(cfg, model)
