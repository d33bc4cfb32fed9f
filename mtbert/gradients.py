"""Gradient combiners: take per-task losses and leave ``.grad`` set on the parameters."""

from __future__ import annotations

import torch
from torch import nn


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


def build_gradient_combiner(cfg) -> GradientCombiner:
    return SumGradients()
