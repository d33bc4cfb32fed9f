"""A fused search (``--fuse on``) whose trainer process is killed with SIGKILL, as a crash or
an operator's ``kill -9`` ends it, in a fresh search (not a resumed one): twice, once while
its trials train with a checkpoint reported, and once more soon after Ray restarted it (the
trials joining it again from their checkpoints).  Ray restarts it each time; the trials
that trained in it are retried by Tune from their last checkpoints; the driver ends with a
summary, a ranking and an ensemble, and no traceback.

The search: the shared local Ray (2 CPUs), the tiny model, ``--budget smoke`` (192 examples
a trial, a report and a checkpoint every 48), batch 2, FIFO (each trial trains to its end),
random search, two trials at once.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from mtbert.tune.trial.trainer_pool import TUNE_CONTROLLER_LOG
from conftest import sqlite_mlflow_store

SMOKE_MAX, EVERY = 192, 48
NUM_TRIALS = 4
SPACE = """\
description: the fused trainer's death (tests)
params:
  lr: {loguniform: [1.0e-4, 1.0e-3]}
  batch_size: 2
"""


def _trainer_pids() -> list[int]:
    """The fused trainer's process among this test process's descendants (the shared Ray
    was started from here), found by the title Ray gives an actor's process."""
    import psutil

    pids = []
    for proc in psutil.Process().children(recursive=True):
        try:
            cmd = proc.cmdline()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if cmd and cmd[0].startswith("ray::GroupTrainer"):
            pids.append(proc.pid)
    return pids


def _around_traceback(console: str) -> str:
    """The console from a little before its first traceback to the exception it ends in
    (and on): what the assertion shows, where the console's tail would cut it off."""
    at = console.index("Traceback")
    return console[max(0, at - 500):at + 4000]


def _checkpointed(exp_dir: Path) -> set[str]:
    """Trials whose last result in Tune has a checkpoint and more to train."""
    found = set()
    for result in exp_dir.glob("trial_*/result.json"):
        try:
            last = json.loads(result.read_text().splitlines()[-1])
        except (OSError, IndexError, ValueError):
            continue
        if 0 < last["examples_seen"] < SMOKE_MAX:
            found.add(result.parent.name.removeprefix("trial_"))
    return found


def _fused_search(root: Path, name: str, seed: int, max_failures: int, killer, model: str,
                  data: str) -> dict:
    """``mtbert-tune --fuse on`` of :data:`SPACE` in this process, ``killer(done)`` on a
    thread meanwhile: its exit code, console, Tune's log records and summary."""
    from mtbert.tune.cli import main

    (root / f"{name}.yaml").write_text(SPACE, encoding="utf-8")
    done = threading.Event()
    thread = threading.Thread(target=killer, args=(done,), daemon=True)
    thread.start()
    console = io.StringIO()
    records: list[logging.LogRecord] = []
    tune_log = logging.getLogger(TUNE_CONTROLLER_LOG)
    handler = logging.Handler()
    handler.emit = records.append
    tune_log.addHandler(handler)
    started = time.time()
    try:
        with contextlib.redirect_stdout(console), contextlib.redirect_stderr(console):
            rc = main(["--space", str(root / f"{name}.yaml"), "--budget", "smoke",
                       "--model", model, "--data-dir", data,
                       "--num-samples", str(NUM_TRIALS), "--max-concurrent", "2",
                       "--mlflow-uri", sqlite_mlflow_store(root / "mlflow.db"),
                       "--seed", str(seed),
                       "--scheduler", "fifo", "--search-alg", "random",
                       "--max-failures", str(max_failures), "--ensemble-top-k", "2",
                       "--fuse", "on", "--experiment", name,
                       "--storage-path", str(root / "ray_results")])
    finally:
        done.set()
        thread.join()
        tune_log.removeHandler(handler)
    summary = root / "ray_results" / name / "summary.json"
    return {"rc": rc, "console": console.getvalue(), "tune_log": records,
            "exp_dir": root / "ray_results" / name, "wall_s": time.time() - started,
            "summary": json.loads(summary.read_text()) if summary.exists() else None}


@pytest.fixture(scope="module")
def killed_search(shared_ray, tmp_path_factory, tiny_model_dir, tiny_data_dir):
    root = tmp_path_factory.mktemp("trainer-death")
    exp_dir = root / "ray_results" / "death"
    kills: list[dict] = []

    def killer(done: threading.Event):
        """SIGKILL the trainer once a trial has a checkpoint in Tune; again once a new
        trainer process (Ray's restart) is up."""
        first = None
        while not done.is_set() and len(kills) < 2:
            pids = _trainer_pids()
            if len(pids) == 1:
                ready = _checkpointed(exp_dir)
                if (first is None and ready) or (first is not None and pids[0] != first):
                    os.kill(pids[0], signal.SIGKILL)
                    first = pids[0]
                    kills.append({"pid": pids[0], "at": time.time(), "checkpointed": ready})
                    if len(kills) == 2:
                        return
                    time.sleep(0.5)
            done.wait(0.05)

    out = _fused_search(root, "death", 0, 3, killer, tiny_model_dir, tiny_data_dir)
    return {**out, "kills": kills}


