"""CUDA MPS for trials sharing a GPU (``--mps``): when the search starts a daemon of its
own, that its workers are told where it is, and that it is stopped.  No GPU and no NVIDIA
driver here: the daemon is played by a stand-in ``nvidia-cuda-mps-control`` that records
how it is called; what MPS then does for the trials is measured on a GPU
(docs/bench/step_graphs.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mtbert.core.errors import ConfigError
from mtbert.tune.infra import mps

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("choice, address, gpus, have_gpu, control, off", [
    ("auto", None, None, True, "/bin/ctl", None),
    ("auto", None, 0.25, True, "/bin/ctl", None),
    ("off", None, None, True, "/bin/ctl", "off: --mps off"),
    ("auto", "HEAD:6379", None, True, "/bin/ctl", "off: the trials run on a Ray cluster's"),
    ("auto", None, None, False, "/bin/ctl", "off: no CUDA GPU on this machine"),
    ("auto", None, None, True, None, "off: nvidia-cuda-mps-control is not on PATH"),
    ("auto", None, 1.0, True, "/bin/ctl", "off: each trial has whole GPUs"),
    ("auto", None, 0.0, True, "/bin/ctl", "off: the trials train on CPUs"),
    ("on", None, 1.0, True, "/bin/ctl", None),  # asked for: started even for one a GPU
])
def test_when_the_search_starts_a_daemon(choice, address, gpus, have_gpu, control, off):
    reason = mps.mps_reason_off(choice, address, gpus, have_gpu, control)
    assert (reason is None) == (off is None)
    if off is not None:
        assert reason.startswith(off)


@pytest.mark.parametrize("address, have_gpu, control, message", [
    ("HEAD:6379", True, "/bin/ctl", "--mps on: the trials run on a Ray cluster's nodes"),
    (None, False, "/bin/ctl", "--mps on: no CUDA GPU on this machine"),
    (None, True, None, "--mps on: nvidia-cuda-mps-control is not on PATH"),
    (None, True, "/bin/ctl", r"--mps on: the trials train on CPUs \(--gpus-per-trial 0\)"),
])
def test_mps_on_where_it_cannot_be_is_an_error(address, have_gpu, control, message):
    gpus = 0.0 if "CPUs" in message else None
    with pytest.raises(ConfigError, match=message):
        mps.mps_reason_off("on", address, gpus, have_gpu, control)


def _stand_in(folder: Path, exit_status: int = 0) -> Path:
    """An ``nvidia-cuda-mps-control`` that appends {args, pipe, pipe_exists, stdin} to
    ``calls.jsonl`` beside it and exits with ``exit_status``."""
    folder.mkdir(parents=True, exist_ok=True)
    log = folder / "calls.jsonl"
    script = folder / mps.CONTROL
    script.write_text(f"""#!{sys.executable}
import json, os, sys
pipe = os.environ.get("{mps.PIPE_ENV}", "")
stdin = "" if sys.stdin.isatty() else sys.stdin.read()
with open({str(log)!r}, "a") as f:
    f.write(json.dumps({{"args": sys.argv[1:], "pipe": pipe,
                         "pipe_exists": os.path.isdir(pipe),
                         "log": os.environ.get("{mps.LOG_ENV}", ""), "stdin": stdin}}) + "\\n")
log_folder = os.environ.get("{mps.LOG_ENV}", "")
if os.path.isdir(log_folder):  # as the daemon logs: a line per command, in control.log
    with open(os.path.join(log_folder, "control.log"), "a") as f:
        f.write(f"control {{sys.argv[1:]}} {{stdin.strip()}}\\n")
if {exit_status}:
    print("cannot start the MPS daemon", file=sys.stderr)
sys.exit({exit_status})
""")
    script.chmod(0o755)
    return log


@pytest.fixture(autouse=True)
def client_stand_in(monkeypatch):
    """The CUDA client run once under a new daemon: here a process that only checks that it
    was told the daemon's pipe folder."""
    monkeypatch.setattr(mps, "PROBE", [sys.executable, "-c", (
        f"import os, sys; sys.exit(0 if os.path.isdir(os.environ['{mps.PIPE_ENV}']) else 3)")])


