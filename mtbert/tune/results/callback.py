"""The ``ray.tune.Callback`` that mirrors every trial into its MLflow child run.

Tune calls it in the driver process on each trial start / result / completion / error;
it logs through :class:`~mtbert.tune.infra.tracking.SearchTracker` (run ids and the last
logged step persist in the experiment folder, so a restored search adds no runs).  The
tracker queues each write in the search's outbox, sent by a thread of its own: Tune's
loop never waits for MLflow, and a server that is away fails no trial nor the search.
"""

from __future__ import annotations

from typing import Any

from ray.tune import Callback

from mtbert.tune.trial.objective import RUN_KEYS
from mtbert.tune.results.records import TrialStatus, error_reason, rung_reached, trial_status
from mtbert.tune.trial.trial_config import trial_config_values
from mtbert.tune.infra.tracking import SearchTracker


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
                                      trial_config_values(self.base, trial.config))

    def on_trial_start(self, iteration, trials, trial, **info):
        self._run_for(trial)
        self.tracker.mark_running(trial.trial_id)

    def on_trial_restore(self, iteration, trials, trial, **info):
        self._run_for(trial)
        self.tracker.mark_running(trial.trial_id)

    def on_trial_result(self, iteration, trials, trial, result, **info):
        self._run_for(trial)
        metrics = {k: v for k, v in result.items()  # not time/entered_at: a clock reading
                   if isinstance(k, str) and (k.startswith(("val/", "train/", "time/", "best/",
                                                                 "config/"))
                                              or k in RUN_KEYS) and not k.endswith("_at")}
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
        self._run_for(trial)
        self.tracker.note_retry(trial.trial_id, trial.num_failures)

    def on_trial_complete(self, iteration, trials, trial, **info):
        self._run_for(trial)
        seen = int((trial.last_result or {}).get("examples_seen", 0))
        status = trial_status(seen, self.max_examples)
        self.tracker.end_trial(trial.trial_id, status.run_status, {
            "status": status,
            "stopped_early": str(status == TrialStatus.STOPPED_EARLY).lower(),
            "rung_reached": rung_reached(seen, self.rungs),
            "examples_seen": seen,
        })

    def on_trial_error(self, iteration, trials, trial, **info):
        self._run_for(trial)
        seen = int((trial.last_result or {}).get("examples_seen", 0))
        status = TrialStatus.ERROR
        self.tracker.end_trial(trial.trial_id, status.run_status, {
            "status": status, "stopped_early": "false",
            "rung_reached": rung_reached(seen, self.rungs), "examples_seen": seen,
            "error_reason": error_reason(trial),
        })


def close_unended_runs(tracker: SearchTracker, records) -> None:
    """After the fit: the runs of trials Tune did not end.  A trial interrupted by Ctrl-C
    is closed KILLED (``--resume`` reopens it); a run whose trial is unknown to the
    restored search (it started just before a driver crash, after Ray's last experiment
    snapshot: the restored search samples another trial instead) is closed as orphaned."""
    children = tracker.state.get("children", {})
    for r in records:
        r.mlflow_run_id = children.get(r.trial_id, {}).get("run_id")
        if r.status == TrialStatus.INTERRUPTED and r.trial_id in children:
            tracker.end_trial(r.trial_id, r.status.run_status, {
                "status": r.status, "stopped_early": "false", "examples_seen": r.examples_seen})
    known = {r.trial_id for r in records}
    for tid in sorted(set(children) - known):
        if children[tid].get("status") in (None, "RUNNING"):
            tracker.end_trial(tid, TrialStatus.ORPHANED.run_status, {
                "status": TrialStatus.ORPHANED, "error_reason": "started just before the "
                "driver crashed, after Ray's last experiment snapshot: not resumed"})
