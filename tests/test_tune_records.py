"""Trial collection, ranking, the typed summary and its renderings -- from recorded trial
results (real Ray ``Result`` objects over real checkpoint folders), without running Ray."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest

from mtbert.tune.search.budgets import get_budget
from mtbert.tune.results.finalists import build_ensemble
from mtbert.tune.infra.location import ExperimentLocation
from mtbert.tune.trial.objective import OBJECTIVE
from mtbert.tune.results.records import (TrialRecord, TrialStatus, collect_trials, ranked,
                                         rung_reached, summarize_error, trial_record,
                                         trial_status)
from mtbert.tune.settings import SearchSettings
from mtbert.tune.search.spaces import load_space
from mtbert.tune.results.summary import MlflowRefs, build_summary, first_ready_s, phases_line

MAX = 192
RUNGS = [48, 144]


def test_trial_status_is_decided_once():
    assert trial_status(192, MAX) == TrialStatus.COMPLETED
    assert trial_status(96, MAX) == TrialStatus.STOPPED_EARLY
    assert trial_status(96, MAX, ended=False) == TrialStatus.INTERRUPTED
    assert trial_status(192, MAX, errored=True) == TrialStatus.ERROR
    assert [s.run_status for s in TrialStatus] == ["FINISHED", "FINISHED", "FAILED", "KILLED",
                                                   "KILLED"]
    assert rung_reached(47, RUNGS) == 0 and rung_reached(144, RUNGS) == 2


def test_summarize_error_prefers_the_trial_failed_reason():
    text = "Traceback (most recent call last):\n  File x\nValueError: inner\n" \
           "mtbert.tune.trial.trainable.TrialFailed: non-finite loss: sst loss became nan\n"
    assert summarize_error(text) == "TrialFailed: non-finite loss: sst loss became nan"
    assert summarize_error("RuntimeError: boom\n  more") == "RuntimeError: boom"
    assert summarize_error("") == ""


def test_trial_record_keeps_one_row_per_point_and_the_best_checkpoint():
    history = [{"examples_seen": 0, OBJECTIVE: 0.60},
               {"examples_seen": 48, OBJECTIVE: 0.40, "val/sst_acc": 0.3, "note": "x"},
               {"examples_seen": 96, OBJECTIVE: 0.45},
               {"examples_seen": 96, OBJECTIVE: 0.47},       # replayed after a resume
               {"examples_seen": 144, OBJECTIVE: float("nan")}]
    checkpoints = [("ckpt_0", {OBJECTIVE: 0.60, "examples_seen": 0}),   # untrained start
                   ("ckpt_a", {OBJECTIVE: 0.40, "examples_seen": 48}),
                   ("ckpt_b", {OBJECTIVE: 0.47, "examples_seen": 96}),
                   ("ckpt_c", {OBJECTIVE: float("nan"), "examples_seen": 144})]
    r = trial_record("t1", "trial_t1", {"lr": 1e-4}, history, checkpoints, 120, None, MAX, RUNGS)
    assert [h["examples_seen"] for h in r.history] == [0, 48, 96, 144]
    assert r.history[2][OBJECTIVE] == 0.47 and "note" not in r.history[1]
    assert OBJECTIVE not in r.history[3]                 # NaN is not a score
    assert r.rows_filled == [] and r.rows_missing == 0
    assert r.best_checkpoint == "ckpt_b" and r.best_score == 0.47
    assert r.examples_seen == 144                        # the log is ahead of Ray's last result
    assert r.status == TrialStatus.STOPPED_EARLY and r.rung_reached == 2
    failed = trial_record("t2", "trial_t2", {}, [], [], 10, "x\nTrialFailed: bad", MAX, RUNGS)
    assert failed.status == TrialStatus.ERROR and failed.error == "TrialFailed: bad"
    assert failed.best_checkpoint is None and failed.best_score == float("-inf")


def test_trial_record_fills_rows_missing_from_rays_log_from_its_checkpoints():
    """A trial whose Ray log lost its rows at 48 and 96 (results 2 and 3: a logger restored
    an older storage copy when it resumed) has them back from its newest checkpoint's
    history, in order; a lost result no checkpoint holds is counted."""
    ray_rows = [{"examples_seen": 0, OBJECTIVE: 0.3, "training_iteration": 1},
                {"examples_seen": 144, OBJECTIVE: 0.6, "training_iteration": 4},
                {"examples_seen": 192, OBJECTIVE: 0.7, "training_iteration": 5}]
    kept = [{"examples_seen": 0, OBJECTIVE: 0.3}, {"examples_seen": 48, OBJECTIVE: 0.4},
            {"examples_seen": 96, OBJECTIVE: 0.5, "val/sst_acc": 0.25},
            {"examples_seen": 144, OBJECTIVE: 0.6}]
    checkpoints = [("c3", {"examples_seen": 144, OBJECTIVE: 0.6}),
                   ("c4", {"examples_seen": 192, OBJECTIVE: 0.7})]
    r = trial_record("t1", "trial_t1", {}, ray_rows, checkpoints, 192, None, MAX, RUNGS,
                     kept_history=kept)
    assert r.evaluated_at == [0, 48, 96, 144, 192]
    assert r.history[2] == {"examples_seen": 96, OBJECTIVE: 0.5, "val/sst_acc": 0.25}
    assert r.rows_filled == [48, 96] and r.rows_missing == 0
    only_one = trial_record("t1", "trial_t1", {}, ray_rows, checkpoints, 192, None, MAX, RUNGS,
                            kept_history=kept[:2])
    assert only_one.evaluated_at == [0, 48, 144, 192]
    assert only_one.rows_filled == [48] and only_one.rows_missing == 1


def _ray_result(tmp_path: Path, tid: str, scores: list[float], error=None, config=None,
                timings=None):
    """A Ray ``Result`` as Tune leaves it: a trial folder with checkpoint folders (each with
    its metrics.json), the result log as a DataFrame, the best checkpoints Ray lists.
    ``timings``: each report's ``time/*`` values (the run it came from)."""
    from ray.tune import Checkpoint, Result
    trial_dir = tmp_path / f"trial_{tid}"
    rows, best = [], []
    for i, score in enumerate(scores):
        seen = 48 * (i + 1)
        metrics = {"trial_id": tid, "examples_seen": seen, OBJECTIVE: score,
                   "val/sst_acc": score / 2, "training_iteration": i + 1,
                   **(timings[i] if timings else {})}
        rows.append(metrics)
        ckpt = trial_dir / f"checkpoint_{i:06d}"
        ckpt.mkdir(parents=True)
        (ckpt / "metrics.json").write_text(json.dumps(metrics))
        if i == len(scores) - 1:  # Ray's list may lag the folder: it names only the last
            best.append((Checkpoint(str(ckpt)), metrics))
    last = {**(rows[-1] if rows else {"trial_id": tid}), "config": config or {}}
    return Result(metrics=last, checkpoint=None,
                  error=error, path=str(trial_dir),
                  metrics_dataframe=pd.DataFrame(rows) if rows else None,
                  best_checkpoints=best)


