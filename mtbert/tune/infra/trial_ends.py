"""Which trials of a search ended, and how: what a ``--resume`` keeps.

A view of the search's tracking state (tracking.py's ``mtbert_mlflow.json``): each
trial's end as Tune reported it (its run's status, the tags of its end, its error), how
often Ray restored it after its worker failed, and the trials that had ended before a
``--resume``.  Written the moment Tune ends a trial, so it is more current than Ray's
experiment snapshot, which a killed driver may have left a step behind (a trial stopped
just before the kill still RUNNING there).  Ray may replay such a trial from a stale
snapshot after the resume: its end stands (:meth:`TrialEnds.frozen`)."""

from __future__ import annotations

from typing import Any


class TrialEnds:
    """The ends recorded in ``state`` (``children``: trial id -> its entry; the caller
    saves the state after a change)."""

    def __init__(self, state: dict[str, Any]):
        self.state = state

    def record(self, trial_id: str, status: str, tags: dict[str, Any]) -> dict[str, Any] | None:
        """The trial ended with the run ``status`` and the end's ``tags``; its entry, or
        None where the trial has none or its end before a ``--resume`` stands."""
        child = self.state.get("children", {}).get(trial_id)
        if not child or self.frozen(trial_id):
            return None
        child["status"] = status
        child["end_tags"] = {k: str(v) for k, v in tags.items()}
        if tags.get("error_reason"):
            child["error_reason"] = str(tags["error_reason"])
        return child

    def ended(self) -> dict[str, dict[str, str]]:
        """``{trial_id: {status, error_reason}}`` of the trials whose end was recorded."""
        return {tid: {"status": c["status"], "error_reason": c.get("error_reason", "")}
                for tid, c in self.state.get("children", {}).items()
                if c.get("status") in ("FINISHED", "FAILED")}

    def freeze(self) -> dict[str, dict[str, str]]:
        """On resume: the trials that had ended keep their ends (see :meth:`ended`)."""
        ended = self.ended()
        self.state["ended_before_resume"] = sorted(
            set(self.state.get("ended_before_resume", [])) | set(ended))
        return ended

    def before_resume(self) -> dict[str, dict[str, str]]:
        """``{trial_id: the tags of its end}`` of the trials that had ended before a
        ``--resume`` (those whose end was recorded)."""
        children = self.state.get("children", {})
        return {tid: dict(children[tid]["end_tags"])
                for tid in self.state.get("ended_before_resume", ())
                if "end_tags" in children.get(tid, {})}

    def frozen(self, trial_id: str) -> bool:
        """Its end before a ``--resume`` stands: its run is not touched again."""
        return trial_id in self.state.get("ended_before_resume", ())

    def note_retry(self, trial_id: str, failures: int) -> dict[str, Any]:
        """Ray restored the trial after its worker failed, for the ``failures``-th time."""
        child = self.state["children"][trial_id]
        child["retries"] = int(failures)
        return child

    def retries(self) -> dict[str, int]:
        """``{trial_id: times restored after its worker failed}`` of the trials that were."""
        return {tid: c["retries"] for tid, c in self.state.get("children", {}).items()
                if c.get("retries")}
