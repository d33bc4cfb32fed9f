"""Faults on the fused path (``--fuse on``), in one search on the shared local Ray (2 CPUs),
a real SQLite MLflow store, the tiny model and ``--budget smoke`` (192 examples a trial, a
report and a checkpoint every 48), FIFO (each trial trains to its end or its error),
random search, two trials at once:

* one STS loss weight overflows (w_sts 1e300): those trials fail alone, their error naming
  the non-finite loss; the others train on in the trainer;
* Ctrl-C (SIGINT to this process, where the driver runs) once a trial has finished and
  another trains in the trainer: exit 130; ``--resume`` finishes the search, the ended trials not trained
  again, one MLflow run per trial;
* in the resumed search, the trainer actor is killed (as a crash kills it) while a trial
  trains in it with a checkpoint reported: Ray restarts it, its trials fail and Tune retries them from their last
  checkpoints into the restarted trainer; nothing is lost.

(A trial stopped by ASHA leaving its group: tests/test_fused_search.py; ``--extend`` on
the fused path: tests/test_extend.py.)
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import sqlite3
import threading
import time
from pathlib import Path

import pytest
from conftest import NAN_SPACE, sqlite_mlflow_store

SMOKE_MAX = 192
NUM_TRIALS = 4
#: random search (its draws do not follow the trials' results, as Optuna's do): w_sts 1e300,
#: 1, 1, 1 in order, two at once -- the NaN trial fuses with a healthy one, which trains
#: on; each later one starts as one ends, so Ctrl-C finds one ended and one training
SEED = 2
#: conftest's NaN space at batch 2 (more steps per trial: time for Ctrl-C to find one training)
FUSED_NAN_SPACE = NAN_SPACE + "  batch_size: 2\n"


def _runs(db: Path) -> dict[str, dict]:
    """trial id -> {run_id, status, examples_seen, w_sts}, read-only from the SQLite store
    (a trial's run and its params are there from its start; Tune's params.json only
    from its first report)."""
    if not db.exists():
        return {}
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10) as conn:
            rows = conn.execute(
                "select r.run_uuid, r.status, t.value, (select max(m.value) from metrics m "
                "where m.run_uuid = r.run_uuid and m.key = 'examples_seen'), (select p.value from "
                "params p where p.run_uuid = r.run_uuid and p.key = 'w_sts') from runs r join "
                "tags t on t.run_uuid = r.run_uuid and t.key = 'trial_id'").fetchall()
    except sqlite3.OperationalError:  # tables not created yet / busy
        return {}
    return {tid: {"run_id": run, "status": status, "examples_seen": int(seen or 0),
                  "w_sts": float(w_sts) if w_sts else None}
            for run, status, tid, seen, w_sts in rows}


def _steps(db: Path, run_id: str) -> list[int]:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10) as conn:
        return [s for (s,) in conn.execute(
            "select step from metrics where run_uuid=? and key='val/overall' order by step",
            (run_id,))]


@contextlib.contextmanager
def _when(predicate, act):
    """While in the block, a thread calls ``act(value)`` once ``predicate()`` returns a
    value (again while ``act`` returns False)."""
    done = threading.Event()

    def watch():
        while not done.is_set():
            value = predicate()
            if value and act(value) is not False:
                return
            done.wait(0.02)
    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def _main(argv: list[str]) -> tuple[int, str]:
    from mtbert.tune.cli import main
    console = io.StringIO()
    with contextlib.redirect_stdout(console), contextlib.redirect_stderr(console):
        rc = main(argv)
    return rc, console.getvalue()


@pytest.fixture(scope="module")
def faults(shared_ray, tmp_path_factory, tiny_model_dir, tiny_data_dir):
    import ray

    from mtbert.tune.trial.group_trainer import TRAINER_PREFIX

    root = tmp_path_factory.mktemp("fused-faults")
    (root / "nan.yaml").write_text(FUSED_NAN_SPACE, encoding="utf-8")
    storage, db = root / "ray_results", root / "mlflow.db"
    common = ["--experiment", "faults", "--storage-path", str(storage)]
    out = {"db": db, "exp_dir": storage / "faults", "at_interrupt": {}, "killed": [],
           "checkpointed": set()}

    def healthy(runs: dict[str, dict]) -> set[str]:  # the trials of w_sts 1
        return {tid for tid, run in runs.items() if run["w_sts"] == 1.0}

    def in_trainer() -> tuple | None:
        """The trainer and the trials training in it (None before it starts)."""
        try:
            trainer = ray.get_actor(f"{TRAINER_PREFIX}0")
            return trainer, ray.get(trainer.training.remote())
        except (ValueError, ray.exceptions.RayActorError):
            return None

    # Ctrl-C once a trial has finished and one of w_sts 1 trains in the trainer: Tune's
    # handler (the main thread's) stops the search; a signal after Tune's loop meets the
    # no-op put here
    def ended_and_training():
        found = in_trainer()
        if not found:
            return None
        runs = _runs(db)
        if not healthy(runs) & set(found[1]):
            return None
        return runs if any(r["status"] == "FINISHED" for r in runs.values()) else None

    def interrupt(runs):
        out["at_interrupt"] = runs
        os.kill(os.getpid(), signal.SIGINT)

    previous = signal.signal(signal.SIGINT, lambda *_: None)
    try:
        with _when(ended_and_training, interrupt):
            out["first"] = _main(["--space", str(root / "nan.yaml"), "--budget", "smoke",
                                  "--model", tiny_model_dir, "--data-dir", tiny_data_dir,
                                  "--num-samples", str(NUM_TRIALS), "--max-concurrent", "2",
                                  "--mlflow-uri", sqlite_mlflow_store(db), "--seed", str(SEED),
                                  "--scheduler", "fifo", "--search-alg", "random",
                                  "--max-failures", "2",
                                  "--ensemble-top-k", "1", "--fuse", "on", *common])
    finally:
        signal.signal(signal.SIGINT, previous)
    out["ended_before"] = {t: _steps(db, r["run_id"]) for t, r in out["at_interrupt"].items()
                           if r["status"] in ("FINISHED", "FAILED")}

    # the resumed search: kill its trainer once a trial of w_sts 1 training in it has
    # reported a checkpoint in this search and has more to train (the first search's
    # trainer is gone by now: its name is free once the search returns)
    def checkpointed(tid: str, since: float) -> bool:
        """Tune has this trial's report since ``since`` with its checkpoint, not its last."""
        try:
            rows = (out["exp_dir"] / f"trial_{tid}" / "result.json").read_text().splitlines()
            last = json.loads(rows[-1])
        except (OSError, IndexError, ValueError):  # not written yet, or being written
            return False
        return last["time/entered_at"] >= since and 0 < last["examples_seen"] < SMOKE_MAX

    def kill(found):
        trainer, ids = found
        ready = {t for t in healthy(_runs(db)) & set(ids) if checkpointed(t, resumed_at)}
        if not ready:
            return False
        out["killed"], out["checkpointed"] = ids, ready
        ray.kill(trainer, no_restart=False)  # as a crash kills it: Ray may restart it

    resumed_at = time.time()
    with _when(in_trainer, kill):
        out["resumed"] = _main(["--resume", *common])
    summary = out["exp_dir"] / "summary.json"
    out["summary"] = json.loads(summary.read_text()) if summary.exists() else None
    return out


