"""``--scheduler bohb``: Hyperband for BOHB on the budget's rungs, with ``--search-alg bohb``."""

from __future__ import annotations

from mtbert.tune.search.choice import BOHB_EXTRA, register
from mtbert.tune.search.schedulers.base import SchedulerChoice


@register
class HyperbandForBohb(SchedulerChoice):
    name = "bohb"
    help = "Hyperband for BOHB on the same rungs"
    extra = BOHB_EXTRA
    works_with = ("bohb",)
    why_only = "HyperBandForBOHB and TuneBOHB only work as a pair"
    default_searcher = "bohb"
    reuses_actors = False  # pauses trials in turns (tuner.reuses_actors)

    def build(self, budget, space, metrics, workers, num_samples, last_leg_cpus):
        from mtbert.tune.search.schedulers.ray_classes import HyperBandOnRungs  # deferred: ray
        return HyperBandOnRungs(budget, metrics[0])
