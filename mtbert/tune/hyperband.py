"""``--scheduler bohb``: Ray's ``HyperBandForBOHB`` on the budget's rungs.

Ray derives Hyperband's brackets from ``max_t`` alone (s_max = round(log_eta max_t),
bracket s starting at max_t * eta^-s): counted in examples that makes a dozen brackets
whose first milestone is a few examples.  Here time is counted in grace periods
(``rungs_seen`` = examples seen / grace period, added to each result before Hyperband
reads it) and ``max_t`` is the budget's last rung in those units (eta^s): the smallest
bracket starts at the grace period and every milestone is one of the budget's rungs
(grace * eta^k).  Trials that survive the last rung train on to the budget's end
(``stop_last_trials=False``), like ASHA's.
"""

from __future__ import annotations

from ray.tune.schedulers import HyperBandForBOHB

from mtbert.tune.budgets import Budget

#: the time attribute Hyperband reads (examples seen / grace period)
RUNGS_SEEN = "rungs_seen"


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
