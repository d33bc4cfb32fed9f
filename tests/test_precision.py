"""``precision`` (auto | fp32 | bf16): bf16 autocast where the device computes bfloat16
natively (mtbert/core/devices.py), float32 elsewhere; a run's losses in bf16 close to
float32's; bf16 asked where it is not native is one clear error."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mtbert.core.devices import native_bf16, precision_line, uses_bf16
from mtbert.data import load_data
from mtbert.loop.trainer import Trainer

REPO = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")
#: ATen limited to AVX2 kernels (its own variable): no native bf16, whatever the CPU has
NO_BF16_ENV = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2"}
#: the largest relative difference of a train loss between bf16 and float32 after 6 steps
#: of the tiny model (plain, SMART, PCGrad), measured 1.2e-4 on the 2-core AMD EPYC
#: (AVX-512 BF16, AMX); the bound leaves 8x
LOSS_RTOL = 1e-3
TECHNIQUES = {
    "plain": {},
    "smart": dict(smart_lambda_sst=1.0, smart_lambda_qqp=1.0, smart_lambda_sts=1.0,
                  smart_mu=1.0),
    "pcgrad": dict(pcgrad=True, update="summed"),
}

needs_native_bf16 = pytest.mark.skipif(not native_bf16(CPU)[0],
                                       reason="this CPU has no native bf16 (AVX-512 BF16, AMX)")


def test_fp32_never_autocasts_and_auto_follows_the_device():
    assert uses_bf16("fp32", CPU) is False
    assert uses_bf16("auto", CPU) is native_bf16(CPU)[0]
    line = precision_line("auto", CPU)
    assert line.startswith(f"precision auto: {'bf16' if native_bf16(CPU)[0] else 'fp32'} (")


@needs_native_bf16
@pytest.mark.parametrize("technique", list(TECHNIQUES))
def test_a_bf16_runs_losses_stay_close_to_float32s(technique, tiny_config, tmp_path):
    """The same 6 steps in both precisions: every train loss within LOSS_RTOL, and not
    equal (bf16 did compute)."""
    out = {}
    for precision in ("fp32", "bf16"):
        cfg = tiny_config(precision=precision, max_examples=48, lr=1e-4, dropout=0.0,
                          eval_dev=False, **TECHNIQUES[technique])
        trainer = Trainer(cfg, load_data(cfg), out_dir=tmp_path / precision)
        assert trainer.autocast is (precision == "bf16")
        out[precision] = trainer.fit()
    losses = [k for k in out["fp32"] if k.startswith("train/loss_")]
    assert len(losses) == 3
    for key in losses:
        assert out["bf16"][key] == pytest.approx(out["fp32"][key], rel=LOSS_RTOL), key
    assert any(out["bf16"][k] != out["fp32"][k] for k in losses)


def test_without_native_bf16_auto_is_float32_and_says_so():
    """A process whose ATen kernels stop at AVX2: auto runs float32 and its line says
    why; bf16 asked is a ConfigError naming the field."""
    code = ("import torch\nfrom mtbert.core.devices import precision_line, uses_bf16\n"
            "print(precision_line('auto', torch.device('cpu')))\n"
            "try:\n    uses_bf16('bf16', torch.device('cpu'))\n"
            "except Exception as exc:\n    print(type(exc).__name__, exc.key)\n")
    done = subprocess.run([sys.executable, "-c", code], env=NO_BF16_ENV, cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    auto, error = done.stdout.strip().splitlines()
    assert auto.startswith("precision auto: fp32 (CPU kernels AVX2")
    assert error == "ConfigError precision"


def test_bf16_asked_where_it_is_not_native_exits_2_with_one_error(tiny_model_dir,
                                                                    tiny_data_dir, tmp_path):
    out = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "mtbert.train", "--data-dir", tiny_data_dir, "--out", str(out),
         "--set", f"model={tiny_model_dir}", "--set", "precision=bf16",
         "--set", "max_examples=16"],
        env=NO_BF16_ENV, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    errors = [ln for ln in done.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "precision=bf16" in errors[0] and "natively" in errors[0]
    assert not out.exists() or not any(out.iterdir())


def test_the_drivers_line_says_the_precision_the_spaces_trials_run_in():
    """The driver's ``[tune] trials' precision ...`` line follows the space: its fixed
    ``precision``, each of its choices, or the base config's (auto) where it names none."""
    from types import SimpleNamespace

    from mtbert.tune.driver import trial_precision_line
    from mtbert.tune.search.spaces import parse_space

    def line(params: dict) -> str:
        space = parse_space({"description": "d", "params": {"lr": 1e-4, **params}}, "s.yaml")
        return trial_precision_line(SimpleNamespace(space=space, base={}), 0)

    auto = precision_line("auto", CPU)
    assert line({}) == auto
    fp32 = precision_line("fp32", CPU)
    assert fp32.startswith("precision fp32: fp32") and line({"precision": "fp32"}) == fp32
    both = line({"precision": {"choice": ["fp32", "auto"]}})
    assert both == f"{auto}; {fp32}"