def test_ctrl_c_stops_the_fused_search_and_resume_finishes_it(faults):
    rc, console = faults["first"]
    assert faults["at_interrupt"], console[-3000:]
    assert rc == 130, console[-3000:]
    assert "--resume --experiment faults" in console
    rc, console = faults["resumed"]
    assert rc == 0, console[-3000:]
    s = faults["summary"]
    c = s["counts"]
    assert s["interrupted"] is False and c["interrupted"] == c["not_started"] == 0
    assert c["trials"] == NUM_TRIALS
    assert c["completed"] + c["stopped_early"] + c["errored"] == NUM_TRIALS
    # the trials that had ended before Ctrl-C did not train again: the same MLflow points
    db = faults["db"]
    runs = _runs(db)
    status = {t["trial_id"]: t["status"] for t in s["trials"]}
    assert any(status[t] != "error" for t in faults["ended_before"]), faults["ended_before"]
    for tid, steps in faults["ended_before"].items():
        assert _steps(db, runs[tid]["run_id"]) == steps, tid


def test_a_nan_trial_fails_alone_naming_the_non_finite_loss(faults):
    s = faults["summary"]
    failed = [t for t in s["trials"] if t["status"] == "error"]
    ok = [t for t in s["trials"] if t["status"] != "error"]
    assert failed and ok, [(t["config"]["w_sts"], t["status"]) for t in s["trials"]]
    assert all(t["config"]["w_sts"] == 1e300 for t in failed)
    assert all(t["config"]["w_sts"] == 1.0 for t in ok)
    for t in failed:
        assert "non-finite loss" in t["error"], t["error"]
    assert all(t["status"] in ("completed", "stopped_early") for t in ok)
    assert any(t["examples_seen"] >= SMOKE_MAX for t in ok)  # one trained its whole budget
    assert s["best_trial"]["trial_id"] in {t["trial_id"] for t in ok}


