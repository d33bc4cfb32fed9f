"""``--scheduler fifo``: every trial trains its whole budget (a baseline)."""

from __future__ import annotations

from mtbert.tune.search.choice import register
from mtbert.tune.search.schedulers.base import SchedulerChoice


@register
class Fifo(SchedulerChoice):
    name = "fifo"
    help = "every trial trains its whole budget (a baseline without early stopping)"

    def build(self, budget, space, metrics, workers, num_samples, last_leg_cpus):
        from ray.tune.schedulers import FIFOScheduler
        return FIFOScheduler()
