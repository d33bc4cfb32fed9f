"""PCGrad for fused trials: :mod:`mtbert.gradients`' projection, batched over the trial axis.

Each task's loss, summed over the trials, is backpropagated alone: trial n's slice of
each shared (encoder) gradient is then g_t of trial n (the trials share no weight).  The
gradients go into a ``[tasks, N, D]`` tensor (D: the shared parameters flattened) and
the projection of Yu et al. (2020; report 003 eqs. 2-4) runs for all trials at once,

    for each task i, in trial n's random order of the other tasks j:
        g_i^PC ← g_i^PC − min(g_i^PC · g_j, 0) / ‖g_j‖² · g_j     (against the original g_j),

and the shared gradient is Σ_i g_i^PC (the L1/L2 penalty's gradient added unprojected);
the task heads and learned loss weights keep their ordinary accumulated gradients.  A
trial's random orders come from its own stream (:class:`mtbert.fused_smart.TrialStreams`),
drawn as its solo run draws them (:func:`mtbert.gradients.random_orders` over its own
tasks, in its order), so a fused trial's projection is its solo run's.  A task that a
trial does not train in the step has g = 0 there: it projects nothing and is projected
to 0, so trials with different task sets share the one batched projection.
"""

from __future__ import annotations

import torch

from mtbert.step.fused_smart import TrialStreams
from mtbert.techniques.gradients import random_orders

_TINY = 1e-30  # mtbert.gradients' floor of ‖g_j‖²


def project_trials(grads: torch.Tensor, orders: torch.Tensor) -> torch.Tensor:
    """Σ_i g_i^PC per trial: ``grads`` ``[T, N, D]``, ``orders`` ``[N, T, T − 1]`` (for
    trial n and task i, the tasks j to project against, in order) -> ``[N, D]``."""
    tasks, trials = grads.shape[0], grads.shape[1]
    every = torch.arange(trials, device=grads.device)
    squared = torch.linalg.vecdot(grads, grads)  # ‖g_j‖², [T, N]
    total = torch.zeros_like(grads[0])
    for i in range(tasks):
        g = grads[i].clone()
        for k in range(tasks - 1):
            j = orders[:, i, k]
            other = grads[j, every]  # each trial's g_j, [N, D]
            dot = torch.linalg.vecdot(g, other)
            # min(g·g_j, 0) / ‖g_j‖²: 0 unless the two conflict (003 eq. 4)
            coef = torch.clamp(dot, max=0.0) / torch.clamp(squared[j, every], min=_TINY)
            g = g - coef.unsqueeze(1) * other
        total = total + g
    return total


class FusedPCGrad:
    """``backward(task_losses, extra, batches)``: leaves PCGrad's gradients on the stacked
    parameters (see the module doc); ``shared``: the stacked encoder parameters."""

    def __init__(self, shared: list[torch.Tensor], streams: TrialStreams, trials: list):
        """``trials``: the keys of the trials' streams, by slot."""
        self.shared, self.streams, self.trials = shared, streams, trials

    def _take(self) -> torch.Tensor:
        """The shared gradients as ``[N, D]``, then zeroed in place (a later backward
        accumulates from 0; the tensors stay the optimizer's)."""
        n = self.shared[0].shape[0]
        flat = torch.cat([p.grad.reshape(n, -1) if p.grad is not None
                          else p.new_zeros(n, p[0].numel()) for p in self.shared], dim=1)
        torch._foreach_zero_([p.grad for p in self.shared if p.grad is not None])
        return flat

    def orders(self, tasks: list[str], batches: dict[int, dict]) -> torch.Tensor:
        """``[N, T, T − 1]``: each trial's random orders over its own tasks (from its
        stream, as :func:`~mtbert.gradients.random_orders` draws them alone), as indices
        into ``tasks``; the places of the tasks it lacks go to those tasks (g = 0)."""
        size = len(tasks)
        trials = self.shared[0].shape[0]
        rows = []
        for n in range(trials):
            own = list(batches.get(n, {}))
            absent = [tasks.index(t) for t in tasks if t not in own]
            local = []
            if len(own) > 1:
                with self.streams.of(self.trials[n]):
                    local = random_orders(len(own))
            table = []
            for i, task in enumerate(tasks):
                if task in own:
                    mine = [tasks.index(own[j]) for j in local[own.index(task)]] if local else []
                    table.append(mine + absent)
                else:
                    table.append([i] * (size - 1))
            rows.append(table)
        return torch.tensor(rows, dtype=torch.long,
                            device=self.shared[0].device).view(trials, size, size - 1)

    def backward(self, task_losses: dict[str, torch.Tensor], extra: torch.Tensor | None,
                 batches: dict[int, dict]) -> None:
        """``task_losses``: task -> its weighted loss summed over the trials (one graph
        each); ``extra``: the summed penalty or None; ``batches``: the step's (each
        trial's tasks, in its order)."""
        tasks = list(task_losses)
        flats = []
        for task in tasks:
            task_losses[task].backward()
            flats.append(self._take())
        projected = project_trials(torch.stack(flats), self.orders(tasks, batches))
        if extra is not None:
            extra.backward()  # the penalty's gradient, added unprojected
        n = projected.shape[0]
        for p, g in zip(self.shared, projected.split([p[0].numel() for p in self.shared], 1)):
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            p.grad.add_(g.reshape(n, *p.shape[1:]))
