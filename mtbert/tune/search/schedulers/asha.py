"""``--scheduler asha``: Ray's ASHA (Li et al. 2020) on examples seen, stopping the weak
trials at the budget's rungs as each trial arrives."""

from __future__ import annotations

from mtbert.tune.search.choice import register
from mtbert.tune.search.schedulers.base import SchedulerChoice


@register
class Asha(SchedulerChoice):
    name = "asha"
    help = "stop weak trials at the budget's rungs (Ray's ASHA, deciding as each trial arrives)"

    def build(self, budget, space, metrics, workers, num_samples, last_leg_cpus):
        from mtbert.tune.search.schedulers.ray_classes import ASHAOnExamples  # deferred: ray
        return ASHAOnExamples(budget, metrics[0])
