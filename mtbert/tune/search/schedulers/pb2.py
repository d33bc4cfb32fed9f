"""``--scheduler pb2``: PBT's GP-bandit variant (Parker-Holder et al. 2020) on the same keys."""

from __future__ import annotations

from typing import Any

from mtbert.tune.search.choice import Extra, register
from mtbert.tune.search.schedulers.population import Population


@register
class Pb2(Population):
    name = "pb2"
    help = "PBT's GP-bandit variant on the same keys"
    extra = Extra("pb2", ("sklearn",))

    def _mutations(self, space) -> dict[str, Any]:
        """PB2: ``[low, high]`` of the ranges (its GP bandit is continuous; choices stay
        as sampled)."""
        return {key: [p.low, p.high] for key, p in self._sampled(space) if p.dist != "choice"}

    def build(self, budget, space, metrics, workers, num_samples, last_leg_cpus):
        from mtbert.tune.search.schedulers.ray_classes import PB2OnEvalIntervals  # deferred: ray
        return PB2OnEvalIntervals(hyperparam_bounds=self.mutations(space),
                                  **self._common(budget, metrics[0]))
