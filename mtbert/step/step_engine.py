"""Step engines: what trains one optimizer step of one or more trials.

An engine's one method, ``step({trial: batches}) -> {trial: {task: loss}}``, trains one
optimizer step of each trial given, on that trial's host ``batches`` ({task: batch}), and
returns its task losses (device tensors, not read on the host); the trial then counts the
step (:meth:`mtbert.run.trial_run.TrialRun.stepped`).  Two engines:

* :class:`EagerStep` (here): the step as autograd runs it, of one trial or of N trials of
  one structure stacked on a trial axis.  The step's order -- each task's loss, the L1/L2
  penalty, the gradient combiner's backward, the update -- is written once, in
  :meth:`EagerStep.step`; what one trial and N trials do differently is behind
  :class:`TrialParts`: :class:`OneTrial` (here; N = 1 skips the trial axis, as HFTA's
  B = 0 is the plain module: the trial's own model, torch's clipping and AdamW) and
  :class:`~mtbert.step.stacked_trials.StackedTrials` (N >= 2: the stacked model, the
  per-trial AdamW).  Each technique's math is the same module's for both
  (docs/architecture.md, "Where each technique's math lives").
* :class:`~mtbert.step.step_graphs.StepGraphs`: one trial, the step from captured CUDA
  graphs.

:func:`task_loss_terms` is one trial's per-task loss, which the graphed step captures too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from mtbert.core.devices import to_device
from mtbert.techniques.gradients import random_orders
from mtbert.techniques.losses import batch_loss
from mtbert.techniques.trial_update import TrialUpdate

if TYPE_CHECKING:
    from mtbert.run.trial_run import Batches, TrialRun


class StepEngine(Protocol):
    def step(self, batches: dict[TrialRun, Batches]) -> dict[TrialRun, dict[str, torch.Tensor]]:
        """One optimizer step of each trial in ``batches`` on its host batches; each one's
        task losses."""


class TrialParts(Protocol):
    """What :class:`EagerStep` asks of the trials it steps, one step at a time."""

    def begin(self, batches: dict[TrialRun, Batches]) -> list[str]:
        """A step of the trials in ``batches`` begins; the tasks it trains, in the order
        their losses are taken."""

    def task_loss(self, task: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``task``'s batch forward: (its loss as the trials note it -- a scalar, or ``[N]``
        --; its weighted term to differentiate, summed over the trials stepping it)."""

    def penalty(self) -> torch.Tensor | None:
        """The L1/L2 weight penalty of the stepping trials, summed; None when off."""

    def backward(self, terms: dict[str, torch.Tensor], penalty: torch.Tensor | None) -> None:
        """The gradient combiner's backward (plain sum or PCGrad) of ``terms`` + penalty."""

    def update(self) -> None:
        """Clipping, AdamW, the SMART teacher's EMA; the gradients cleared for the next."""

    def losses_of(self, losses: dict[str, torch.Tensor],
                  batches: dict[TrialRun, Batches]) -> dict[TrialRun, dict[str, torch.Tensor]]:
        """Each stepping trial's task losses, from the step's ``losses``."""


class EagerStep:
    """The eager step engine, of one trial or N stacked ones (``parts``): the step's order,
    written once for both."""

    def __init__(self, parts: TrialParts):
        self.parts = parts

    def step(self, batches: dict[TrialRun, Batches]) -> dict[TrialRun, dict[str, torch.Tensor]]:
        parts = self.parts
        losses, terms = {}, {}
        for task in parts.begin(batches):
            losses[task], terms[task] = parts.task_loss(task)
        parts.backward(terms, parts.penalty())
        parts.update()
        return parts.losses_of(losses, batches)


def task_loss_terms(trial: TrialRun, task: str, batch: dict[str, torch.Tensor],
                    cast_cache: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """One task batch on ``trial``'s model in training mode: (the task loss, as the trial
    notes it; the loss weighting's term for it, the one to differentiate).  The forward,
    task loss and SMART term are :func:`mtbert.techniques.losses.batch_loss`'s, under bf16
    autocast on CUDA; ``cast_cache=False`` inside a CUDA-graph capture (the casts are
    captured too)."""
    trial.model.train()
    with torch.autocast(trial.device.type, dtype=torch.bfloat16, enabled=trial.autocast,
                        cache_enabled=cast_cache):
        loss = batch_loss(trial.model, task, batch, trial.cfg, trial.regulariser)
    return loss, trial.loss_combiner.weighted({task: loss})[task]


class OneTrial:
    """One trial's parts of the step (no trial axis): its model and loss weighting, its
    gradient combiner, its update (torch's ``clip_grad_norm_`` and AdamW, its SMART
    teacher's EMA).  Its draws are from its own stream (``trial.generator``): its masks'
    seed as the step begins, SMART's noise, PCGrad's orders."""

    def __init__(self, trial: TrialRun):
        self.trial = trial
        self.batches: Batches = {}
        #: the update (:class:`~mtbert.techniques.trial_update.TrialUpdate`): torch's
        #: clipping and the trial's own AdamW, its SMART teacher's EMA
        self.updater = TrialUpdate(trial.optimizer, trial.cfg.max_grad_norm,
                                   trial.regulariser, trial.model)

    def begin(self, batches: dict[TrialRun, Batches]) -> list[str]:
        (trial, host), = batches.items()
        if trial is not self.trial:
            raise ValueError("a one-trial step was given another trial's batches")
        if trial.cfg.compile == "reduce-overhead":  # CUDA graphs: a new iteration begins
            torch.compiler.cudagraph_mark_step_begin()
        self.updater.clear()
        trial.mask_stream.draw({0: trial.generator})
        self.batches = {task: to_device(b, trial.device) for task, b in host.items()}
        return list(self.batches)

    def task_loss(self, task: str) -> tuple[torch.Tensor, torch.Tensor]:
        self.trial.mask_stream.start(task)
        return task_loss_terms(self.trial, task, self.batches[task])

    def penalty(self) -> torch.Tensor | None:
        return self.trial.loss_combiner.penalty(self.trial.model)

    def backward(self, terms: dict[str, torch.Tensor], penalty: torch.Tensor | None) -> None:
        t = self.trial
        # PCGrad's task orders from the trial's stream, after its noise (as stacked)
        orders = (random_orders(len(terms), t.generator) if t.cfg.pcgrad and len(terms) > 1
                  else None)
        t.grad_combiner.backward(terms, t.model.shared_parameters(), penalty, orders)

    def update(self) -> None:
        self.updater.step()
        self.batches = {}

    def losses_of(self, losses, batches):
        return {self.trial: losses}


def reached_parameters(loss: torch.Tensor) -> set[int]:
    """ids of the leaf tensors whose gradient ``loss.backward()`` would set (the
    AccumulateGrad nodes of its autograd graph)."""
    found, seen, stack = set(), set(), [loss.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        variable = getattr(fn, "variable", None)
        if variable is not None:
            found.add(id(variable))
        stack.extend(next_fn for next_fn, _ in fn.next_functions)
    return found
