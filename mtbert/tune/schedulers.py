"""Ray's ASHA, Hyperband-for-BOHB and population-based training, fitted to budgets in
examples, each deciding on its own metric (``--rung-metric``).

Every scheduler here compares trials on the metric it is built with, while the Tuner's
metric -- the search's objective, which the searcher, the checkpoints and Ray's progress
table use -- stays ``val/overall``.  Ray hands the Tuner's metric to every part and refuses
(ValueError) a scheduler built with its own; :class:`_OwnMetric` keeps its own.

``--scheduler bohb``: :class:`HyperBandOnRungs`.  Ray derives Hyperband's brackets from ``max_t`` alone (s_max = round(log_eta max_t),
bracket s starting at max_t * eta^-s): counted in examples that makes a dozen brackets
whose first milestone is a few examples.  Here time is counted in grace periods
(``rungs_seen`` = examples seen / grace period, added to each result before Hyperband
reads it) and ``max_t`` is the budget's last rung in those units (eta^s): the smallest
bracket starts at the grace period and every milestone is one of the budget's rungs
(grace * eta^k).  Trials that survive the last rung train on to the budget's end
(``stop_last_trials=False``), like ASHA's.
"""

from __future__ import annotations

from ray.tune.schedulers import (ASHAScheduler, HyperBandForBOHB, PopulationBasedTraining,
                                 TrialScheduler)
from ray.tune.schedulers.pb2 import PB2

from mtbert.tune.budgets import Budget
from mtbert.tune.records import MODE

#: the time attribute Hyperband reads (examples seen / grace period)
RUNGS_SEEN = "rungs_seen"
#: the time attribute PBT / PB2 read (whole evaluation intervals)
INTERVALS_SEEN = "intervals_seen"


class _OwnMetric:
    """A scheduler that keeps the metric and mode it was built with when the Tuner passes
    the search's own (Ray's set_search_properties refuses both being set)."""

    def set_search_properties(self, metric, mode, **spec) -> bool:
        return super().set_search_properties(None if self._metric else metric,
                                             None if self._mode else mode, **spec)


class ASHAOnExamples(_OwnMetric, ASHAScheduler):
    """``--scheduler asha``: ASHA's rungs at the budget's (grace period x rf^k examples)."""

    def __init__(self, budget: Budget, metric: str):
        super().__init__(time_attr="examples_seen", metric=metric, mode=MODE,
                         max_t=budget.max_examples, grace_period=budget.grace_period,
                         reduction_factor=budget.reduction_factor)


class HyperBandOnRungs(_OwnMetric, HyperBandForBOHB):
    def __init__(self, budget: Budget, metric: str):
        self.grace = budget.grace_period
        last = budget.rungs()[-1] / self.grace
        # a hair above eta^s: Ray's int(max_t * eta**-s) is int(0.999...) = 0 for 27 * 3**-3
        super().__init__(time_attr=RUNGS_SEEN, metric=metric, mode=MODE,
                         max_t=last * (1 + 1e-9), reduction_factor=budget.reduction_factor,
                         stop_last_trials=False)

    def on_trial_result(self, tune_controller, trial, result: dict) -> str:
        result[RUNGS_SEEN] = result.get("examples_seen", 0) / self.grace
        return super().on_trial_result(tune_controller, trial, result)


class _EndsAtTheBudget:
    """PBT / PB2 on whole evaluation intervals, letting a trial at its budget's end finish.

    * Time is ``intervals_seen`` = floor(examples seen / ``eval_every``), added to each
      result, with a perturbation interval of 1.  An evaluation falls on the first step
      past its point (54, 100, 146 examples for every 48), and synchronous PBT then waits
      for a time none of the paused trials is below (146 < 146): the smoke search hung.
    * Ray's PBT also acts on a trial's last report: exploiting there sends a finished
      trial back to another's earlier checkpoint, it reaches the end again and is sent
      back again (a smoke search looped so for 10 minutes).  At the end it continues."""

    def __init__(self, budget: Budget, metric: str, **kwargs):
        self.max_examples, self.interval = budget.max_examples, budget.eval_every
        super().__init__(time_attr=INTERVALS_SEEN, perturbation_interval=1, metric=metric,
                         mode=MODE, **kwargs)

    def on_trial_result(self, tune_controller, trial, result: dict) -> str:
        seen = result.get("examples_seen", 0)
        result[INTERVALS_SEEN] = int(seen // self.interval)
        if seen >= self.max_examples:
            return TrialScheduler.CONTINUE  # the trainable returns after this report
        return super().on_trial_result(tune_controller, trial, result)


class PBTToTheEnd(_OwnMetric, _EndsAtTheBudget, PopulationBasedTraining):
    """``--scheduler pbt``."""


class PB2ToTheEnd(_OwnMetric, _EndsAtTheBudget, PB2):
    """``--scheduler pb2``."""
