"""``python -m bench.overhead --summary``, a finished search's cost, run as the command it
is: the GPU's utilisation during Tune's loop from an nvidia-smi CSV and a summary's
phases, and the training done per second over the loop."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import pytest
from conftest import REPO

T0 = datetime(2026, 11, 26, 10, 0, 0, tzinfo=timezone.utc).timestamp()


def write(tmp_path: Path, percents: list[int], gpus: int = 1) -> tuple[Path, Path]:
    """A sample every 5 s from T0 - 10 s; Tune's loop from T0 to 2 s after the last sample
    but one."""
    lines = []
    for i, percent in enumerate(percents):
        stamp = datetime.fromtimestamp(T0 - 10 + 5 * i, timezone.utc)
        for gpu in range(gpus):
            lines.append(f"{stamp:%Y/%m/%d %H:%M:%S}.000, {max(percent - gpu * 50, 0)} %, "
                         "1000 MiB")
    util = tmp_path / "gpu_util.csv"
    util.write_text("\n".join(lines) + "\n")
    summary = tmp_path / "summary.json"
    summary.write_text(json.dumps({"phases": {
        "tune_started_at": T0, "tune_ended_at": T0 + 5 * (len(percents) - 4) + 2}}))
    return util, summary


def cost(util: Path, summary: Path, *more: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = summary.parent / "cost.json"
    out.unlink(missing_ok=True)
    done = subprocess.run([sys.executable, "-m", "bench.overhead", "--summary", str(summary),
                           "--gpu-util", str(util), "--json", str(out), *more], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    return done, json.loads(out.read_text()) if out.is_file() else {}


def test_only_the_loop_s_samples_count(tmp_path):
    # 2 samples before the loop (0 %), 8 inside, the last one after it (0 %)
    percents = [0, 0, 100, 99, 95, 90, 40, 10, 30, 100, 0]
    util, summary = write(tmp_path, percents)
    done, r = cost(util, summary)
    assert done.returncode == 0, done.stderr
    assert r["first_ready_s"] is None  # a summary without first_ready_s
    b = r["gpus"]["0"]
    inside = percents[2:10]
    assert b["samples"] == 8 and b["mean"] == pytest.approx(sum(inside) / 8)
    assert b["at_90"] == pytest.approx(5 / 8) and b["at_50"] == pytest.approx(5 / 8)
    assert (b["idle_samples"], b["idle_run_s"], b["idle_run_from_s"]) == (3, 10.0, 20.0)
    assert "Tune's loop: 37 s\n" in done.stdout and "GPU 0: 8 samples, mean 70.5 %" in done.stdout
    phases = json.loads(summary.read_text())["phases"]
    summary.write_text(json.dumps({"phases": {**phases, "first_ready_s": 9.4}}))
    done, _ = cost(util, summary)
    assert "Tune's loop: 37 s, the first trial ready 9 s into it\n" in done.stdout


def test_several_gpus_each_their_row(tmp_path):
    util, summary = write(tmp_path, [0, 0, 100, 100, 100, 0], gpus=2)
    done, r = cost(util, summary)
    assert set(r["gpus"]) == {"0", "1"}
    assert "GPU 0: 3 samples, mean 100.0 %" in done.stdout
    assert "GPU 1: 3 samples, mean 50.0 %" in done.stdout


def test_a_bad_row_names_its_line(tmp_path):
    util, summary = write(tmp_path, [50, 50, 50, 50])
    util.write_text(util.read_text() + "not a sample\n")
    done, _ = cost(util, summary)
    assert done.returncode == 1 and "gpu_util.csv, line 5: expected" in done.stderr
    util.write_text("")
    summary.write_text("{}")
    done, _ = cost(util, summary)
    assert done.returncode == 1 and "phases.tune_started_at" in done.stderr


def test_examples_trained_over_the_loop_and_their_mfu(tmp_path):
    """Each trial's examples: its examples_seen, or its best checkpoint's where larger (a
    paused trial in an older summary); MFU from the step bench's FLOPs per example."""
    util, summary = write(tmp_path, [50, 50, 50, 50])
    summary.write_text(json.dumps({
        "phases": {"tune_started_at": T0, "tune_ended_at": T0 + 100, "tune_s": 100.0,
                   "total_s": 200.0},
        "trials": [{"examples_seen": 3000, "best": {"examples_seen": 2000}},
                   {"examples_seen": 1000, "best": {"examples_seen": 2000}}]}))
    tp = tmp_path / "tp.json"
    tp.write_text(json.dumps({"peak_gflops": 1000.0, "rows": [{"trials": 1, "unfused": {
        "processes": [{"flops": 4e12, "examples": 1000}]}}]}))
    done, r = cost(util, summary, "--throughput", str(tp))
    assert done.returncode == 0, done.stderr
    assert r["examples"] == 5000 and r["per_s_tune"] == 50.0 and r["per_s_total"] == 25.0
    assert r["mfu_tune"] == pytest.approx(50 * 4e9 / 1e12)
    assert r["mfu_total"] == pytest.approx(25 * 4e9 / 1e12)
