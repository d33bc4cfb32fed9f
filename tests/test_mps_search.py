"""A search whose trials share one GPU under its own CUDA MPS daemon ends with no trial
faulted.  Tune stops trials and ends their workers while the neighbours train; a worker
that ended with kernels in flight would fault every other client of the GPU (seen in a
``full`` search on one H200, 2026-11-27; ``mtbert/tune/trial/worker_exit.py``).  Here the trials
are tiny and their graphed steps short, so a stop nearly always lands mid-step, and
``--max-failures 0`` turns a fault into an errored trial.  Needs a CUDA GPU (skipped
without, conftest.py), ``nvidia-cuda-mps-control`` and Ray."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.cuda


def test_trials_sharing_a_gpu_under_mps_end_without_a_fault(tmp_path, tiny_model_dir,
                                                             tiny_data_dir):
    pytest.importorskip("ray")
    if shutil.which("nvidia-cuda-mps-control") is None:
        pytest.skip("no nvidia-cuda-mps-control on this machine")
    out = tmp_path / "runs"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (os.environ.get("PYTHONPATH"), str(REPO)) if p)}
    done = subprocess.run(
        [sys.executable, "tune_driver.py", "--space", "smoke", "--budget", "smoke",
         "--num-samples", "16", "--model", tiny_model_dir, "--data-dir", tiny_data_dir,
         "--cpus-per-trial", "1", "--gpus-per-trial", "0.25", "--mps", "on",
         "--max-failures", "0", "--keep-checkpoints", "none", "--storage-path", str(out),
         "--experiment", "mps-stops"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-3000:]
    summary = json.loads((out / "mps-stops" / "summary.json").read_text())
    assert summary["resources"]["mps"].startswith("on"), summary["resources"]
    counts = summary["counts"]
    assert counts["errored"] == 0, counts
    assert counts["stopped_early"] >= 4, counts  # workers ended beside training trials
    assert "illegal memory access" not in log
