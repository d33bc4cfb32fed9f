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
one the shared gradients are moved out of ``.grad`` into a row of one ``[T, D]`` tensor,
while the other parameters keep accumulating.  The projection is then done on the Gram
matrix of those rows (:func:`projection_weights`: each g_i^PC is a weighted sum of the
original g_k), and the shared gradient is one weighted sum of the rows, so the D-long
vectors are read twice in all; the cost is that of plain backprop plus those two passes.
Memory: the ``[T, D]`` rows plus the sum (for MiniLM-L6, ~91 MB a row in fp32). The task
losses must come from separate forward passes (separate graphs), as the trainer produces
them.

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


def _stacked(grads: Sequence[torch.Tensor] | torch.Tensor) -> torch.Tensor:
    """The flat per-task gradients as one ``[T, D]`` (or ``[T, N, D]``) tensor."""
    return grads if isinstance(grads, torch.Tensor) else torch.stack(list(grads))


def _gram(stacked: torch.Tensor) -> torch.Tensor:
    """Every task pair's g_a · g_b, as ``[N, T, T]`` (N = 1 without a trial axis): one
    GEMM over ``[T, D]``, one batched matmul a pair over ``[T, N, D]``."""
    if stacked.dim() == 2:
        return (stacked @ stacked.T).unsqueeze(0)
    size = stacked.shape[0]
    gram = stacked.new_empty(stacked.shape[1], size, size)
    for a in range(size):
        for b in range(a, size):
            dot = torch.bmm(stacked[a].unsqueeze(1), stacked[b].unsqueeze(2)).view(-1)
            gram[:, a, b] = dot
            gram[:, b, a] = dot
    return gram


def projection_weights(grads: Sequence[torch.Tensor] | torch.Tensor,
                       orders: Sequence[Sequence[Other]] | None = None) -> torch.Tensor:
    """PCGrad's projection as weights on the original gradients: ``A`` ``[N, T, T]`` with
    g_i^PC = Σ_k A[:, i, k] g_k (N = 1 without a trial axis).

    Each step g ← g − c g_j keeps g^PC a combination of the g_k, so every dot product the
    projection needs is one of the Gram matrix G_kj = g_k · g_j: g^PC · g_j = Σ_k a_k G_kj
    and ‖g_j‖² = G_jj (003 eq. 4 with these).  The D-long vectors are read once for G,
    where projecting them in place reads and writes them at every step.
    ``grads``, ``orders``: as :func:`project_conflicting` takes them."""
    stacked = _stacked(grads)
    size = stacked.shape[0]
    if orders is None:
        orders = random_orders(size) if size > 1 else [[]] * size
    gram = _gram(stacked)
    trials = gram.shape[0]
    every = torch.arange(trials, device=gram.device)
    tasks = torch.arange(size, device=gram.device)
    weights = torch.eye(size, dtype=gram.dtype, device=gram.device).repeat(trials, 1, 1)
    for i in range(size):
        a = weights[:, i, :]  # [N, T]: g_i^PC's weights, updated in place
        for j in orders[i]:
            if isinstance(j, int):
                if j == i:
                    continue
                column, squared, one = gram[:, :, j], gram[:, j, j], (tasks == j)
            else:  # each trial's own j ([N])
                column, squared = gram[every, :, j], gram[every, j, j]
                one = tasks == j.unsqueeze(-1)
            # coefficient min(g·g_j, 0) / ‖g_j‖²: zero unless the two conflict (003 eq. 4)
            coef = (torch.clamp((a * column).sum(-1), max=0.0)
                    / torch.clamp(squared, min=_TINY))
            a -= coef.unsqueeze(-1) * one.to(a.dtype)
    return weights


def _combined(stacked: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Σ_k weights[:, k] g_k of ``stacked`` ``[T, D]`` (weights ``[1, T]``) or ``[T, N, D]``
    (weights ``[N, T]``), summed in task order (weights of 1: the plain sum, bit for bit)."""
    # task k's factor: a number, or each trial's as [N, 1]
    factors = weights[0] if stacked.dim() == 2 else weights.unsqueeze(-1).unbind(1)
    total = stacked[0] * factors[0]
    for k in range(1, stacked.shape[0]):
        total.addcmul_(stacked[k], factors[k])
    return total


def project_conflicting(grads: Sequence[torch.Tensor] | torch.Tensor,
                        orders: Sequence[Sequence[Other]] | None = None) -> list[torch.Tensor]:
    """PCGrad's projection on flat per-task gradients; returns the projected g_i^PC.

    ``grads[i]``: task i's gradient, ``[D]`` (one trial) or ``[N, D]`` (N trials); or all
    of them stacked.  ``orders[i]`` lists the tasks j that g_i is projected against, in that
    order (default: :func:`random_orders`, torch's global RNG): ints, or ``[N]`` long
    tensors of each trial's j. Pure: the inputs are not modified.
    """
    stacked = _stacked(grads)
    weights = projection_weights(stacked, orders)
    return [_combined(stacked, weights[:, i, :]) for i in range(stacked.shape[0])]


def pcgrad(grads: Sequence[torch.Tensor] | torch.Tensor,
           orders: Sequence[Sequence[Other]] | None = None) -> torch.Tensor:
    """Σ_i g_i^PC: the combined shared gradient (``[D]``, or ``[N, D]``), as one weighted
    sum of the original gradients (:func:`projection_weights`, summed over i)."""
    stacked = _stacked(grads)
    return _combined(stacked, projection_weights(stacked, orders).sum(1))


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


def _take_grads(params: list[torch.Tensor], touched: list[bool], out: torch.Tensor,
                trials: int | None = None) -> torch.Tensor:
    """Concatenate the params' ``.grad`` (zeros where None) into ``out`` and clear them:
    ``[D]``, or with ``trials`` (stacked ``[N, ...]`` params) ``[N, D]``, the gradients then
    zeroed in place (they stay the tensors a fused optimizer holds) rather than dropped."""
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
    torch.cat(parts, dim=-1, out=out)
    if trials is not None:
        torch._foreach_zero_([p.grad for p in params if p.grad is not None])
    return out


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
    size = sum(p.numel() for p in shared) // (trials or 1)
    first = shared[0]
    # the tasks' flat gradients, stacked as they are taken: [T, D] or [T, N, D]
    flats = torch.empty((len(losses), *(() if trials is None else (trials,)), size),
                        dtype=first.dtype, device=first.device)
    for k, loss in enumerate(losses.values()):
        loss.backward()
        _take_grads(shared, touched, flats[k], trials)
    total = pcgrad(flats, orders)
    if extra is not None:
        extra.backward()
        total += _take_grads(shared, touched, torch.empty_like(total), trials)
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
