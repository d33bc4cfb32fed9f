"""Step engines: what trains one optimizer step of one or more trials.

An engine's one method, ``step({trial: batches}) -> {trial: {task: loss}}``, trains one
optimizer step of each trial given, on that trial's host ``batches`` ({task: batch}), and
returns its task losses (device tensors, not read on the host); the trial then counts the
step (:meth:`mtbert.trial_run.TrialRun.stepped`).  Three engines:

* :class:`EagerStep` (here): one trial, the step as autograd runs it (any technique);
* :class:`~mtbert.step_graphs.StepGraphs`: one trial, the step from captured CUDA graphs;
* :class:`~mtbert.fused_training.FusedStep`: N trials of one structure, one ``vmap``-ed
  step over their stacked weights.

:func:`task_loss_terms` is the per-task loss the one-model engines differentiate.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from mtbert.core.devices import to_device
from mtbert.techniques.losses import batch_loss

if TYPE_CHECKING:
    from mtbert.run.trial_run import Batches, TrialRun


class StepEngine(Protocol):
    def step(self, batches: dict[TrialRun, Batches]) -> dict[TrialRun, dict[str, torch.Tensor]]:
        """One optimizer step of each trial in ``batches`` on its host batches; each one's
        task losses."""


def task_loss_terms(trial: TrialRun, task: str, batch: dict[str, torch.Tensor],
                    cast_cache: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """One task batch on ``trial``'s model in training mode: (the task loss, as the trial
    notes it; the loss weighting's term for it, the one to differentiate).  The forward,
    task loss and SMART term are :func:`mtbert.losses.batch_loss`'s, under bf16 autocast on
    CUDA; ``cast_cache=False`` inside a CUDA-graph capture (the casts are captured too)."""
    trial.model.train()
    with torch.autocast(trial.device.type, dtype=torch.bfloat16, enabled=trial.autocast,
                        cache_enabled=cast_cache):
        loss = batch_loss(trial.model, task, batch, trial.cfg, trial.regulariser)
    return loss, trial.loss_combiner.weighted({task: loss})[task]


class EagerStep:
    """One trial's eager step: the task losses, the gradient combiner's backward (plain
    sum or PCGrad) with the L1/L2 penalty, clipping, AdamW, the SMART teacher's EMA."""

    def __init__(self, trial: TrialRun):
        self.trial = trial

    def step(self, batches: dict[TrialRun, Batches]) -> dict[TrialRun, dict[str, torch.Tensor]]:
        (trial, host), = batches.items()
        return {trial: self.train({t: to_device(b, trial.device) for t, b in host.items()})}

    def train(self, batches: Batches) -> dict[str, torch.Tensor]:
        """One optimizer step on device ``batches``; the task losses."""
        t = self.trial
        if t.cfg.compile == "reduce-overhead":  # CUDA graphs: a new iteration begins
            torch.compiler.cudagraph_mark_step_begin()
        t.optimizer.zero_grad(set_to_none=True)
        losses, weighted = {}, {}
        for task, batch in batches.items():
            losses[task], weighted[task] = task_loss_terms(t, task, batch)
        penalty = t.loss_combiner.penalty(t.model)
        t.grad_combiner.backward(weighted, t.model.shared_parameters(), penalty)
        if t.cfg.max_grad_norm:
            params = [p for g in t.optimizer.param_groups for p in g["params"]]
            torch.nn.utils.clip_grad_norm_(params, t.cfg.max_grad_norm)
        t.optimizer.step()
        if t.regulariser is not None:
            t.regulariser.after_step(t.model)
        return losses
