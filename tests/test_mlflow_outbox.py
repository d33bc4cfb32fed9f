"""The search tracker's MLflow outbox against a real ``mlflow server`` on 127.0.0.1 that
the tests stop and start again (same SQLite backend store, same port), no Ray: writes
queued while the server is away cost the caller nothing and land in order, none twice,
once it is back; a journal left by a killed process is sent by the next tracker (a trial
run that process had made without recording it is found, not made again); a write MLflow
refuses (4xx) is dropped with one warning and does not hold up the others."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow_server import MlflowServer

from mtbert.tune.infra.outbox import JOURNAL, OUTBOX_DIR
from mtbert.tune.infra.tracking import SearchTracker

REPO = Path(__file__).resolve().parents[1]

#: a process that queues its writes while the server is away, then is killed (SIGKILL)
KILLED = """
import sys, time
from mtbert.tune.infra.tracking import SearchTracker
tracker = SearchTracker(sys.argv[1], "mtbert/outbox-killed", sys.argv[2], fresh=True,
                        background=True)
tracker.start_parent("killed", {"space": "x"}, {})
assert tracker.flush(60)
print("ready", flush=True)
sys.stdin.readline()  # the server is stopped now
for trial in ("t9", "t8"):
    tracker.child_run(trial, "trial_" + trial, {"lr": 3e-4})
    for step in (48, 96):
        tracker.log_trial_result(trial, {"val/overall": step / 1000}, step)
for value in "123":
    tracker.set_tags(tracker.run_of("t9"), {"order": value})
print("queued", flush=True)
time.sleep(600)
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = MlflowServer(tmp_path_factory.mktemp("mlflow-server")).start()
    yield s
    s.stop()


@pytest.fixture
def short_retries(monkeypatch):
    """MLflow's own retries of a request cut to nothing: a write tried while the server is
    away fails at once (the outbox retries it)."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")


def _points(client, run_id: str, key: str = "val/overall") -> list[int]:
    return [m.step for m in client.get_metric_history(run_id, key)]


def _trial_runs(client, tracker: SearchTracker, trial_id: str) -> list:
    return client.search_runs([tracker.experiment_id()],
                              filter_string=f"tags.trial_id = '{trial_id}'")


def test_writes_wait_while_the_server_is_away_and_land_in_order_once_it_is_back(
        server, tmp_path, short_retries):
    killed = subprocess.Popen([sys.executable, "-c", KILLED, server.uri, str(tmp_path / "k")],
                              cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        tracker = SearchTracker(server.uri, "mtbert/outbox-ours", tmp_path / "ours", fresh=True,
                                background=True)
        tracker.start_parent("ours", {"space": "x"}, {})
        tracker.child_run("t1", "trial_t1", {"lr": 1e-4})
        tracker.log_trial_result("t1", {"val/overall": 0.048}, 48)
        assert tracker.flush(60)
        assert killed.stdout.readline().strip() == "ready"

        server.stop()
        stopped = time.time()
        started = time.perf_counter()
        tracker.child_run("t2", "trial_t2", {"lr": 2e-4})  # made while the server is away
        for step in (48, 96, 144):
            tracker.log_trial_result("t2", {"val/overall": step / 1000}, step)
        tracker.log_trial_result("t1", {"val/overall": 0.096}, 96)
        for value in "123":
            tracker.set_tags(tracker.run_of("t1"), {"order": value})
        note = tmp_path / "gone" / "note.txt"  # a file of a folder gone before the send
        note.parent.mkdir()
        note.write_text("as queued", encoding="utf-8")
        tracker.log_artifact(tracker.run_of("t2"), note)
        shutil.rmtree(note.parent)
        tracker.end_trial("t1", "FINISHED", {"status": "completed"})
        queued_s = time.perf_counter() - started
        assert queued_s < 2.0, queued_s  # no call waited for MLflow
        assert not tracker.flush(1.0)
        assert tracker.unsent() == {"operations": 10, "runs": {"t2": 5, "t1": 5}}

        killed.stdin.write("go\n")
        killed.stdin.flush()
        assert killed.stdout.readline().strip() == "queued"
    finally:
        killed.kill()
        killed.wait(timeout=30)

    server.start()
    outage_s = time.time() - stopped
    # the killed process's t9 run reached MLflow before the kill, its id unrecorded
    killed_state = json.loads((tmp_path / "k" / "mtbert_mlflow.json").read_text())
    client = tracker.client
    client.create_run(killed_state["experiment_id"], run_name="trial_t9", tags={
        "mlflow.parentRunId": killed_state["parent_run_id"], "kind": "trial", "trial_id": "t9"})
    assert tracker.flush(60)
    nxt = SearchTracker(server.uri, "mtbert/outbox-killed", tmp_path / "k", background=True)
    assert nxt.unsent()["operations"] == 9  # its journal, read back
    assert nxt.flush(60)

    # ours: each write once, in the order queued; the artifact as it was when queued
    (t1,), (t2,) = _trial_runs(client, tracker, "t1"), _trial_runs(client, tracker, "t2")
    assert _points(client, t1.info.run_id) == [48, 96]
    assert _points(client, t2.info.run_id) == [48, 96, 144]
    assert t2.data.params == {"lr": "0.0002"}
    assert t1.data.tags["order"] == "3" and t1.data.tags["status"] == "completed"
    assert t1.info.status == "FINISHED" and t2.info.status == "RUNNING"
    local = client.download_artifacts(t2.info.run_id, "note.txt", str(tmp_path))
    assert Path(local).read_text(encoding="utf-8") == "as queued"
    # the killed process's: its journal sent by the next tracker, t9's run not made twice
    (t9,), (t8,) = _trial_runs(client, nxt, "t9"), _trial_runs(client, nxt, "t8")
    assert nxt.run_ids() == {"t9": t9.info.run_id, "t8": t8.info.run_id}
    for run in (t9, t8):
        assert _points(client, run.info.run_id) == [48, 96]
        assert run.data.params == {"lr": "0.0003"}
    assert t9.data.tags["order"] == "3"
    for folder in (tmp_path / "ours", tmp_path / "k"):  # all sent: the journal is empty
        assert (folder / OUTBOX_DIR / JOURNAL).read_text() == ""
    print(f"outbox: 10 writes queued in {queued_s * 1000:.0f} ms with the server away; "
          f"sent after its {outage_s:.0f} s outage, with the killed process's 9")


def test_a_write_mlflow_refuses_is_dropped_with_one_warning_and_the_rest_goes_on(
        server, tmp_path, capfd):
    if not server.answers():
        server.start()
    tracker = SearchTracker(server.uri, "mtbert/outbox-4xx", tmp_path, fresh=True,
                            background=True)
    tracker.start_parent("refused", {"space": "x"}, {})
    tracker.child_run("t1", "trial_t1", {"lr": 1e-4})
    for _ in range(2):  # MLflow's params are immutable: it answers 400, twice
        tracker.log_params(tracker.run_of("t1"), {"lr": 5e-4})
    tracker.log_trial_result("t1", {"val/overall": 0.5}, 48)
    tracker.set_tags(tracker.run_of("t1"), {"after": "yes"})
    assert tracker.flush(60)
    err = capfd.readouterr().err
    assert err.count("warning: MLflow refused a write, dropped (params of t1: ") == 1, err
    assert "INVALID_PARAMETER_VALUE" in err or "Changing param values is not allowed" in err
    run = tracker.client.get_run(tracker.run_ids()["t1"])
    assert run.data.params == {"lr": "0.0001"} and run.data.tags["after"] == "yes"
    assert _points(tracker.client, run.info.run_id) == [48]