def _calls(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def test_a_daemon_of_the_search_is_started_named_to_the_workers_and_stopped(tmp_path,
                                                                          monkeypatch):
    log = _stand_in(tmp_path / "bin")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv(mps.PIPE_ENV, raising=False)
    with mps.cuda_mps("auto", None, None, have_gpu=True) as use:
        started = _calls(log)
        pipe = use.worker_env[mps.PIPE_ENV]
        assert Path(pipe).is_dir() and Path(use.worker_env[mps.LOG_ENV]).is_dir()
    assert [c["args"] for c in started] == [["-d"]]
    assert started[0]["pipe"] == pipe and started[0]["pipe_exists"]
    assert started[0]["log"] == use.worker_env[mps.LOG_ENV]
    assert use.note == f"on: a daemon of this search's own ({mps.PIPE_ENV}={pipe})"
    stopped = _calls(log)[1:]
    assert [(c["args"], c["stdin"], c["pipe"]) for c in stopped] == [([], "quit\n", pipe)]
    assert not Path(pipe).parent.exists()  # its temporary folder is gone
    assert mps.PIPE_ENV not in os.environ  # the driver's own CUDA stays outside MPS


def test_the_daemon_s_logs_are_kept_where_the_search_asks(tmp_path, monkeypatch, capsys):
    _stand_in(tmp_path / "bin")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv(mps.PIPE_ENV, raising=False)
    keep = tmp_path / "experiment" / mps.MPS_LOG_FOLDER / "20261127-080419"
    with mps.cuda_mps("auto", None, None, have_gpu=True, keep_logs=keep) as use:
        assert not keep.exists()  # copied once the daemon has stopped
    assert (keep / "control.log").read_text().splitlines() == [
        "control ['-d'] ", "control [] quit"]
    assert not Path(use.worker_env[mps.LOG_ENV]).exists()
    assert f"the MPS daemon's logs: {keep} (control.log)" in capsys.readouterr().out


def test_the_daemon_is_stopped_when_the_search_fails(tmp_path, monkeypatch):
    log = _stand_in(tmp_path / "bin")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv(mps.PIPE_ENV, raising=False)
    with pytest.raises(KeyboardInterrupt):
        with mps.cuda_mps("on", None, None, have_gpu=True):
            raise KeyboardInterrupt
    assert [(c["args"], c["stdin"]) for c in _calls(log)] == [(["-d"], ""), ([], "quit\n")]


def test_a_daemon_that_does_not_start(tmp_path, monkeypatch):
    log = _stand_in(tmp_path / "bin", exit_status=1)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv(mps.PIPE_ENV, raising=False)
    with mps.cuda_mps("auto", None, None, have_gpu=True) as use:
        assert use.worker_env == {}
    assert use.note == "off: nvidia-cuda-mps-control -d failed: cannot start the MPS daemon"
    with pytest.raises(ConfigError, match=r"--mps on: nvidia-cuda-mps-control -d failed: "
                                          r"cannot start the MPS daemon"):
        with mps.cuda_mps("on", None, None, have_gpu=True):
            pass
    assert [c["args"] for c in _calls(log)] == [["-d"], ["-d"]]  # nothing to stop


def test_a_daemon_that_cannot_serve_is_stopped_before_the_trials(tmp_path, monkeypatch):
    log = _stand_in(tmp_path / "bin")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv(mps.PIPE_ENV, raising=False)
    monkeypatch.setattr(mps, "PROBE", [sys.executable, "-c", (
        "import sys; print('RuntimeError: CUDA error: all CUDA-capable devices are busy or "
        "unavailable', file=sys.stderr); sys.exit(1)")])
    with mps.cuda_mps("auto", None, None, have_gpu=True) as use:
        assert use.worker_env == {}
    assert use.note == ("off: a CUDA process could not run under the new daemon: RuntimeError: "
                        "CUDA error: all CUDA-capable devices are busy or unavailable")
    assert [(c["args"], c["stdin"]) for c in _calls(log)] == [(["-d"], ""), ([], "quit\n")]
    with pytest.raises(ConfigError, match="--mps on: a CUDA process could not run under"):
        with mps.cuda_mps("on", None, None, have_gpu=True):
            pass
    assert [c["args"] for c in _calls(log)][2:] == [["-d"], []]


def test_a_daemon_named_in_the_environment_is_used_as_it_is(tmp_path, monkeypatch):
    log = _stand_in(tmp_path / "bin")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv(mps.PIPE_ENV, "/tmp/their-mps")
    with mps.cuda_mps("on", None, None, have_gpu=False) as use:
        assert use.worker_env == {}  # the workers inherit the variable
    assert use.note == f"on: the daemon at {mps.PIPE_ENV}=/tmp/their-mps (not started here)"
    with mps.cuda_mps("off", None, None, have_gpu=True) as use:
        assert use.note == "off: --mps off"
    assert _calls(log) == []


def test_mps_on_without_a_gpu_exits_2_before_anything_starts(tmp_path):
    out = subprocess.run([sys.executable, "tune_driver.py", "--space", "smoke", "--budget",
                          "smoke", "--mps", "on", "--storage-path", str(tmp_path / "runs")],
                         cwd=REPO, capture_output=True, text=True, timeout=120,
                         env={k: v for k, v in os.environ.items() if k != mps.PIPE_ENV})
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == ["error: --mps on: no CUDA GPU on this machine"]
    assert not (tmp_path / "runs").exists()


@pytest.mark.integration
def test_ray_workers_get_the_search_s_environment():
    """``ray_for_search``'s ``worker_env`` reaches a local Ray's tasks and actors (Tune's
    trials are actors) through the job's runtime_env, and not the driver's environment."""
    code = """
import os, ray
from mtbert.tune.infra.cluster import ray_for_search

@ray.remote
def task():
    return os.environ.get("MTBERT_MPS_PROBE")

@ray.remote
class Actor:
    def read(self):
        return os.environ.get("MTBERT_MPS_PROBE")

with ray_for_search(None, {"MTBERT_MPS_PROBE": "pipe-here"}):
    print(ray.get(task.remote()), ray.get(Actor.remote().read.remote()),
          os.environ.get("MTBERT_MPS_PROBE"))
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                         text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "pipe-here pipe-here None"