def test_the_search_survives_its_trainer_killed_twice(killed_search):
    console = killed_search["console"]
    assert len(killed_search["kills"]) == 2, console[-3000:]
    assert killed_search["rc"] == 0, console[-3000:]
    assert "Traceback" not in console, _around_traceback(console)
    s = killed_search["summary"]
    assert s is not None
    c = s["counts"]
    assert c["trials"] == c["completed"] == NUM_TRIALS and c["errored"] == 0, c
    assert s["best_trial"] and s["ensemble"] and s["ensemble"]["members"]
    placement = [ln for ln in console.splitlines() if "[tune] fused: trainer 0" in ln]
    assert placement and "restarted 2x" in placement[0], placement
    # Tune's log of each retried run: one line with the reason, no traceback
    lost = [r for r in killed_search["tune_log"] if "TrainerLost" in r.getMessage()]
    assert lost and all(r.exc_info is None and "\n" not in r.getMessage() for r in lost)


def test_the_killed_trainer_s_trials_resume_from_their_checkpoints(killed_search):
    """Every trial that trained to its end, the retried ones from their last checkpoint
    (fewer iterations since the restore than in all); what the kills cost: each retried
    trial trained again at most what it trained since its last forwarded checkpoint (< 2
    report intervals a failure: the one being trained, and one held unforwarded)."""
    from ray.tune import ExperimentAnalysis

    s = killed_search["summary"]
    analysis = ExperimentAnalysis(str(killed_search["exp_dir"]))
    trials = {t.trial_id: t for t in analysis.trials}
    rows = {t["trial_id"]: t for t in s["trials"]}
    retried = [tid for tid, t in trials.items() if t.num_failures]
    assert retried, killed_search["console"][-3000:]
    first_ready = killed_search["kills"][0]["checkpointed"]
    assert set(retried) & first_ready, (retried, first_ready)
    for tid in retried:
        assert "TrainerLost: its trainer" in Path(trials[tid].path, "error.txt").read_text()
        if tid in first_ready:
            last = analysis.trial_dataframes[tid].iloc[-1]
            assert last["iterations_since_restore"] < last["training_iteration"], tid
    for tid, row in rows.items():
        assert row["examples_seen"] == SMOKE_MAX, (tid, row)
        again = row["examples_trained"] - row["examples_seen"]
        assert 0 <= again < 2 * EVERY * max(1, trials[tid].num_failures), (tid, row)
    again = s["examples_trained"] - sum(r["examples_seen"] for r in rows.values())
    print(f"\n[trainer death] 2 kills, {len(retried)} trials retried, "
          f"{again} examples trained again of {s['examples_trained']}, "
          f"search {killed_search['wall_s']:.0f} s")


@pytest.fixture(scope="module")
def lost_for_good(shared_ray, tmp_path_factory, tiny_model_dir, tiny_data_dir):
    """A fused search whose only trainer ends for good (killed without a restart, as when
    its node is gone) once a trial has finished and another trains in it."""
    import ray

    from mtbert.tune.trial.group_trainer import TRAINER_PREFIX

    root = tmp_path_factory.mktemp("trainer-gone")
    exp_dir = root / "ray_results" / "gone"
    killed = []

    def killer(done: threading.Event):
        while not done.is_set():
            finished = [r for r in exp_dir.glob("trial_*/result.json")
                        if f'"examples_seen": {SMOKE_MAX}' in r.read_text()]
            if finished and _checkpointed(exp_dir):
                try:
                    trainer = ray.get_actor(f"{TRAINER_PREFIX}0")
                    training = ray.get(trainer.training.remote())
                    # a trial may be between two groups (one seen done, the next not yet
                    # joined: seen in one run); the kill waits for one to be training
                    if training:
                        killed.append(training)
                        ray.kill(trainer, no_restart=True)
                        return
                except (ValueError, ray.exceptions.RayActorError):
                    return
            done.wait(0.05)

    out = _fused_search(root, "gone", 1, 2, killer, tiny_model_dir, tiny_data_dir)
    return {**out, "killed": killed}


def test_a_trainer_gone_for_good_fails_its_trials_once_and_the_search_summarises(lost_for_good):
    console = lost_for_good["console"]
    assert lost_for_good["killed"] and lost_for_good["killed"][0], console[-3000:]
    assert lost_for_good["rc"] == 0, console[-3000:]
    assert "Traceback" not in console, _around_traceback(console)
    s = lost_for_good["summary"]
    c = s["counts"]
    assert c["completed"] >= 1 and c["errored"] >= 1 and c["trials"] == NUM_TRIALS, c
    failed = [t for t in s["trials"] if t["status"] == "error"]
    assert set(lost_for_good["killed"][0]) <= {t["trial_id"] for t in failed}
    for t in failed:
        assert "no trainer can take it again" in t["error"], t["error"]
    # the best is the best-scoring trial with weights, completed or not: a trial whose
    # trainer is gone keeps its checkpoints and is ranked with the others (records.ranked);
    # one killed at its budget's end (a CI run at 13ebd6b: 192 examples, val 0.556) can
    # outscore the one that completed (0.430)
    best = s["best_trial"]
    scores = [t["best_val_overall"] for t in s["trials"] if t["best_val_overall"] is not None]
    assert best["val"]["val/overall"] == max(scores), (best, s["trials"])
    assert best["status"] in ("completed", "error") and s["ensemble"]["members"]
    assert any("[tune] fused: trainer 0: no answer" in ln for ln in console.splitlines())
