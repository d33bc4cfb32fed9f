"""Ray's Hyperband-for-BOHB and population-based training, fitted to budgets in examples.

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

from ray.tune.schedulers import HyperBandForBOHB, PopulationBasedTraining, TrialScheduler
from ray.tune.schedulers.pb2 import PB2

from mtbert.tune.budgets import Budget

#: the time attribute Hyperband reads (examples seen / grace period)
RUNGS_SEEN = "rungs_seen"
#: the time attribute PBT / PB2 read (whole evaluation intervals)
INTERVALS_SEEN = "intervals_seen"


class HyperBandOnRungs(HyperBandForBOHB):
    def __init__(self, budget: Budget):
        self.grace = budget.grace_period
        last = budget.rungs()[-1] / self.grace
        # a hair above eta^s: Ray's int(max_t * eta**-s) is int(0.999...) = 0 for 27 * 3**-3
        super().__init__(time_attr=RUNGS_SEEN, max_t=last * (1 + 1e-9),
                         reduction_factor=budget.reduction_factor, stop_last_trials=False)

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

    def __init__(self, budget: Budget, **kwargs):
        self.max_examples, self.interval = budget.max_examples, budget.eval_every
        super().__init__(time_attr=INTERVALS_SEEN, perturbation_interval=1, **kwargs)

    def on_trial_result(self, tune_controller, trial, result: dict) -> str:
        seen = result.get("examples_seen", 0)
        result[INTERVALS_SEEN] = int(seen // self.interval)
        if seen >= self.max_examples:
            return TrialScheduler.CONTINUE  # the trainable returns after this report
        return super().on_trial_result(tune_controller, trial, result)


class PBTToTheEnd(_EndsAtTheBudget, PopulationBasedTraining):
    """``--scheduler pbt``."""


class PB2ToTheEnd(_EndsAtTheBudget, PB2):
    """``--scheduler pb2``."""