def test_collect_trials_from_ray_results(tmp_path):
    results = [_ray_result(tmp_path, "a", [0.40, 0.52, 0.50, 0.51]),       # completed
               _ray_result(tmp_path, "b", [0.45]),                         # ASHA stop at 48
               _ray_result(tmp_path, "c", [0.41, 0.44]),                   # Ctrl-C at 96
               _ray_result(tmp_path, "d", [], error=RuntimeError("TrialFailed: nan loss"))]
    records = collect_trials(results, MAX, RUNGS, ended={"a", "b", "d"})
    by_id = {r.trial_id: r for r in records}
    assert {k: r.status for k, r in by_id.items()} == {
        "a": TrialStatus.COMPLETED, "b": TrialStatus.STOPPED_EARLY,
        "c": TrialStatus.INTERRUPTED, "d": TrialStatus.ERROR}
    # the best checkpoint is found in the trial folder although Ray listed only the last
    assert by_id["a"].best_score == 0.52
    assert by_id["a"].best_checkpoint.endswith("checkpoint_000001")
    assert by_id["a"].examples_seen == 192 and by_id["a"].rung_reached == 2
    assert by_id["d"].error == "TrialFailed: nan loss"
    assert [r.trial_id for r in ranked(records)] == ["a", "b", "c"]
    # without the tracker's record of ended trials, every short trial counts as stopped
    assert collect_trials(results[2:3], MAX, RUNGS)[0].status == TrialStatus.STOPPED_EARLY


