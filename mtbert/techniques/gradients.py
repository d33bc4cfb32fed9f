"""Gradient combiners: take per-task losses and leave ``.grad`` set on the parameters.

* ``SumGradients``: plain backpropagation of Σ_i L_i (+ extra).
* ``PCGradGradients`` (Yu et al. 2020; report 003 eqs. 2-4, report 002 §4.2.2): the
  gradient of each task's loss w.r.t. the shared encoder parameters is taken
  separately; for each task i, in a random order of the other tasks j, the part of
  g_i that conflicts with g_j is projected away,

      if g_i^PC · g_j < 0:   g_i^PC ← g_i^PC − (g_i^PC · g_j / ‖g_j‖²) g_j,

  (always against the *original* g_j) and the shared gradient is Σ_i g_i^PC.
  Parameters outside ``shared`` (task heads, learned loss weights) get ordinary
  gradients (the backward of Σ_i L_i); the ``extra`` term (the L1/L2 penalty) adds its
  gradient unprojected.

Implementation: one ordinary ``backward`` per task loss (no second pass): after each
one the shared gradients are moved out of ``.grad`` into a flat vector, while the
other parameters keep accumulating, so the cost is that of plain backprop plus the
projection. Memory: one flat copy of the shared gradient per task plus the sum (for
MiniLM-L6, ~91 MB each in fp32). The task losses must come from separate forward
passes (separate graphs), as the trainer produces them.

Written once for one trial and for N stacked trials (a fused step): with a trial axis
the shared parameters are ``[N, ...]`` (each trial's gradient in its slice: the trials
share no weight), a task's flat gradient is ``[N, D]``, and each trial projects in its own
random order of the other tasks (the orders as ``[N]`` index tensors), in one batched
projection for all the trials.  A task that a trial does not train in the step has
g = 0 there: it projects nothing and is projected to 0.
"""

from __future__ import annotations

from typing import Sequence, Union

import torch
from torch import nn

_TINY = 1e-30

#: the task j to project against: one for every trial, or ``[N]``: each trial's own
Other = Union[int, torch.Tensor]


def random_orders(n: int, generator: torch.Generator | None = None) -> list[list[int]]:
    """For each task i, the other tasks in a random order, drawn from ``generator`` (a
    trial's stream, :mod:`mtbert.core.trial_streams`; None: torch's global one)."""
    orders = []
    for i in range(n):
        perm = torch.randperm(n, generator=generator).tolist()
        orders.append([j for j in perm if j != i])
    return orders


