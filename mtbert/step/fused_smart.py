"""SMART for fused trials: :mod:`mtbert.smart`'s regulariser over N stacked trials.

Each trial's loss on a task batch is its solo ``batch_loss`` with SMART's term
(report 004 eqs. 2-6):

    L_t + λ_t · R_s(θ) + μ · D_Breg(θ, θ̃),   θ̃ ← β θ̃ + (1 − β) θ after each step,

with λ_t, ε, μ, β, the noise σ and the ascent step η each trial's own (``[N]`` tensors);
which terms are on (λ_t > 0, μ > 0) and the number of ascent steps are the group's
structure (:func:`mtbert.graph_reuse.structure`).  The forwards are the fused model's
(:meth:`mtbert.fused_model.FusedModel.map`); the ascent's gradient is one
``autograd.grad`` of the sum of the trials' divergences (trial n's slice of δ gets its
own), its per-example ‖g̃‖∞, step and clamp act on the ``[N, rows, tokens, hidden]`` δ.

Noise.  A solo run draws ν from torch's global RNG, seeded by its trainer.  Here each
trial has its own copy of that stream (:class:`TrialStreams`, taken right after its
construction) and draws its ν from it in its solo batch's shape and task order, so with
dropout 0 a fused trial's noise, and so its run, is its solo run's (on a CPU: a solo run on
CUDA holds its dropout rate in a device tensor and draws masks from that stream even at
rate 0, so there the two draw their noise at other points of it).  The trial's own
bookkeeping (evaluations, checkpoints) also runs on its stream, so its checkpoint holds it.
Dropout masks come from the process's RNG (:mod:`mtbert.fused_model`); the regulariser's
forwards replay the clean forward's masks as the solo regulariser does.

The teacher: ``[N, ...]`` copies of the trainable weights; each trial's own
:class:`~mtbert.smart.SmartRegulariser` holds views of its slices (its checkpoint's state).
"""

from __future__ import annotations

import contextlib

import torch
from torch.func import vmap

from mtbert.data import ROW_WEIGHTS, encoding_for
from mtbert.step.fused_model import FusedModel
from mtbert.techniques.losses import task_loss
from mtbert.techniques.smart import (_MASK_KEY, _TINY, EagerRngReplay, SmartRegulariser, _rng_state,
                          _set_rng_state, divergence, smart_output)
from mtbert.core.tasks import TASK_NAMES


class TrialStreams:
    """Each fused trial's torch random stream (CPU, and the device's on CUDA), as its solo
    run would hold the global one, by trial; :meth:`of` runs a block on a trial's stream."""

    def __init__(self):
        self.states: dict = {}

    def add(self, trial, device: torch.device) -> None:
        """``trial``'s stream starts at the global state now (right after its construction
        seeded it and drew its initial weights, or restored a checkpoint's)."""
        self.states[trial] = _rng_state(device)

    def drop(self, trial) -> None:
        self.states.pop(trial, None)

    @contextlib.contextmanager
    def of(self, trial):
        state = self.states[trial]
        process = _rng_state(state[2])
        _set_rng_state(state)
        try:
            yield
        finally:
            if trial in self.states:  # not dropped meanwhile
                self.states[trial] = _rng_state(state[2])
            _set_rng_state(process)


def _loss_and_compared(model, task: str, batch: dict[str, torch.Tensor], cfg):
    """One trial's task loss (as :func:`mtbert.losses.batch_loss`, before its SMART term)
    and what ℓ_s compares of its clean output."""
    out = model(task, batch)
    return (task_loss(task, out, batch["labels"], cfg, batch.get(ROW_WEIGHTS)),
            smart_output(task, out))