def test_a_killed_trainer_restarts_and_its_trials_resume_from_checkpoints(faults):
    """Each trial training in the trainer at the kill (one of w_sts 1 at least) is
    retried (Ray counts its failure; its thin trial saw the trainer die) from a
    checkpoint, not from the start, and ends as the others do; MLflow keeps one run per
    trial, its points without repeats."""
    from mlflow import MlflowClient
    from ray.tune import ExperimentAnalysis

    killed = faults["killed"]
    assert killed, faults["resumed"][1][-3000:]
    s = faults["summary"]
    analysis = ExperimentAnalysis(str(faults["exp_dir"]))
    trials = {t.trial_id: t for t in analysis.trials}
    assert set(trials) == {t["trial_id"] for t in s["trials"]}
    records = {t["trial_id"]: t for t in s["trials"]}
    retried = [tid for tid in killed if records[tid]["status"] != "error"]
    assert set(retried) & faults["checkpointed"], (killed, faults["checkpointed"])
    for tid in retried:
        assert trials[tid].num_failures >= 1, tid
        # its thin trial saw the trainer die (Ray's actor error, or unknown to the restarted one)
        assert "TrainerLost: its trainer" in Path(trials[tid].path, "error.txt").read_text()
        assert records[tid]["status"] in ("completed", "stopped_early")
        if tid in faults["checkpointed"]:  # from its checkpoint, not from the start
            last = analysis.trial_dataframes[tid].iloc[-1]
            assert last["iterations_since_restore"] < last["training_iteration"], tid
            assert records[tid]["examples_seen"] >= SMOKE_MAX
    client = MlflowClient(tracking_uri=f"sqlite:///{faults['db']}")
    exp = client.get_experiment_by_name("mtbert/nan")
    runs = client.search_runs([exp.experiment_id])
    children = [r for r in runs if r.data.tags.get("kind") == "trial"]
    assert sorted(r.data.tags["trial_id"] for r in children) == sorted(records)
    for run in children:
        if run.data.tags["trial_id"] in retried:
            assert int(run.data.tags["retries"]) >= 1, run.data.tags
    retried = [r for r in children if r.data.tags["trial_id"] in killed
               and records[r.data.tags["trial_id"]]["status"] != "error"]
    assert retried and all(int(r.data.tags["retries"]) >= 1 for r in retried)
    for run in children:
        steps = _steps(faults["db"], run.info.run_id)
        assert steps == sorted(set(steps)), (run.data.tags["trial_id"], steps)
        want = "FAILED" if records[run.data.tags["trial_id"]]["status"] == "error" else "FINISHED"
        assert run.info.status == want
    parent, = [r for r in runs if r.data.tags.get("kind") == "search"]
    assert parent.info.status == "FINISHED" and parent.data.tags.get("resumed") == "true"
