"""``--scheduler asha-promote`` (the default): ASHA as Li et al. (2020) state it -- trials
pause at the rungs and a freed place promotes the best of a rung's top 1/rf (its Ray class:
:class:`~mtbert.tune.search.schedulers.ray_classes.PromotingASHA`)."""

from __future__ import annotations

from mtbert.tune.search.choice import register
from mtbert.tune.search.schedulers.base import SchedulerChoice


@register
class PromotingAsha(SchedulerChoice):
    name = "asha-promote"
    help = "ASHA as Li et al. state it, trials pause at the rungs and the best are promoted"
    works_with = ("optuna", "optuna-mv")
    why_only = "its searcher must free a paused trial's place"
    # its first rung on the classifiers' probabilities and its later rungs on overall_soft:
    # at the bench's first rung (224 examples) STS r ranks the configurations no better
    # than chance, at the second (672) it carries signal; bench/search_efficiency.py ranks
    # this pair first (docs/bench/search_efficiency.md)
    default_rung_metric = "classes_soft,overall_soft"
    per_rung_metrics = True
    # a trial pauses where a new or promoted one takes its place (docs/search.md, "Ray
    # workers")
    reuses_actors = True
    frees_paused_places = True

    def build(self, budget, space, metrics, workers, num_samples, last_leg_cpus):
        from mtbert.tune.search.schedulers.ray_classes import PromotingASHA  # deferred: ray
        return PromotingASHA(budget, metrics, workers, num_samples or budget.num_samples,
                             last_leg_cpus)
