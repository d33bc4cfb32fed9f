"""The ``ray.tune.Callback`` that mirrors every trial into its MLflow child run.

Tune calls it in the driver process on each trial start / result / completion / error;
it logs through :class:`~mtbert.tune.tracking.SearchTracker` (run ids and the last
logged step persist in the experiment folder, so a restored search adds no runs).
"""

from __future__ import annotations

from typing import Any

from ray.tune import Callback

from mtbert.tune.tracking import LOGGED_RUN_KEYS, SearchTracker, error_reason, rung_reached


def effective_config(base: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """Every TrainConfig field of a trial (defaults included); raw values if invalid."""
    from mtbert.config import TrainConfig
    from mtbert.errors import ConfigError
    values = {**base, **config, "eval_dev": False}
    try:
        return TrainConfig.from_dict(values, source="trial config").to_dict()
    except ConfigError:
        return values


class MlflowTrialCallback(Callback):
    """Child run per trial: params at start, metrics per evaluation, tags at the end."""

    def __init__(self, tracker: SearchTracker, base: dict[str, Any], max_examples: int,
                 rungs: list[int]):
        self.tracker = tracker
        self.base = dict(base)
        self.max_examples = int(max_examples)
        self.rungs = list(rungs)
        self._nodes: dict[str, list[str]] = {}  # trial id -> Ray node ids it reported from

    def _run_for(self, trial) -> str:
        return self.tracker.child_run(trial.trial_id, str(trial),
                                      effective_config(self.base, trial.config))

    def on_trial_start(self, iteration, trials, trial, **info):
        self._run_for(trial)
        self.tracker.mark_running(trial.trial_id)

    def on_trial_restore(self, iteration, trials, trial, **info):
        self._run_for(trial)
        self.tracker.mark_running(trial.trial_id)

    def on_trial_result(self, iteration, trials, trial, result, **info):
        self._run_for(trial)
        metrics = {k: v for k, v in result.items()  # not time/entered_at: a clock reading
                   if isinstance(k, str) and (k.startswith(("val/", "train/", "time/"))
                                              or k in LOGGED_RUN_KEYS) and not k.endswith("_at")}
        step = int(result.get("examples_seen", result.get("training_iteration", 0)))
        self.tracker.log_trial_result(trial.trial_id, metrics, step)
        node = result.get("node_id")
        if node and self._nodes.get(trial.trial_id, [None])[-1] != node:
            # tag node_id = where it runs now; node_ids = every node it ran on (node loss)
            nodes = self._nodes.setdefault(trial.trial_id, [])
            nodes.append(node)
            self.tracker.set_tags(self._run_for(trial), {"node_id": node,
                                                         "node_ids": ",".join(nodes)})

    def on_trial_recover(self, iteration, trials, trial, **info):
        run_id = self._run_for(trial)
        self.tracker.set_tags(run_id, {"retries": trial.num_failures})

    def on_trial_complete(self, iteration, trials, trial, **info):
        self._run_for(trial)
        seen = int((trial.last_result or {}).get("examples_seen", 0))
        early = seen < self.max_examples
        self.tracker.end_trial(trial.trial_id, "FINISHED", {
            "status": "stopped_early" if early else "completed",
            "stopped_early": str(early).lower(),
            "rung_reached": rung_reached(seen, self.rungs),
            "examples_seen": seen,
        })

    def on_trial_error(self, iteration, trials, trial, **info):
        self._run_for(trial)
        seen = int((trial.last_result or {}).get("examples_seen", 0))
        self.tracker.end_trial(trial.trial_id, "FAILED", {
            "status": "error", "stopped_early": "false",
            "rung_reached": rung_reached(seen, self.rungs), "examples_seen": seen,
            "error_reason": error_reason(trial),
        })