def test_a_trial_ended_before_a_resume_keeps_its_end_over_rays_replay(tmp_path):
    """After a driver crash Ray may replay a trial that had completed from a snapshot
    older than its end and fail to restore a checkpoint deleted since: the record keeps
    the end the tracker wrote (seen in CI: a completed trial reported as error).  A trial
    that had failed keeps failing, and one the tracker never saw end keeps Ray's error."""
    replay = RuntimeError("ValueError: Could not recover from checkpoint as it does not "
                          "exist on storage anymore")
    results = [_ray_result(tmp_path, "a", [0.40, 0.52, 0.50], error=replay),  # 144 of 192
               _ray_result(tmp_path, "f", [0.30], error=RuntimeError("TrialFailed: nan")),
               _ray_result(tmp_path, "n", [0.35], error=replay)]
    before = {"a": {"status": "completed", "examples_seen": "192", "stopped_early": "false"},
              "f": {"status": "error", "examples_seen": "48", "error_reason": "nan"}}
    by_id = {r.trial_id: r for r in collect_trials(results, MAX, RUNGS, ended={"a", "f", "n"},
                                                    ended_before=before)}
    a = by_id["a"]
    assert (a.status, a.examples_seen, a.error) == (TrialStatus.COMPLETED, 192, "")
    assert a.best_score == 0.52 and a.best_checkpoint.endswith("checkpoint_000001")
    assert by_id["f"].status == TrialStatus.ERROR and by_id["n"].status == TrialStatus.ERROR


FULL, FULL_RUNGS = 75846, [10000, 30000]  # budget full as the H200 searches resolved it


def _stopped_trial(tmp_path: Path, tid: str, reported: list[int], folder_only: list[int],
                   runs: list[tuple[int, list[int]]]):
    """A trial folder as Tune left it when it stopped the trial with a report in flight:
    Ray's rows and checkpoint list end at ``reported``; the checkpoints of ``folder_only``
    (their evaluations' results dropped) are in the folder, written by the trainer.
    ``runs``: (the examples a run started from, what it wrote as it trained), each written
    by a real TrainedLog, as the trainable writes them."""
    import pyarrow.fs
    from ray.tune import Checkpoint, Result

    from mtbert.tune.trial.trained_log import TrainedLog
    trial_dir = tmp_path / f"trial_{tid}"
    rows, listed = [], []
    for i, seen in enumerate(reported + folder_only):
        metrics = {"examples_seen": seen, OBJECTIVE: 0.5 + seen / 1e6, "val/sst_acc": 0.4}
        ckpt = trial_dir / f"checkpoint_{i:06d}"
        ckpt.mkdir(parents=True)
        (ckpt / "metrics.json").write_text(json.dumps({**metrics, "lr": 3e-5}))
        if seen in reported:
            rows.append({**metrics, "trial_id": tid, "training_iteration": i + 1,
                         "timestamp": 1795766800 + i})
            listed.append((Checkpoint(str(ckpt)), rows[-1]))
    for start, writes in runs:
        run = TrainedLog(pyarrow.fs.LocalFileSystem(), str(trial_dir), start)
        for examples in writes:
            run.write(examples, "reported")
    return Result(metrics={**rows[-1], "config": {}}, checkpoint=None, error=None,
                  path=str(trial_dir), metrics_dataframe=pd.DataFrame(rows),
                  best_checkpoints=listed)