class FusedSmart:
    """``task_losses(task, batch)``: each trial's loss with its SMART term (``[N]``);
    ``draw_noise`` before a step's forwards, ``after_step`` after its update."""

    def __init__(self, fused: FusedModel, regularisers: list[SmartRegulariser],
                 streams: TrialStreams, trials: list, cfg):
        """``trials``: the keys of the trials' streams, by slot."""
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
        self.betas = [s.beta for s in settings]
        self.teacher_betas = per_trial(self.betas)
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
        self._noise: dict[str, dict[int, list[torch.Tensor]]] = {}

    # -------------------------------------------------------------- noise
    def draw_noise(self, batches: dict[int, dict[str, dict[str, torch.Tensor]]]) -> None:
        """ν ~ N(0, σ_n² I) for every trial's task batches of this step (host batches), from
        the trial's stream, in its solo shape and order (its tasks, then ``a`` before ``b``)."""
        self._noise = {}
        if not any(self.lambda_on.values()):
            return
        hidden, dtype = self.embedding.shape[-1], self.embedding.dtype
        for n, trial_batches in batches.items():
            with self.streams.of(self.trials[n]):
                for task, batch in trial_batches.items():
                    if not self.lambda_on[task]:
                        continue
                    keys = (["input_ids_a", "input_ids_b"]
                            if encoding_for(task, self.cfg.pair_encoding) == "siamese"
                            else ["input_ids"])
                    self._noise.setdefault(task, {})[n] = [
                        torch.randn(batch[k].shape + (hidden,), dtype=dtype,
                                    device=self.embedding.device) * self.noise_std[n]
                        for k in keys]

    def _initial_delta(self, task: str, x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The drawn ν of each trial placed in the stacked (padded) shape; 0 elsewhere."""
        delta = {k: torch.zeros_like(e) for k, e in x.items()}
        for n, parts in self._noise.get(task, {}).items():
            for k, nu in zip(delta, parts):
                delta[k][n, :nu.shape[0], :nu.shape[1]] = nu
        return delta

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
        """R_s = ℓ_s(f(x + δ*; θ), f(x; θ)) per trial, δ* from the ascent of Jiang et al.'s
        Algorithm 1 (see :meth:`mtbert.smart.SmartRegulariser.perturbation`)."""
        x = {k: e.detach() for k, e in
             self.fused.map(lambda model, b: model.embed_inputs(task, b), batch).items()}
        masks = {k: batch[_MASK_KEY[k]].unsqueeze(-1).to(x[k].dtype) for k in x}
        delta = {k: d * masks[k] for k, d in self._initial_delta(task, x).items()}
        target = compared.detach()
        shape = (-1,) + (1,) * 3  # a per-trial value against [N, rows, tokens, hidden]
        step = self.step_size.to(next(iter(x.values())).dtype).view(shape)
        eps = self.eps.to(step.dtype).view(shape)
        for _ in range(self.steps):
            delta = {k: d.requires_grad_(True) for k, d in delta.items()}
            out = self._compared(task, batch, remembered, {k: x[k] + delta[k] for k in x})
            div = self._divergence(task, out, target, batch)
            keys = list(delta)
            grads = torch.autograd.grad(div.sum(), [delta[k] for k in keys], allow_unused=True)
            grads = {k: (g if g is not None else torch.zeros_like(delta[k]))
                     for k, g in zip(keys, grads)}
            # per-example ‖g̃‖∞ over every perturbed token of the example: [N, rows]
            norm = torch.stack([g.abs().flatten(2).amax(2) for g in grads.values()]).amax(0)
            norm = norm[..., None, None] + _TINY
            # x̃ ← Π_{‖x̃−x‖∞≤ε}(x̃ + η g̃/‖g̃‖∞), each trial with its η and ε
            delta = {k: torch.clamp(delta[k].detach() + step * grads[k] / norm, -eps, eps)
                     * masks[k] for k in keys}
        out = self._compared(task, batch, remembered, {k: x[k] + delta[k] for k in x})
        return self._divergence(task, out, compared, batch)

    def bregman(self, task, batch, compared, remembered) -> torch.Tensor:
        """D_Breg = ℓ_s(f(x; θ), f(x; θ̃)) per trial; the teachers run under no_grad."""
        with torch.no_grad():
            out = self._compared(task, batch, remembered, tensors=self.teacher)
        return self._divergence(task, compared, out.detach(), batch)

    @torch.no_grad()
    def after_step(self, stepping: torch.Tensor) -> None:
        """θ̃_n ← β_n θ̃_n + (1 − β_n) θ_n for each trial that stepped (``stepping``: ``[N]``
        bool on the device): θ̃ + w (θ − θ̃) with w_n = (1 − β_n) where trial n stepped, 0
        elsewhere (a trial that did not step keeps its teacher bit for bit); one op per
        parameter for all the trials."""
        if self.teacher is None:
            return
        weight = stepping.to(self.teacher_betas.dtype) * (1.0 - self.teacher_betas)
        for k, teacher in self.teacher.items():
            teacher.lerp_(self.fused.params[k].detach(),
                          weight.to(teacher.dtype).view((-1,) + (1,) * (teacher.dim() - 1)))
