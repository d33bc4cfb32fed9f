"""``--scheduler pbt``: population-based training (Jaderberg et al. 2017) of lr, dropout
and the SMART lambdas, perturbed at every evaluation inside the space's ranges."""

from __future__ import annotations

from typing import Any

from mtbert.tune.search.choice import register
from mtbert.tune.search.schedulers.population import Population


@register
class Pbt(Population):
    name = "pbt"
    help = ("population-based training of lr, dropout and the SMART lambdas, perturbed at "
            "every evaluation")

    def _mutations(self, space) -> dict[str, Any]:
        """PBT: the list of choices (it moves to a neighbour) or the Ray domain (x 0.8 /
        1.2, clipped back into the range by :class:`ClipToSpace`)."""
        return {key: sorted(p.choices) if p.dist == "choice" else p.to_tune()
                for key, p in self._sampled(space)}

    def build(self, budget, space, metrics, workers, num_samples, last_leg_cpus):
        from mtbert.tune.search.schedulers.ray_classes import PBTOnEvalIntervals  # deferred: ray
        found = self.mutations(space)
        bounds = {k: (p.low, p.high) for k, p in space.searched.items()
                  if k in found and p.dist != "choice"}
        return PBTOnEvalIntervals(hyperparam_mutations=found, resample_probability=0.25,
                                  custom_explore_fn=ClipToSpace(bounds),
                                  **self._common(budget, metrics[0]))


class ClipToSpace:
    """PBT's ``custom_explore_fn``: a perturbed range value is put back into the space's
    [low, high] (x 1.2 of a dropout near the top would leave it; repeated, leave the valid
    range).  A class, not a closure, so Ray can pickle the scheduler with the experiment."""

    def __init__(self, bounds: dict[str, tuple[float, float]]):
        self.bounds = bounds

    def __call__(self, config: dict) -> dict:
        for key, (low, high) in self.bounds.items():
            if key in config:
                config[key] = min(max(config[key], low), high)
        return config
