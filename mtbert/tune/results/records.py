"""Trial records: what a search keeps of each trial once Ray is done with it.

The trial statuses and the one rule that decides "stopped early" live here (the
objective: objective.py); :func:`collect_trials` turns Ray's ``ResultGrid`` into plain
:class:`TrialRecord` objects (no Ray objects), and :func:`ranked` orders them by their
best validation score -- the only thing a search selects on.  Ray's results undercount
what a trial trained: Tune drops a stopped trial's result in flight (the evaluation is
taken from its checkpoint), and a trial trains on past the report it is stopped or
paused at; each of its runs writes how far it trained (trained_log.py), and
``examples_trained`` counts every example.
"""

from __future__ import annotations

import enum
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from mtbert.run.metrics import scalar_metrics
from mtbert.tune.trial.objective import OBJECTIVE
from mtbert.tune.trial.trained_log import TRAINED_FOLDER



class TrialStatus(enum.StrEnum):
    """How a trial ended."""
    COMPLETED = "completed"            # trained its whole budget
    STOPPED_EARLY = "stopped_early"    # stopped by the scheduler (ASHA) at a rung
    ERROR = "error"                    # failed (bad config combination, NaN loss, crash)
    INTERRUPTED = "interrupted"        # still training when the search was stopped (Ctrl-C)
    ORPHANED = "orphaned"              # started after Ray's last snapshot before a crash

    @property
    def run_status(self) -> str:
        """The MLflow run status of a trial that ended so."""
        return {"completed": "FINISHED", "stopped_early": "FINISHED",
                "error": "FAILED"}.get(self.value, "KILLED")


def trial_status(examples_seen: int, max_examples: int, errored: bool = False,
                 ended: bool = True) -> TrialStatus:
    """The one rule: short of the budget is a scheduler stop if Tune ended the trial, an
    interruption if it did not; a full budget is completed; an error is an error."""
    if errored:
        return TrialStatus.ERROR
    if examples_seen >= max_examples:
        return TrialStatus.COMPLETED
    return TrialStatus.STOPPED_EARLY if ended else TrialStatus.INTERRUPTED


def rung_reached(examples_seen: int, rungs: list[int]) -> int:
    """How many ASHA rungs (milestones in examples) the trial got past: 0 = none."""
    return sum(1 for r in rungs if examples_seen >= r)