def test_a_trial_stopped_with_its_report_in_flight_counts_every_example(tmp_path):
    """Trial 14ffb5df of the H200 search of 2026-11-27 (docs/gpu_h200/worker_exit_check):
    promoted from the first rung (10,012 examples), it reported at 30,002 as the
    promoting scheduler, deciding on another trial's result, stopped it; Tune drops a
    stopped trial's result in flight (its checkpoint was already in the trial folder),
    and summary.json said 10,012 examples.  Trial 36d4de2f: stopped with its first
    rung's report in flight, summary.json said 0.  Their runs: 14ffb5df trained to 10,204
    before its pause at the first rung took hold, resumed from the rung's checkpoint and
    trained to 30,218 before the stop took hold."""
    results = [_stopped_trial(tmp_path, "14ffb5df", [0, 10012], [30002],
                              [(0, [0, 10012, 10204]), (10012, [30002, 30218])]),
               _stopped_trial(tmp_path, "36d4de2f", [0], [10012], [])]
    a, b = collect_trials(results, FULL, FULL_RUNGS, ended={"14ffb5df", "36d4de2f"})
    assert (a.status, a.examples_seen, a.rung_reached) == (TrialStatus.STOPPED_EARLY, 30002, 2)
    assert [h["examples_seen"] for h in a.history] == [0, 10012, 30002]
    assert a.history[-1][OBJECTIVE] == 0.5 + 30002 / 1e6 and "timestamp" in a.history[-1]
    assert a.best_checkpoint.endswith("checkpoint_000002")
    # every example: 10,204 in its first run, 30,218 - 10,012 = 20,206 in its second
    assert a.examples_trained == 10204 + 20206 == 30410
    assert (b.examples_seen, b.rung_reached, b.best_score) == (10012, 1, 0.5 + 10012 / 1e6)
    assert b.examples_trained == 10012  # no runs recorded: to its last evaluation
    s = build_summary(_settings(tmp_path), [a, b], ranked([a, b]), {}, None,
                      {"files": {}, "importances": {}},
                      MlflowRefs("sqlite:///x.db", "1", "parent"), interrupted=False)
    assert s.examples_trained == 40422
    assert [t.examples_trained for t in s.trials] == [30410, 10012]
    assert "40,422 examples trained by this search's trials" in s.markdown()


class GoldData:
    """``split(task, name).labels`` of hand-made gold labels (all build_ensemble reads)."""
    GOLD = {"sst": [0, 1, 2, 3], "qqp": [1, 0, 1, 0], "sts": [0.0, 1.0, 2.0, 5.0]}

    def split(self, task, name):
        return SimpleNamespace(labels=None if name == "test" else np.asarray(self.GOLD[task]))


def _preds(sst, qqp, sts):
    split = {"sst": np.array(sst), "qqp": np.array(qqp, dtype=float), "sts": np.array(sts)}
    return {"val": split, "dev": split, "test": {"sst": split["sst"], "sts": split["sts"]}}


def _settings(tmp_path: Path, storage_uri: str | None = None) -> SearchSettings:
    budget = get_budget("smoke")
    return SearchSettings(
        space=load_space("smoke"), space_arg="smoke", budget=budget, num_samples=5, top_k=2,
        location=ExperimentLocation(tmp_path / "stage", "exp", storage_uri),
        storage_arg=storage_uri or str(tmp_path), mlflow_uri="sqlite:///x.db",
        mlflow_fallback=None, base={"model": "m", "data_dir": "d", **budget.trial_fields()},
        resume=False, search_alg="optuna", scheduler="asha", rung_metric="overall", seed=0,
        cpus_per_trial=1.0,
        gpus_per_trial=0.0, max_concurrent=None, ensemble="vote", keep_checkpoints="best",
        max_failures=2,
        address=None, mlflow_fallback_local=False)


@pytest.fixture()
def summary_inputs(tmp_path):
    results = [_ray_result(tmp_path, "a", [0.40, 0.52, 0.50, 0.51],
                           config={"lr": 1e-4, "dropout": 0.1}),
               _ray_result(tmp_path, "b", [0.45], config={"lr": 2e-4, "dropout": 0.1}),
               _ray_result(tmp_path, "d", [], error=RuntimeError("TrialFailed: nan loss"),
                           config={"lr": 3e-4, "dropout": 0.1})]
    records = collect_trials(results, MAX, RUNGS, ended={"a", "b", "d"})
    ranking = ranked(records)
    preds = {"a": _preds([0, 1, 2, 3], [0.9, 0.1, 0.8, 0.2], [0, 1, 2, 5]),
             "b": _preds([0, 1, 0, 0], [0.9, 0.1, 0.2, 0.6], [5, 4, 3, 2])}
    ensemble = build_ensemble(["a", "b"], preds, GoldData(), "vote")
    dev_of = {"a": {"dev/overall": 0.61}, "b": {"dev/overall": 0.55}}
    report = {"files": {"learning_curves": str(tmp_path / "stage" / "exp" / "lc.png")},
              "importances": {"fanova": {"lr": 0.7, "dropout": 0.3}}}
    return records, ranking, dev_of, ensemble, report