def _dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a · b of flat gradients: a number for ``[D]``, one a trial (``[N, 1]``) for ``[N, D]``."""
    return torch.dot(a, b) if a.dim() == 1 else (a * b).sum(-1, keepdim=True)


def project_conflicting(grads: Sequence[torch.Tensor],
                        orders: Sequence[Sequence[Other]] | None = None) -> list[torch.Tensor]:
    """PCGrad's projection on flat per-task gradients; returns the projected g_i^PC.

    ``grads[i]``: task i's gradient, ``[D]`` (one trial) or ``[N, D]`` (N trials).
    ``orders[i]`` lists the tasks j that g_i is projected against, in that order (default:
    :func:`random_orders`, torch's global RNG): ints, or ``[N]`` long tensors of each
    trial's j. Pure: the inputs are not modified.
    """
    n = len(grads)
    if orders is None:
        orders = random_orders(n) if n > 1 else [[]] * n
    squared = [_dot(g, g) for g in grads]
    if any(isinstance(j, torch.Tensor) for order in orders for j in order):
        every = torch.arange(grads[0].shape[0], device=grads[0].device)
        stacked, stacked_squared = torch.stack(list(grads)), torch.stack(squared)

        def pick(j: Other):  # each trial's g_j and ‖g_j‖²
            if isinstance(j, torch.Tensor):
                return stacked[j, every], stacked_squared[j, every]
            return grads[j], squared[j]
    else:
        def pick(j: Other):
            return grads[j], squared[j]
    out = []
    for i in range(n):
        g = grads[i]
        for j in orders[i]:
            if isinstance(j, int) and j == i:
                continue
            other, other_squared = pick(j)
            # coefficient min(g·g_j, 0) / ‖g_j‖²: zero unless the two conflict (003 eq. 4)
            coef = torch.clamp(_dot(g, other), max=0.0) / torch.clamp(other_squared, min=_TINY)
            g = g - coef * other
        out.append(g)
    return out


def pcgrad(grads: Sequence[torch.Tensor],
           orders: Sequence[Sequence[Other]] | None = None) -> torch.Tensor:
    """Σ_i g_i^PC: the combined shared gradient (``[D]``, or ``[N, D]``)."""
    projected = project_conflicting(grads, orders)
    total = projected[0]
    for g in projected[1:]:
        total = total + g
    return total


def trial_orders(tasks: list[str], trial_tasks: list[list[str] | None], draw,
                 device: torch.device) -> list[list[torch.Tensor]]:
    """N trials' random task orders as :func:`project_conflicting` takes them: for task i of
    ``tasks`` and place k, an ``[N]`` tensor of each trial's j (an index into ``tasks``).
    ``trial_tasks[n]``: trial n's tasks in the step, in its order (None: it does not step);
    ``draw(n, count)``: :func:`random_orders` of ``count`` tasks as trial n draws them (its
    solo run's draws, from its own stream).  A trial's places of the tasks it lacks go to
    those tasks (g = 0 there), and a task it lacks is projected against itself (0 too)."""
    size = len(tasks)
    rows = []
    for n, own in enumerate(trial_tasks):
        own = list(own or [])
        absent = [tasks.index(t) for t in tasks if t not in own]
        local = draw(n, len(own)) if len(own) > 1 else []
        table = []
        for i, task in enumerate(tasks):
            if task in own:
                mine = [tasks.index(own[j]) for j in local[own.index(task)]] if local else []
                table.append(mine + absent)
            else:
                table.append([i] * (size - 1))
        rows.append(table)
    every = torch.tensor(rows, dtype=torch.long, device=device).view(len(rows), size, size - 1)
    return [list(places.unbind(0)) for places in every.permute(1, 2, 0).unbind(0)]


class GradientCombiner:
    """The backward of a step's task losses (+ ``extra``, the penalty) into ``shared``'s
    gradients; ``orders`` and ``trials`` as :func:`pcgrad_backward` takes them (one model's
    parameters, or N trials' stacked ones)."""

    def backward(self, losses: dict[str, torch.Tensor], shared: list[nn.Parameter],
                 extra: torch.Tensor | None = None,
                 orders: Sequence[Sequence[Other]] | None = None,
                 trials: int | None = None) -> None:
        raise NotImplementedError


class SumGradients(GradientCombiner):
    """Plain backpropagation of Σ_i L_i (+ extra); one model's or N trials' alike."""

    def backward(self, losses, shared, extra=None, orders=None, trials=None):
        total = sum(losses.values())
        if extra is not None:
            total = total + extra
        total.backward()


def _take_grads(params: list[torch.Tensor], touched: list[bool],
                trials: int | None = None) -> torch.Tensor:
    """Concatenate the params' ``.grad`` (zeros where None) and clear them: ``[D]``, or with
    ``trials`` (stacked ``[N, ...]`` params) ``[N, D]``, the gradients then zeroed in place
    (they stay the tensors a fused optimizer holds) rather than dropped."""
    parts = []
    for k, p in enumerate(params):
        if p.grad is None:
            shape = (p.numel(),) if trials is None else (trials, p[0].numel())
            parts.append(torch.zeros(shape, dtype=p.dtype, device=p.device))
        else:
            touched[k] = True
            parts.append(p.grad.reshape(-1) if trials is None else p.grad.reshape(trials, -1))
            if trials is None:
                p.grad = None
    flat = torch.cat(parts, dim=-1)
    if trials is not None:
        torch._foreach_zero_([p.grad for p in params if p.grad is not None])
    return flat


def pcgrad_backward(losses: dict[str, torch.Tensor], shared: list[torch.Tensor],
                    extra: torch.Tensor | None = None,
                    orders: Sequence[Sequence[Other]] | None = None,
                    trials: int | None = None) -> None:
    """PCGrad's gradients (see the module doc): ``losses`` task -> loss (one graph each),
    ``extra`` the penalty (added unprojected), ``orders`` as :func:`project_conflicting`
    takes them.  ``trials``: None for one model's parameters; N for stacked ``[N, ...]``
    ones (a fused step: each loss the trials' sum, each trial's gradient in its slice;
    their ``.grad`` is 0 or None when the step starts and is kept, every shared one set)."""
    shared = [p for p in shared if p.requires_grad]
    previous = [p.grad for p in shared]  # normally all None (zero_grad(set_to_none))
    if trials is None:
        for p in shared:
            p.grad = None
    touched = [False] * len(shared)
    flats = []
    for loss in losses.values():
        loss.backward()
        flats.append(_take_grads(shared, touched, trials))
    total = pcgrad(flats, orders)
    if extra is not None:
        extra.backward()
        total = total + _take_grads(shared, touched, trials)
    if trials is not None:
        for p, g in zip(shared, total.split([p[0].numel() for p in shared], -1)):
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            p.grad.add_(g.reshape(p.shape))
        return
    for p, g, old, used in zip(shared, total.split([p.numel() for p in shared]),
                               previous, touched):
        if not used:
            p.grad = old  # no loss reached it: leave it as plain backprop would
            continue
        g = g.view_as(p)
        p.grad = g if old is None else old + g


class PCGradGradients(GradientCombiner):
    """PCGrad on the shared parameters, ordinary gradients elsewhere (see module doc)."""

    def backward(self, losses, shared, extra=None, orders=None, trials=None):
        pcgrad_backward(losses, shared, extra, orders, trials)


def build_gradient_combiner(cfg) -> GradientCombiner:
    if getattr(cfg, "pcgrad", False):
        return PCGradGradients()
    return SumGradients()
