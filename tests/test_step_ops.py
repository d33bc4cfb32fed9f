"""The fused step's work does not grow with the number of trials: the torch ops it
dispatches (a ``TorchDispatchMode`` counter: forward, backward, clipping, the update, the
SMART teacher; host batches packed in NumPy) in one round-robin cycle (SST, QQP, STS) of a
tiny BERT (2 layers, hidden 32), batch 8, one thread.

Measured at abce43b, before the update was written over the trial axis (ops per step, SST /
QQP / STS): plain N=1 842 / 891 / 866, N=2 911 / 970 / 937, N=8 1,333 / 1,414 / 1,393,
N=16 1,895 / 2,006 / 1,987 (+~70 a trial: clipping, ``TrialAdamW`` and ``stack_batches``
looped over the trials); SMART N=1 2,223 / 2,315 / 2,285, N=2 2,296 / 2,400 / 2,360,
N=16 3,344 / 3,506 / 3,482 (+~75 a trial).  After: plain N=1 865 / 914 / 889, N=2 869 /
919 / 894, N=16 925 / 989 / 964 (+~5 a trial); SMART N=2 2,254 / 2,349 / 2,317, N=16
2,374 / 2,489 / 2,459.  The solo eager step (``Trainer``) of the same configuration:
plain 478 / 510 / 512, SMART 1,330 / 1,409 / 1,398; a group of one stacked one trial
(N=1 above: 1.8x the solo step's ops) until it took the solo run's own eager step.  With
one engine for one trial and N (``EagerStep``, its parts ``OneTrial`` or ``StackedTrials``;
the stacked sum's backward the gradient combiner's): plain N=2 861 / 911 / 886, N=16 917 /
981 / 956; SMART N=2 2,245 / 2,338 / 2,308, N=16 2,357 / 2,464 / 2,434; solo unchanged.
With the skeleton's own batching rules (``mtbert/model/trial_axis.py``: a linear layer one
``baddbmm``, embeddings and LayerNorm over the trial axis, attention and the row losses
once over every trial's rows), the update's lists made once and batches packed from their
NumPy arrays: plain N=2 591 / 622 / 623 (1.24-1.26x solo), N=16 the same; SMART N=2
1,602 / 1,676 / 1,672 (1.26-1.28x), N=16 1,658 / 1,732 / 1,728.
"""

from __future__ import annotations

import pytest

from mtbert.data import load_data
from mtbert.loop.training_group import TrainingGroup
from mtbert.step.stacked_trials import StackedTrials
from mtbert.step.step_counts import OpCounter
from mtbert.step.step_engine import EagerStep, OneTrial
from mtbert.loop.trainer import Trainer
from mtbert.run.trial_run import TrialRun

pytestmark = pytest.mark.usefixtures("one_torch_thread", "no_kept_step")

SMART = dict(smart_lambda_sst=1.0, smart_lambda_qqp=1.0, smart_lambda_sts=1.0)


def _counted(engine, calls: list[int]):
    step = engine.step

    def counted(batches):
        with OpCounter() as ops:
            out = step(batches)
        calls.append(ops.ops)
        return out
    return counted


def _cfgs(tiny_config, n: int, **overrides):
    return [tiny_config(seed=i, lr=1e-3 * (1 + i % 3), schedule="round_robin", batch_size=8,
                        eval_every=10**6, eval_at_start=False, eval_dev=False,
                        max_examples=10**5, **overrides) for i in range(n)]


def fused_ops(cfgs, data, folder) -> list[int]:
    """Ops of each fused step of one round-robin cycle, after one cycle's warm-up."""
    group = TrainingGroup()
    for i, cfg in enumerate(cfgs):
        group.add(TrialRun(cfg, data, folder / str(i)))
    group.run_steps(3)
    parts = OneTrial if len(cfgs) == 1 else StackedTrials
    assert type(group.engine) is EagerStep and type(group.engine.parts) is parts
    calls: list[int] = []
    for _ in range(3):
        engine = group.engine
        engine.step = _counted(engine, calls)
        group.step_once()
        del engine.step
    return calls


@pytest.mark.parametrize("technique", ["plain", "smart"])
def test_the_fused_step_s_ops_do_not_grow_with_the_trials(tiny_config, tmp_path, technique):
    overrides = SMART if technique == "smart" else {}
    data = load_data(_cfgs(tiny_config, 1, **overrides)[0])
    counts = {n: fused_ops(_cfgs(tiny_config, n, **overrides), data, tmp_path / str(n))
              for n in (2, 16)}
    print(f"\n[ops] {technique}: " + "; ".join(f"N={n} {c}" for n, c in counts.items()))
    for two, sixteen in zip(counts[2], counts[16]):
        assert sixteen <= 1.1 * two, counts
    assert max(counts[16]) < {"plain": 1333, "smart": 2745}[technique]  # abce43b's N=8


def solo_ops(cfg, data, folder) -> list[int]:
    """Ops of each solo eager step (``Trainer``) of one round-robin cycle, after one."""
    trainer = Trainer(cfg, data, folder)
    alone = trainer.as_group()
    alone.run_steps(3)
    assert type(trainer.engine) is EagerStep and type(trainer.engine.parts) is OneTrial
    calls: list[int] = []
    engine = trainer.engine
    engine.step = _counted(engine, calls)
    alone.run_steps(3)
    trainer.close()
    return calls


@pytest.mark.parametrize("technique", ["plain", "smart"])
def test_a_group_of_one_dispatches_the_solo_step_s_ops(tiny_config, tmp_path, technique):
    """N = 1 skips the trial axis: a group of one is stepped by the engine a solo run is
    stepped by (the ``EagerStep`` of ``OneTrial``), so its ops are the solo step's (before:
    865-914 against 478-512, plain)."""
    cfg = _cfgs(tiny_config, 1, **(SMART if technique == "smart" else {}))
    data = load_data(cfg[0])
    alone = fused_ops(cfg, data, tmp_path / "group")
    solo = solo_ops(cfg[0], data, tmp_path / "solo")
    print(f"\n[ops] {technique}: a group of one {alone}, solo {solo}")
    assert alone == solo


@pytest.mark.parametrize("technique", ["plain", "smart"])
def test_a_stacked_step_of_two_dispatches_at_most_1_3x_the_solo_step_s_ops(
        tiny_config, tmp_path, technique):
    """Two trials stacked cost close to one (before the trial-axis batching rules: 1.8x,
    plain 861 against 468 on SST)."""
    overrides = SMART if technique == "smart" else {}
    cfgs = _cfgs(tiny_config, 2, **overrides)
    data = load_data(cfgs[0])
    two = fused_ops(cfgs, data, tmp_path / "two")
    solo = solo_ops(cfgs[0], data, tmp_path / "solo")
    print(f"\n[ops] {technique}: N=2 {two}, solo {solo}")
    for stacked, alone in zip(two, solo):
        assert stacked <= 1.3 * alone, (two, solo)