def test_build_summary_and_its_renderings(tmp_path, summary_inputs):
    records, ranking, dev_of, ensemble, report = summary_inputs
    settings = _settings(tmp_path)
    s = build_summary(settings, records, ranking, dev_of, ensemble, report,
                      MlflowRefs("sqlite:///x.db", "1", "parent"), interrupted=False)
    c = s.counts
    assert (c.trials, c.completed, c.stopped_early, c.errored, c.interrupted, c.not_started) \
        == (3, 1, 1, 1, 0, 2)
    assert s.best_trial.trial_id == "a" and s.best_trial.val[OBJECTIVE] == 0.52
    assert s.best_trial.dev == {"dev/overall": 0.61}
    assert s.best_trial.searched == {"lr": 1e-4, "dropout": 0.1}
    assert s.best_trial.config["lr"] == 1e-4 and s.best_trial.config["max_examples"] == MAX
    assert [t.trial_id for t in s.top_trials] == ["a", "b"]
    assert s.ensemble.members == ["a", "b"] and "val/overall" in s.ensemble.val
    d = json.loads(s.to_json())
    assert d["counts"]["not_started"] == 2 and d["trials"][2]["status"] == "error"
    assert d["trials"][0]["best_val_overall"] == 0.52 and d["trials"][0]["evaluations"] == 4
    assert d["mlflow"] == {"tracking_uri": "sqlite:///x.db", "experiment_id": "1",
                           "parent_run_id": "parent", "runs_view": None,
                           "ensemble_run_id": None}
    md = s.markdown()
    assert "| trials | completed | stopped early (ASHA) | errored | never started |" in md
    assert "| 3 | 1 | 1 | 1 | 2 |" in md
    assert "| 1 | a | completed | 192 | 0.5200 | 0.260 |" in md
    assert "- d: TrialFailed: nan loss" in md and "- lr: 0.700" in md
    table = s.console_table().splitlines()
    assert table[2].split()[:5] == ["1", "a", "completed", "192", "0.5200"]
    assert table[2].split()[8] == "0.6100"
    assert table[-1] == ("trials: 3 (1 completed, 1 stopped early by ASHA, 1 errored, "
                         "2 never started)")


def test_every_trial_asked_for_and_not_run_is_counted_as_never_started(tmp_path,
                                                                        summary_inputs):
    """Every scheduler samples every trial asked for (promoting ASHA no longer ends the
    sampling), so the trials of num_samples that did not run are never started -- which
    the driver warns of, and which keeps every checkpoint for a --resume -- and the
    summary has no other count for them."""
    records, ranking, dev_of, ensemble, report = summary_inputs
    s = build_summary(_settings(tmp_path), records, ranking, dev_of, ensemble, report,
                      MlflowRefs("sqlite:///x.db", "1", "parent"), interrupted=False)
    counts = json.loads(s.to_json())["counts"]
    assert (counts["trials"], counts["not_started"]) == (3, 2) and "not_needed" not in counts
    assert "not needed" not in s.markdown() + s.console_table()


def test_trials_ray_restored_after_a_worker_failure_are_counted(tmp_path, summary_inputs):
    """The tracker's retries reach each record; the summary counts the trials restored
    (one restored twice, one failed for good after a retry) and says so."""
    own = tmp_path / "restored"
    results = [_ray_result(own, "a", [0.40, 0.52], config={"lr": 1e-4, "dropout": 0.1}),
               _ray_result(own, "b", [0.45], config={"lr": 2e-4, "dropout": 0.1}),
               _ray_result(own, "d", [], error=RuntimeError("worker died"),
                           config={"lr": 3e-4, "dropout": 0.1})]
    records = collect_trials(results, MAX, RUNGS, ended={"a", "b", "d"},
                             retries={"a": 2, "d": 1})
    assert {r.trial_id: r.retries for r in records} == {"a": 2, "b": 0, "d": 1}
    _, ranking, dev_of, ensemble, report = summary_inputs
    s = build_summary(_settings(tmp_path), records, ranked(records), dev_of, ensemble,
                      report, MlflowRefs("sqlite:///x.db", "1", "parent"), interrupted=False)
    assert s.counts.restored == 2 and json.loads(s.to_json())["counts"]["restored"] == 2
    assert "2 of the trials had their worker fail and were restored" in s.markdown()
    assert s.console_table().splitlines()[-1].endswith(
        "1 errored, 2 never started, 2 restored after a worker failure)")


