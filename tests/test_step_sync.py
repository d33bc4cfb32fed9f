"""What a CUDA graph needs of a step, checked where no GPU is: once a step's caches are
built, neither the solo eager step nor the fused step reads a value back to the host (an
``.item()``, ``bool(tensor)``, ``torch.equal`` or ``nonzero``: on a GPU each waits for the
device and cannot be captured).  Counted with a ``TorchDispatchMode`` over the steady
steps of a tiny BERT, plain, SMART and PCGrad with uncertainty weighting.

What the stacked step takes from the host each step -- each task's stacked batch, the
learning rates its trials' LR schedules wrote (one ``[G, N]`` copy), PCGrad's task orders,
SMART's noise -- it takes in its first part (``StackedTrials.begin``), as a captured step
takes its inputs: after it, the step builds no tensor from host values (no
``lift_fresh``, what ``torch.tensor(host values)`` dispatches)."""

from __future__ import annotations

import collections

import pytest
from torch.utils._python_dispatch import TorchDispatchMode

from mtbert.data import load_data
from mtbert.run.trial_run import TrialRun
from mtbert.loop.training_group import TrainingGroup
from mtbert.loop.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_torch_thread", "no_kept_step")

#: aten ops that copy a device value to the host (a synchronisation on a GPU)
READ_BACK = {"_local_scalar_dense", "item", "is_nonzero", "equal", "nonzero", "nonzero_static"}

TECHNIQUES = {
    "plain": {},
    "smart": dict(smart_lambda_sst=1.0, smart_lambda_qqp=0.5, smart_lambda_sts=1.0,
                  smart_mu=1.0),
    "pcgrad-uncertainty": dict(pcgrad=True, update="summed", loss_weighting="uncertainty"),
}


class OpNames(TorchDispatchMode):
    """The aten ops dispatched while it is entered and ``counting``."""

    def __init__(self):
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()
        self.counting = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.counting:
            self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _cfgs(tiny_config, n, **overrides):
    return [tiny_config(seed=i, lr=1e-3 * (1 + i), schedule="round_robin", batch_size=8,
                        eval_every=10**6, eval_at_start=False, eval_dev=False,
                        max_examples=10**5, **overrides) for i in range(n)]


def _watched(engine, names: OpNames):
    step = engine.step

    def watched(batches):
        with names:
            return step(batches)
    engine.step = watched


def _steady_group(tiny_config, tmp_path, technique):
    """(configs, data, a fused group of two trials of ``technique``) after three steps:
    its engine built, its caches filled."""
    cfgs = _cfgs(tiny_config, 2, **TECHNIQUES[technique])
    data = load_data(cfgs[0])
    group = TrainingGroup()
    for i, cfg in enumerate(cfgs):
        group.add(TrialRun(cfg, data, tmp_path / str(i)))
    group.run_steps(3)
    return cfgs, data, group


@pytest.mark.parametrize("technique", list(TECHNIQUES))
def test_steady_steps_read_nothing_back_to_the_host(tiny_config, tmp_path, technique):
    cfgs, data, group = _steady_group(tiny_config, tmp_path, technique)
    fused = OpNames()
    _watched(group.engine, fused)
    group.run_steps(3)
    trainer = Trainer(cfgs[0], data, tmp_path / "solo")
    alone = trainer.as_group()
    alone.run_steps(3)
    solo = OpNames()
    _watched(trainer.engine, solo)
    alone.run_steps(3)
    assert sum(fused.counts.values()) > 1000 and sum(solo.counts.values()) > 500
    assert not READ_BACK & fused.counts.keys(), {k: fused.counts[k] for k in READ_BACK}
    assert not READ_BACK & solo.counts.keys(), {k: solo.counts[k] for k in READ_BACK}


@pytest.mark.parametrize("technique", list(TECHNIQUES))
def test_after_its_inputs_the_stacked_step_builds_no_tensor_from_host_values(
        tiny_config, tmp_path, technique):
    _, _, group = _steady_group(tiny_config, tmp_path, technique)
    names = OpNames()
    parts = group.engine.parts
    begin = parts.begin

    def begin_uncounted(batches):
        names.counting = False
        try:
            return begin(batches)
        finally:
            names.counting = True
    parts.begin = begin_uncounted
    _watched(group.engine, names)
    group.run_steps(3)
    assert sum(names.counts.values()) > 1000
    assert names.counts["lift_fresh"] == 0, names.counts
