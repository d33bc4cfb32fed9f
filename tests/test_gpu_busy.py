"""bench/gpu_busy.py: the GPU's utilisation during Tune's loop, from an nvidia-smi CSV and
a summary's phases."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path

import pytest

from bench import gpu_busy

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


def test_only_the_loop_s_samples_count(tmp_path, capsys):
    # 2 samples before the loop (0 %), 8 inside, the last one after it (0 %)
    percents = [0, 0, 100, 99, 95, 90, 40, 10, 30, 100, 0]
    util, summary = write(tmp_path, percents)
    start, end, ready = gpu_busy.tune_loop(summary)
    assert ready is None  # a summary without first_ready_s
    b = gpu_busy.busy(gpu_busy.read_samples(util), start, end)
    inside = percents[2:10]
    assert b["samples"] == 8 and b["mean"] == pytest.approx(sum(inside) / 8)
    assert b["at_90"] == pytest.approx(5 / 8) and b["at_50"] == pytest.approx(5 / 8)
    assert (b["idle_samples"], b["idle_run_s"], b["idle_run_from_s"]) == (3, 10.0, 20.0)
    assert gpu_busy.main([str(util), str(summary)]) == 0
    out = capsys.readouterr().out
    assert "Tune's loop: 37 s\n" in out and "GPU 0: 8 samples, mean 70.5 %" in out
    phases = json.loads(summary.read_text())["phases"]
    summary.write_text(json.dumps({"phases": {**phases, "first_ready_s": 9.4}}))
    gpu_busy.main([str(util), str(summary)])
    assert "Tune's loop: 37 s, the first trial ready 9 s into it\n" in capsys.readouterr().out


def test_several_gpus_each_their_row(tmp_path, capsys):
    util, summary = write(tmp_path, [0, 0, 100, 100, 100, 0], gpus=2)
    samples = gpu_busy.read_samples(util)
    assert {s.gpu for s in samples} == {0, 1}
    gpu_busy.main([str(util), str(summary)])
    out = capsys.readouterr().out
    assert "GPU 0: 3 samples, mean 100.0 %" in out and "GPU 1: 3 samples, mean 50.0 %" in out


def test_a_bad_row_names_its_line(tmp_path):
    util, summary = write(tmp_path, [50, 50, 50, 50])
    util.write_text(util.read_text() + "not a sample\n")
    with pytest.raises(SystemExit, match=r"gpu_util.csv, line 5: expected"):
        gpu_busy.read_samples(util)
    summary.write_text("{}")
    with pytest.raises(SystemExit, match="phases.tune_started_at"):
        gpu_busy.tune_loop(summary)