def test_interrupted_summary_and_public_paths(tmp_path, summary_inputs):
    records, ranking, dev_of, ensemble, report = summary_inputs
    records[1].status = TrialStatus.INTERRUPTED
    settings = _settings(tmp_path, storage_uri="file:///bucket/searches")
    s = build_summary(settings, records, ranking, dev_of, ensemble, report,
                      MlflowRefs("sqlite:///x.db", "1", "parent"), interrupted=False)
    assert s.interrupted and s.counts.interrupted == 1
    stored = {"a": "file:///bucket/searches/exp/trial_a/checkpoint_000001"}
    public = s.with_public_paths(settings.location.public, stored)
    assert public.experiment_dir == "file:///bucket/searches/exp"
    assert public.best_trial.checkpoint == stored["a"]
    assert public.best_trial.predictions == "file:///bucket/searches/exp/best_trial/predictions"
    assert public.ensemble.predictions == "file:///bucket/searches/exp/ensemble/predictions"
    assert public.report_files == {"learning_curves": "file:///bucket/searches/exp/lc.png"}
    assert public.trials[0].best_checkpoint == stored["a"]
    assert public.trials[1].best_checkpoint == records[1].best_checkpoint  # not stored
    assert s.best_trial.checkpoint == records[0].best_checkpoint          # s unchanged


def test_the_first_trial_ready_counts_only_this_loops_trials():
    """first_ready_s: the earliest entry + start-up among the trials that entered within
    this loop (a resumed or extended search's earlier trials entered before it); none such,
    None and no clause in the phases line."""
    bests = [{"time/entered_at": 1005.0, "time/startup_s": 9.0},
             {"time/entered_at": 1003.0, "time/startup_s": 12.5},
             {"time/entered_at": 900.0, "time/startup_s": 1.0},   # an earlier run's trial
             {"val/overall": 0.5}]                                # reported no timings
    records = [TrialRecord(f"t{i}", f"trial_t{i}", TrialStatus.COMPLETED, {}, best=b)
               for i, b in enumerate(bests)]
    assert first_ready_s(records, 1000.0) == 14.0
    assert first_ready_s(records[2:], 1000.0) is None
    phases = {"total_s": 100.0, "data_s": 5.0, "setup_s": 10.0, "tune_s": 80.0,
              "finish_s": 5.0}
    assert "ready" not in phases_line(phases)
    assert "Tune's loop 1 min 20 s (the first trial ready 14 s into it)," in phases_line(
        {**phases, "first_ready_s": 14.0})


def test_the_first_trial_ready_is_its_first_run_when_its_best_came_after_a_resume(tmp_path):
    """A trial paused at a rung and resumed reports from two runs; its best is from the
    second.  The trial records keep every report's entry and start-up, and the loop's
    first trial ready is the first run's (not the later run its best names)."""
    first_run = {"time/entered_at": 1002.0, "time/startup_s": 3.0}
    resumed = {"time/entered_at": 1130.0, "time/startup_s": 4.0}
    paused = _ray_result(tmp_path, "p", [0.40, 0.55], timings=[first_run, resumed])
    later = _ray_result(tmp_path, "q", [0.42], timings=[
        {"time/entered_at": 1010.0, "time/startup_s": 6.0}])
    records = collect_trials([paused, later], MAX, RUNGS)
    by_id = {r.trial_id: r for r in records}
    assert by_id["p"].best["time/entered_at"] == 1130.0          # the best: the resumed run
    assert [(h["time/entered_at"], h["time/startup_s"]) for h in by_id["p"].history] == [
        (1002.0, 3.0), (1130.0, 4.0)]
    assert first_ready_s(records, 1000.0) == 5.0
    # the bests alone would name q's run
    assert min(r.best["time/entered_at"] + r.best["time/startup_s"] for r in records) == 1016.0
