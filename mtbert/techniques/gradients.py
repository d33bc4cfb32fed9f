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
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

_TINY = 1e-30


def random_orders(n: int) -> list[list[int]]:
    """For each task i, the other tasks in a random order, from torch's global RNG."""
    orders = []
    for i in range(n):
        perm = torch.randperm(n).tolist()
        orders.append([j for j in perm if j != i])
    return orders


def project_conflicting(grads: Sequence[torch.Tensor],
                        orders: Sequence[Sequence[int]] | None = None) -> list[torch.Tensor]:
    """PCGrad's projection on flat per-task gradients; returns the projected g_i^PC.

    ``orders[i]`` lists the tasks j that g_i is projected against, in that order (default:
    :func:`random_orders`, torch's global RNG). Pure: the inputs are not modified.
    """
    n = len(grads)
    if orders is None:
        orders = random_orders(n) if n > 1 else [[]] * n
    squared = [torch.dot(g, g) for g in grads]
    out = []
    for i in range(n):
        g = grads[i].clone()
        for j in orders[i]:
            if j == i:
                continue
            dot = torch.dot(g, grads[j])
            # coefficient min(g·g_j, 0) / ‖g_j‖²: zero unless the two conflict (003 eq. 4)
            coef = torch.clamp(dot, max=0.0) / torch.clamp(squared[j], min=_TINY)
            g = g - coef * grads[j]
        out.append(g)
    return out


def pcgrad(grads: Sequence[torch.Tensor],
           orders: Sequence[Sequence[int]] | None = None) -> torch.Tensor:
    """Σ_i g_i^PC: the combined shared gradient."""
    projected = project_conflicting(grads, orders)
    total = projected[0]
    for g in projected[1:]:
        total = total + g
    return total


class GradientCombiner:
    def backward(self, losses: dict[str, torch.Tensor], shared: list[nn.Parameter],
                 extra: torch.Tensor | None = None) -> None:
        raise NotImplementedError


class SumGradients(GradientCombiner):
    """Plain backpropagation of Σ_i L_i (+ extra)."""

    def backward(self, losses, shared, extra=None):
        total = sum(losses.values())
        if extra is not None:
            total = total + extra
        total.backward()


def _take_grads(params: list[nn.Parameter], touched: list[bool]) -> torch.Tensor:
    """Concatenate the params' ``.grad`` (zeros where None) and clear them."""
    parts = []
    for k, p in enumerate(params):
        if p.grad is None:
            parts.append(torch.zeros(p.numel(), dtype=p.dtype, device=p.device))
        else:
            touched[k] = True
            parts.append(p.grad.reshape(-1))
            p.grad = None
    return torch.cat(parts)


class PCGradGradients(GradientCombiner):
    """PCGrad on the shared parameters, ordinary gradients elsewhere (see module doc)."""

    def backward(self, losses, shared, extra=None):
        shared = [p for p in shared if p.requires_grad]
        previous = [p.grad for p in shared]  # normally all None (zero_grad(set_to_none))
        for p in shared:
            p.grad = None
        touched = [False] * len(shared)
        flats = []
        for loss in losses.values():
            loss.backward()
            flats.append(_take_grads(shared, touched))
        total = pcgrad(flats)
        if extra is not None:
            extra.backward()
            total = total + _take_grads(shared, touched)
        for p, g, old, used in zip(shared, total.split([p.numel() for p in shared]),
                                   previous, touched):
            if not used:
                p.grad = old  # no loss reached it: leave it as plain backprop would
                continue
            g = g.view_as(p)
            p.grad = g if old is None else old + g


def build_gradient_combiner(cfg) -> GradientCombiner:
    if getattr(cfg, "pcgrad", False):
        return PCGradGradients()
    return SumGradients()
