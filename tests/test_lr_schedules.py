"""LR schedules: the schedule's values at given steps, warm-up in examples, a
trial continued past a rung (or paused and resumed there) keeps its LR without a jump,
and a restored trial takes its own config's lr (population-based training)."""

from __future__ import annotations

import pytest
import torch

from mtbert.data import load_data
from mtbert.techniques.lr_schedules import build_lr_scheduler, warmup_steps
from mtbert.loop.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def lrs_over(cfg, total_steps: int, examples_per_step: float) -> list[float]:
    """The LR each of ``total_steps`` optimizer steps uses, from the schedule alone."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.lr)
    scheduler = build_lr_scheduler(optimizer, cfg, total_steps, examples_per_step)
    out = []
    for _ in range(total_steps):
        out.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return out


def test_wsd_warms_up_in_examples_holds_then_decays_over_the_last_share(tiny_config):
    cfg = tiny_config(lr=1e-3, lr_schedule="wsd", warmup_examples=64, decay_ratio=0.2)
    lrs = lrs_over(cfg, 20, examples_per_step=16)  # 64 examples = 4 steps of 16
    assert lrs[:5] == pytest.approx([0.0, 2.5e-4, 5e-4, 7.5e-4, 1e-3])
    assert lrs[4:16] == pytest.approx([1e-3] * 12)  # stable: steps 4..15
    assert lrs[16:] == pytest.approx([1e-3, 7.5e-4, 5e-4, 2.5e-4])  # last 20 %: 4 steps
    # the warm-up is a number of examples, whatever the run's length or batch size
    assert warmup_steps(cfg, 20, 16) == warmup_steps(cfg, 2000, 16) == 4
    assert warmup_steps(cfg, 2000, 32) == 2 and warmup_steps(cfg, 2000, 48) == 2  # rounded up
    assert warmup_steps(tiny_config(warmup_ratio=0.1), 2000, 32) == 200  # the share, as before


def test_linear_and_constant_schedules(tiny_config):
    linear = lrs_over(tiny_config(lr=1e-3, warmup_ratio=0.2), 10, 8)
    assert linear == pytest.approx([0.0, 5e-4, 1e-3, 8.75e-4, 7.5e-4, 6.25e-4, 5e-4, 3.75e-4,
                                    2.5e-4, 1.25e-4])
    constant = lrs_over(tiny_config(lr=1e-3, lr_schedule="constant", warmup_examples=16), 10, 8)
    assert constant == pytest.approx([0.0, 5e-4] + [1e-3] * 8)


class Paused(Exception):
    """What a scheduler's pause does to a trial: it ends at a report."""


def reported_lrs(cfg, out_dir, resume_from=None, pause_at: int = 0) -> dict[int, float]:
    """examples seen -> the LR after that many examples, from the trainer's reports; the
    run ends at the report at ``pause_at`` examples (its checkpoint written)."""
    seen: dict[int, float] = {}

    def report(metrics, checkpoint_dir):
        seen[metrics["examples_seen"]] = metrics["lr"]
        if metrics["examples_seen"] == pause_at:
            raise Paused
    trainer = Trainer(cfg, load_data(cfg), out_dir, resume_from=resume_from, report=report)
    try:
        trainer.fit()
    except Paused:
        pass
    return seen


def test_a_trial_continued_or_resumed_past_a_rung_keeps_its_lr(tiny_config, tmp_path):
    """One trial's budget is 160 examples (20 steps of 8), the rungs at 48 and 96: under
    wsd the LR at both rungs is the full lr, and the steps after a rung continue it. A
    trial paused at the 96-example rung and resumed from that checkpoint (what HyperBand/
    BOHB do) follows the same LRs as one that ran through."""
    cfg = tiny_config(lr=1e-3, lr_schedule="wsd", warmup_examples=16, decay_ratio=0.25,
                      max_examples=160, epochs=20, eval_every=8, eval_dev=False,
                      eval_at_start=False, schedule="sequential", max_train_per_task=48)
    through = reported_lrs(cfg, tmp_path / "through")
    assert sorted(through) == list(range(8, 168, 8))
    assert through[8] == pytest.approx(5e-4)  # warm-up: 2 steps
    assert [through[e] for e in range(16, 128, 8)] == pytest.approx([1e-3] * 14)
    assert [through[e] for e in (128, 136, 144, 152, 160)] == pytest.approx(
        [8e-4, 6e-4, 4e-4, 2e-4, 0.0])  # decay over the last 5 steps
    paused = reported_lrs(cfg, tmp_path / "paused", pause_at=96)
    assert paused == {e: lr for e, lr in through.items() if e <= 96}  # same LR to the rung
    resumed = reported_lrs(cfg, tmp_path / "resumed", resume_from=tmp_path / "paused" / "checkpoint")
    assert resumed == pytest.approx({e: lr for e, lr in through.items() if e > 96})


def test_a_restored_trial_takes_its_configs_lr(tiny_config, tmp_path):
    """Population-based training restores a trial from another trial's checkpoint with a
    mutated lr: the schedule continues at its step, scaled by the new lr."""
    cfg = tiny_config(lr=1e-3, lr_schedule="wsd", warmup_examples=8, decay_ratio=0.25,
                      max_examples=160, epochs=20, eval_every=48, eval_dev=False,
                      eval_at_start=False, schedule="sequential", max_train_per_task=48,
                      head_lr_multiplier=10.0)
    reported_lrs(cfg, tmp_path / "a", pause_at=48)
    mutated = cfg.replace(lr=3e-4)
    trainer = Trainer(mutated, load_data(mutated), tmp_path / "b",
                      resume_from=tmp_path / "a" / "checkpoint")
    assert trainer.examples_seen == 48
    lrs = {g["name"]: g["lr"] for g in trainer.optimizer.param_groups}
    assert trainer.lr_scheduler.get_last_lr()[0] == pytest.approx(3e-4) == lrs["encoder"]
    assert lrs["heads"] == pytest.approx(3e-3)  # the head multiplier applies to the new lr
    history = reported_lrs(mutated, tmp_path / "c", resume_from=tmp_path / "a" / "checkpoint")
    assert history[96] == pytest.approx(3e-4) and history[160] == pytest.approx(0.0)


@pytest.mark.parametrize("name", ["small", "medium", "full"])
def test_every_budget_judges_its_rungs_at_the_full_lr(tiny_config, name):
    """Under each budget's trial fields the warm-up ends before the first rung and no
    rung before the last is inside the decay: every trial is judged at the same LR."""
    from mtbert.tune.search.budgets import get_budget
    budget = get_budget(name).resolved(28_091)  # all the training rows (full)
    cfg = tiny_config(lr=1e-3, batch_size=32, **budget.trial_fields())
    assert cfg.lr_schedule == "wsd" and 0 < cfg.warmup_examples < budget.grace_period
    total_steps = budget.max_examples // 32
    lrs = lrs_over(cfg, total_steps, 32)
    rungs = budget.rungs()
    assert len(rungs) >= 2
    for rung in rungs[:-1] if rungs[-1] >= budget.max_examples else rungs:
        assert lrs[rung // 32] == pytest.approx(1e-3), rung
    assert lrs[-1] < 1e-3 * cfg.decay_ratio  # the trials that reach the budget decay
