"""A search whose MLflow server goes away mid-search and stays away past its end: the
driver's command line run in-process on the shared Ray session (``tune_driver.py``'s
``main``), a real ``mlflow server`` on 127.0.0.1, the tiny model, the tiny data and
``--budget smoke``; MLflow's own retry budget cut to a few seconds
(``MLFLOW_HTTP_REQUEST_*``), far shorter than the outage, and the end's wait to 5 s
(``MTBERT_MLFLOW_FLUSH_S``).

The search ends with exit 0 and its summary, Tune's loop having gone on while the server
was away (milliseconds in the MLflow callback in all); the summary and the console name what did not reach MLflow and the command that
sends it; that command exits 1 with one line while the server is still away and 0 once it
is back, after which MLflow holds every trial's evaluations (one point per Ray result)
and end tags, the ensemble run and the parent's end, and the summary's note is gone."""

from __future__ import annotations

import json
import shlex
import sqlite3
import threading
import time
from pathlib import Path

from mlflow_server import MlflowServer

EXPERIMENT = "outage"


def _trial_runs_made(db: Path) -> int:
    """Trial runs in the server's store (read-only, while the server writes)."""
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10) as conn:
            return conn.execute("select count(*) from tags where key = 'trial_id'").fetchone()[0]
    except sqlite3.OperationalError:  # tables not made yet
        return 0


def _stop_at_the_first_trial_run(server: MlflowServer, done: threading.Event) -> dict:
    """A thread that stops the server once the first trial's run is in it; its time."""
    when: dict = {}

    def watch():
        while not done.is_set():
            if _trial_runs_made(server.db) >= 1:
                server.stop()
                when["stopped"] = time.time()
                return
            time.sleep(0.2)
    threading.Thread(target=watch, daemon=True).start()
    return when


def _timed(method, spent: list):
    """``method`` adding the seconds each call takes to ``spent``."""
    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            spent.append(time.perf_counter() - start)
    return timed