def summarize_error(text: str) -> str:
    """The line of an error text that says what went wrong (a ``TrialFailed:`` reason,
    else the last ``...Error: ...`` line), at most 500 characters."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if "TrialFailed:" in ln:
            return ln[ln.index("TrialFailed:"):][:500]
    for ln in reversed(lines):
        if "Error" in ln.split(":", 1)[0] or "Exception" in ln.split(":", 1)[0]:
            return ln[:500]
    return lines[-1][:500] if lines else ""


def error_reason(trial) -> str:
    """The reason a Ray trial failed, from its error file."""
    text = ""
    try:
        if trial.error_file and Path(trial.error_file).is_file():
            text = Path(trial.error_file).read_text(encoding="utf-8", errors="replace")
    except (OSError, TypeError):
        text = ""
    return summarize_error(text) or "unknown error (see the trial's error.txt)"


@dataclass
class TrialRecord:
    """What the report and the summary need of one trial (plain data)."""
    trial_id: str
    name: str
    status: TrialStatus
    config: dict[str, Any]           # the sampled values
    history: list[dict[str, float]] = field(default_factory=list)  # one per evaluation
    best: dict[str, float] = field(default_factory=dict)           # metrics at the best eval
    best_checkpoint: str | None = None
    examples_seen: int = 0
    rung_reached: int = 0
    error: str = ""
    mlflow_run_id: str | None = None
    origin: str = ""                 # the search it trained in, if an earlier one (--extend)
    retries: int = 0                 # times its worker failed and Ray restored it (--max-failures)
    # every example it trained, over all its runs (TrainedLog): those trained past its
    # last evaluation before a stop or a pause, and again after a restore from an earlier
    # checkpoint, count too (``examples_seen`` is how far it got: its last evaluation);
    # 0: not recorded (a trials.json written before it was)
    examples_trained: int = 0
    # the evaluations (examples seen) missing from Ray's result log and taken from the
    # trial's checkpoints; and the results missing from Ray's log that none of them holds
    rows_filled: list[int] = field(default_factory=list)
    rows_missing: int = 0

    @property
    def evaluated_at(self) -> list[int]:
        """The examples seen at each of its evaluations, in order."""
        return [int(h["examples_seen"]) for h in self.history if "examples_seen" in h]

    @property
    def best_score(self) -> float:
        value = self.best.get(OBJECTIVE)
        return float(value) if value is not None and math.isfinite(value) else float("-inf")


def trial_record(trial_id: str, name: str, config: dict[str, Any],
                 history: list[dict[str, Any]], checkpoints: Iterable[tuple[str, dict]],
                 last_examples_seen: int, error: str | None, max_examples: int,
                 rungs: list[int], ended: bool = True, retries: int = 0,
                 runs: Iterable[tuple[int, int]] = (),
                 kept_history: Iterable[dict[str, Any]] = ()) -> TrialRecord:
    """One trial from what its run left: the evaluation history (Ray's result rows), its
    checkpoints with their metrics, the history its newest checkpoint kept
    (``history.json``: every evaluation of the trial up to it), the last reported examples
    seen, its error text and its runs (``(from, to)`` examples of each: :class:`TrainedLog`).

    Ray's rows are cross-checked against what the trial kept itself: an evaluation missing
    from them is taken from its checkpoints (``rows_filled``).  Ray drops a result still in
    flight when it stops a trial (the promoting scheduler stops the trials running to a
    rung on another trial's result), and a logger that restores a trial's log from an
    older storage copy loses rows (result_logs.py); a gap in Ray's result numbers that
    the checkpoints do not fill is counted (``rows_missing``), never silent.
    ``examples_seen`` -- how far the trial got, to its last evaluation -- counts the
    filled rows; ``examples_trained`` adds what its runs trained past their last
    evaluation and again from an earlier checkpoint."""
    checkpoints = list(checkpoints)
    ray_rows = _one_row_per_point([scalar_metrics(h, finite=True) for h in history])
    at_ray = {h["examples_seen"] for h in ray_rows if "examples_seen" in h}
    kept: dict[float, dict[str, float]] = {}
    for m in [*kept_history, *(m for _, m in checkpoints)]:
        if isinstance(m.get("examples_seen"), (int, float)) and m["examples_seen"] not in at_ray:
            kept.setdefault(m["examples_seen"], _history_row(m))
    rows = sorted(ray_rows + list(kept.values()), key=lambda h: h.get("examples_seen", -1))
    last_ray = max(at_ray, default=-1)
    iterations = {int(h["training_iteration"]) for h in ray_rows if "training_iteration" in h}
    lost = len(set(range(1, max(iterations, default=0) + 1)) - iterations)
    best, best_path = {}, None
    for path, metrics in checkpoints:
        score = metrics.get(OBJECTIVE)
        # the evaluation at 0 examples shows where a trial started; it is no trained model
        # to rank or ensemble (a trial that only lost has no best checkpoint)
        if score is None or not math.isfinite(score) or not metrics.get("examples_seen"):
            continue
        if not best or score > best[OBJECTIVE]:
            best, best_path = scalar_metrics(metrics, finite=True), path
    # after a driver crash Ray's restored last result can lag its own result log
    seen = max([int(last_examples_seen)]
               + [int(h["examples_seen"]) for h in rows if "examples_seen" in h])
    trained = max(seen, sum(max(0, int(b) - int(a)) for a, b in runs))
    return TrialRecord(
        trial_id=trial_id, name=name, config=dict(config), history=rows, best=best,
        best_checkpoint=best_path, examples_seen=seen, rung_reached=rung_reached(seen, rungs),
        status=trial_status(seen, max_examples, errored=error is not None, ended=ended),
        error=summarize_error(error) if error is not None else "", retries=retries,
        examples_trained=trained, rows_filled=sorted(int(p) for p in kept),
        rows_missing=max(0, lost - sum(1 for p in kept if p < last_ray)))


def _history_row(metrics: dict[str, Any]) -> dict[str, float]:
    """An evaluation as the history keeps it (the keys :func:`collect_trials` keeps)."""
    return scalar_metrics({k: v for k, v in metrics.items() if _kept_in_history(k)},
                          finite=True)


def _kept_in_history(key: str) -> bool:
    # time/entered_at and time/startup_s: when each of the trial's runs began and got its
    # Trainer ready (a paused and resumed trial has one run per resume; its best result
    # names only the run that reported it)
    return key.startswith(("val/", "train/")) or key in (
        "examples_seen", "timestamp", "training_iteration", "time/entered_at",
        "time/startup_s")


def _one_row_per_point(history: list[dict[str, float]]) -> list[dict[str, float]]:
    """One evaluation per ``examples_seen`` (the last one): a trial resumed after a driver
    crash from an older checkpoint than its last report redoes those evaluations, and
    Ray's result log keeps both copies."""
    by_seen: dict[float, dict[str, float]] = {}
    for h in history:
        key = h.get("examples_seen", float(len(by_seen)))
        by_seen.pop(key, None)
        by_seen[key] = h
    return list(by_seen.values())


def collect_trials(result_grid, max_examples: int, rungs: list[int],
                   ended: set[str] | None = None,
                   ended_before: dict[str, dict[str, str]] | None = None,
                   retries: dict[str, int] | None = None) -> list[TrialRecord]:
    """One :class:`TrialRecord` per trial of a Ray ``ResultGrid`` (or list of ``Result``).

    ``ended``: the trials Tune reported as ended (the driver's tracker records each end);
    a trial short of ``max_examples`` that did not end was interrupted (Ctrl-C), not
    stopped by the scheduler. None: every trial short of the budget counts as stopped.
    ``ended_before``: trials that had ended (not failed) before a ``--resume``, with the
    tags of their end.  Ray may replay such a trial from a snapshot older than its end and
    fail to restore a checkpoint deleted since ("does not exist on storage anymore"): that
    error is the replay's, not the trial's, which keeps the end it had.  ``retries``: how
    often each trial's worker failed and Ray restored it (the driver's tracker counts)."""
    records = []
    for result in result_grid:
        tid = _trial_id_of(result)
        error = None if result.error is None else str(result.error)
        last_seen = int((result.metrics or {}).get("examples_seen", 0))
        before = (ended_before or {}).get(tid)
        if before is not None and before.get("status") != TrialStatus.ERROR:
            error = None
            last_seen = max(last_seen, int(before.get("examples_seen", 0)))
        history: list[dict[str, Any]] = []
        df = result.metrics_dataframe
        if df is not None and len(df) and OBJECTIVE in df.columns:
            history = df[[c for c in df.columns if _kept_in_history(c)]].to_dict("records")
        checkpoints = _checkpoints(result)
        records.append(trial_record(
            tid, Path(result.path).name, result.config or {}, history, checkpoints,
            last_seen, error, max_examples, rungs, ended=ended is None or tid in ended,
            retries=(retries or {}).get(tid, 0), runs=_trained_runs(result),
            kept_history=_newest_history(result, checkpoints)))
    return records


def _trial_id_of(result) -> str:
    """The trial's id from its folder (``trial_<id>``: tuner.trial_name); its last
    metrics' ``trial_id`` can be another trial's: a trial PBT cloned from another's
    checkpoint that ends without reporting again keeps the clone's last result."""
    name = Path(result.path).name
    if name.startswith("trial_"):
        return name[len("trial_"):]
    return str((result.metrics or {}).get("trial_id") or name)


def _checkpoints(result) -> list[tuple[str, dict]]:
    """(path, metrics) of the trial's checkpoints that exist: those Ray lists, and any
    other ``checkpoint_*`` folder of the trial (its ``metrics.json``).

    After a driver crash Ray's restored list can lag the trial folder: it may miss the
    newer ones."""
    import pyarrow.fs
    fs = getattr(result, "filesystem", None) or pyarrow.fs.LocalFileSystem()
    out: dict[str, dict] = {}
    for checkpoint, metrics in (result.best_checkpoints or []):
        if fs.get_file_info(checkpoint.path).type != pyarrow.fs.FileType.NotFound:
            out[checkpoint.path] = metrics
    try:
        infos = fs.get_file_info(pyarrow.fs.FileSelector(result.path))
    except (OSError, FileNotFoundError):
        infos = []
    for info in infos:
        name = info.path.rstrip("/").rsplit("/", 1)[-1]
        if (info.type != pyarrow.fs.FileType.Directory or not name.startswith("checkpoint_")
                or info.path in out):
            continue
        try:
            with fs.open_input_stream(f"{info.path}/metrics.json") as fh:
                metrics = json.loads(fh.read().decode("utf-8"))
        except (OSError, FileNotFoundError, ValueError):
            continue
        if isinstance(metrics, dict):
            if info.mtime is not None:  # when it was written: Ray's rows have their time
                metrics.setdefault("timestamp", info.mtime.timestamp())
            out[info.path] = metrics
    return sorted(out.items())


def _newest_history(result, checkpoints: list[tuple[str, dict]]) -> list[dict]:
    """The evaluations the trial's newest checkpoint kept (its ``history.json``: every
    evaluation up to that checkpoint's); [] where it has none or it is unreadable."""
    import pyarrow.fs
    dated = [(m["examples_seen"], path) for path, m in checkpoints
             if isinstance(m.get("examples_seen"), (int, float))]
    if not dated:
        return []
    fs = getattr(result, "filesystem", None) or pyarrow.fs.LocalFileSystem()
    try:
        with fs.open_input_stream(f"{max(dated)[1]}/history.json") as fh:
            history = json.loads(fh.read().decode("utf-8"))
    except (OSError, FileNotFoundError, ValueError):
        return []
    return [h for h in history if isinstance(h, dict)] if isinstance(history, list) else []


# ---------------------------------------------------------------------- examples trained
def _trained_runs(result) -> list[tuple[int, int]]:
    """``(from, to)`` of each run of the trial (:class:`TrainedLog`)."""
    import pyarrow.fs
    fs = getattr(result, "filesystem", None) or pyarrow.fs.LocalFileSystem()
    try:
        infos = fs.get_file_info(pyarrow.fs.FileSelector(f"{result.path}/{TRAINED_FOLDER}"))
    except (OSError, FileNotFoundError):
        return []
    runs = []
    for info in sorted(infos, key=lambda i: i.path):
        if info.type != pyarrow.fs.FileType.File or not info.path.endswith(".json"):
            continue
        try:
            with fs.open_input_stream(info.path) as fh:
                doc = json.loads(fh.read().decode("utf-8"))
            runs.append((int(doc["from"]), int(doc["to"])))
        except (OSError, ValueError, TypeError, KeyError):
            continue
    return runs


def ranked(records: list[TrialRecord]) -> list[TrialRecord]:
    """Trials with a usable best checkpoint (or, for an earlier search's trial, a best
    score whose weights may be gone), best validation score first."""
    ok = [r for r in records if (r.best_checkpoint or r.origin) and math.isfinite(r.best_score)]
    return sorted(ok, key=lambda r: (-r.best_score, r.trial_id))
