"""The update that closes a training step, written once for one trial, N stacked trials
and pre-training: each trial's gradients clipped to its norm, AdamW, SMART's teacher
following the weights (EMA), and the gradients cleared for the next step.

One trial holds torch's AdamW (its fused kernel where torch has one) and clips with
``torch.nn.utils.clip_grad_norm_``: as HFTA's ``B = 0`` gives the plain optimizer, so one
trial keeps torch's update cost.  N stacked trials hold a
:class:`~mtbert.techniques.trial_adamw.TrialAdamW`, whose clip and step take each trial's
values and a mask per parameter (the trials whose step reached it) as ``[N]`` device
tensors.  The order is the same for both; only the kernels differ.  (The captured CUDA
step, :mod:`mtbert.step.step_graphs`, keeps its own update until a GPU can run its tests.)
"""

from __future__ import annotations

import torch
from torch import nn

from mtbert.techniques.trial_adamw import TrialAdamW


class TrialUpdate:
    """``step(...)`` after a step's backward; ``clear()`` where the next step's gradients
    must start from nothing.

    ``optimizer``: one trial's torch optimizer, or N trials' :class:`TrialAdamW`;
    ``max_norm``: the clipping norm (one trial: a number, 0 = none; N trials: ``[N]``, 0 for
    a trial that does not clip); ``regulariser``: SMART's (its teacher follows ``weights``
    after each step; None: no teacher); ``weights``: what the teacher follows, one trial's
    model or the stacked tensors (name -> ``[N, ...]``)."""

    def __init__(self, optimizer: torch.optim.Optimizer | TrialAdamW,
                 max_norm: float | torch.Tensor, regulariser=None,
                 weights: nn.Module | dict[str, torch.Tensor] | None = None):
        self.optimizer = optimizer
        self.max_norm = max_norm
        self.regulariser = regulariser
        self.weights = weights
        self.stacked = isinstance(optimizer, TrialAdamW)

    def clear(self) -> None:
        """The gradients gone: one trial's set to None (the parameters its next step does
        not reach then stay out of its AdamW step); N trials' zeroed in place (the per-trial
        optimizer holds them; which slices step is the masks' business)."""
        if self.stacked:
            grads = [p.grad for p in self.optimizer.params.values() if p.grad is not None]
            torch._foreach_zero_(grads)
        else:
            self.optimizer.zero_grad(set_to_none=True)

    def step(self, masks: dict[str, torch.Tensor] | None = None,
             lrs: torch.Tensor | None = None, stepping: torch.Tensor | None = None) -> None:
        """Clip, AdamW, the teacher's EMA.  N trials: ``masks`` name -> ``[N]`` 0/1 (the
        trials whose step reached the parameter), ``lrs`` ``[G, N]`` (each trial's learning
        rate per parameter group; its weight decays are the optimizer's), ``stepping``
        ``[N]`` bool (the trials that step: the others' teachers stay).  One trial: none of
        them (its optimizer's groups hold its rates)."""
        if self.stacked:
            self.optimizer.clip_(self.max_norm, masks)
            self.optimizer.step(lrs, masks)
        else:
            if self.max_norm:
                params = [p for g in self.optimizer.param_groups for p in g["params"]]
                torch.nn.utils.clip_grad_norm_(params, self.max_norm)
            self.optimizer.step()
        if self.regulariser is not None:
            self.regulariser.after_step(self.weights, stepping)