def test_mlflow_away_from_mid_search_past_its_end_then_sent(shared_ray, tmp_path, monkeypatch,
                                                            capfd, tiny_model_dir,
                                                            tiny_data_dir):
    from mlflow import MlflowClient
    from ray.tune import ExperimentAnalysis

    from mtbert.tune.cli import main
    from mtbert.tune.results.callback import MlflowTrialCallback

    for name, value in (("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1"),
                        ("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1"),
                        ("MLFLOW_HTTP_REQUEST_TIMEOUT", "5"), ("MTBERT_MLFLOW_FLUSH_S", "5")):
        monkeypatch.setenv(name, value)
    spent: list[float] = []  # Tune's loop's time in the MLflow callback
    for name in ("on_trial_start", "on_trial_restore", "on_trial_result", "on_trial_recover",
                 "on_trial_complete", "on_trial_error"):
        monkeypatch.setattr(MlflowTrialCallback, name,
                            _timed(getattr(MlflowTrialCallback, name), spent))
    server = MlflowServer(tmp_path / "mlflow").start()
    storage = tmp_path / "ray_results"
    send = ["--send-mlflow", "--experiment", EXPERIMENT, "--storage-path", str(storage)]
    done = threading.Event()
    try:
        stop = _stop_at_the_first_trial_run(server, done)
        started = time.time()
        rc = main(["--space", "smoke", "--budget", "smoke", "--model", tiny_model_dir,
                   "--data-dir", tiny_data_dir, "--storage-path", str(storage),
                   "--experiment", EXPERIMENT, "--seed", "0", "--num-samples", "2",
                   "--scheduler", "asha", "--mlflow-uri", server.uri])
        ended = time.time()
        done.set()
        console = capfd.readouterr()
        assert rc == 0, console.err[-4000:]
        assert "stopped" in stop, "no trial run reached MLflow: the server was never stopped"
        stopped = stop["stopped"]  # (the server went away mid-search)

        # the summary, with the server still away: what is unsent, and how to send it
        exp_dir = storage / EXPERIMENT
        summary = json.loads((exp_dir / "summary.json").read_text())
        command = f"python tune_driver.py {shlex.join(send)}"
        unsent = summary["mlflow_unsent"]
        trial_ids = {t["trial_id"] for t in summary["trials"]}
        assert unsent["command"] == command and unsent["operations"] > 0
        assert set(unsent["runs"]) == trial_ids | {"parent", "ensemble"}, unsent
        markdown = (exp_dir / "summary.md").read_text()
        assert "## Not yet in MLflow" in markdown and command in markdown
        assert f"writes had not reached {server.uri}" in console.err and command in console.err
        # Tune's loop went on while the server was away: every trial reported after the stop
        frames = ExperimentAnalysis(str(exp_dir)).trial_dataframes
        assert set(frames) == trial_ids and summary["counts"]["trials"] == 2
        assert all(frames[t]["timestamp"].max() >= stopped for t in trial_ids), stopped

        assert main(send) == 1  # the server still away: one line, exit 1
        assert capfd.readouterr().err.strip().splitlines() == [
            f"error: MLflow at {server.uri} does not take the writes: "
            f"{unsent['operations']} of {EXPERIMENT} still wait in "
            f"{exp_dir / 'mlflow_outbox'}; run this again once it answers"]
        server.start()
        outage = time.time() - stopped
        assert main(send) == 0, capfd.readouterr()
        assert f"every MLflow write of {EXPERIMENT} is in {server.uri}" in capfd.readouterr().out

        summary = json.loads((exp_dir / "summary.json").read_text())
        assert summary["mlflow_unsent"] is None
        assert "## Not yet in MLflow" not in (exp_dir / "summary.md").read_text()
        client = MlflowClient(tracking_uri=server.uri)
        runs = client.search_runs([summary["mlflow"]["experiment_id"]])
        by_kind = {k: [r for r in runs if r.data.tags.get("kind") == k]
                   for k in ("search", "trial", "ensemble")}
        (parent,), (ensemble,) = by_kind["search"], by_kind["ensemble"]
        assert parent.info.status == "FINISHED" and ensemble.info.status == "FINISHED"
        assert ensemble.info.run_id == summary["mlflow"]["ensemble_run_id"]
        assert "## Not yet in MLflow" not in parent.data.tags["mlflow.note.content"]
        trials = {r.data.tags["trial_id"]: r for r in by_kind["trial"]}
        assert len(trials) == len(by_kind["trial"]) and set(trials) == trial_ids
        for t in summary["trials"]:
            run = trials[t["trial_id"]]
            assert t["mlflow_run_id"] == run.info.run_id and run.info.status == "FINISHED"
            steps = [m.step for m in client.get_metric_history(run.info.run_id, "val/overall")]
            assert steps == [int(s) for s in frames[t["trial_id"]]["examples_seen"]], steps
            assert run.data.tags["status"] == t["status"]
            assert run.data.tags["stopped_early"] == str(t["status"] == "stopped_early").lower()
            assert run.data.tags["rung_reached"] == str(t["rung_reached"])
            assert run.data.tags["examples_seen"] == str(t["examples_seen"])
        # the search did not wait for the server: Tune's loop spent milliseconds in the
        # MLflow callback (each of its calls with the server away would have waited out
        # MLflow's retries, then failed the search), and it ended while the server was away
        assert len(spent) >= 6 and sum(spent) < 2.0, spent
        assert ended - stopped < outage
        print(f"MLflow away {outage:.0f} s from {stopped - started:.0f} s into the search "
              f"(its retry budget a few seconds): the search ended after "
              f"{ended - started:.0f} s, {ended - stopped:.0f} s into the outage, exit 0, "
              f"{unsent['operations']} writes unsent, {len(spent)} calls of the MLflow "
              f"callback {sum(spent) * 1000:.0f} ms in all; --send-mlflow sent them once the "
              "server was back")
    finally:
        done.set()
        server.stop()
