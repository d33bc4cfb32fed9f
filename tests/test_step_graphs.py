"""Captured step graphs on CUDA (``step_mode=graphs``): they train as the eager step does,
resume exactly, and a diverged run still stops with its reason.  Skipped where torch sees
no CUDA GPU (CI); run on a GPU machine with ``python -m pytest -q -m cuda tests``."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mtbert.loop import graph_reuse
from mtbert.data import load_data
from mtbert.loop.trainer import NonFiniteLossError, Trainer

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("no_kept_step"),
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="captured step graphs need a CUDA GPU; torch sees none")]

SMART = dict(smart_lambda_sst=1.0, smart_lambda_qqp=1.0, smart_lambda_sts=1.0, smart_mu=0.5)


def run_steps(cfg, data, folder, mode: str, steps: int = 20):
    torch.manual_seed(0)
    trainer = Trainer(cfg.replace(step_mode=mode), data, folder, checkpoints=False)
    plan = [g for e in range(1, cfg.epochs + 1) for g in trainer.epoch_plan(e)]
    plan = (plan * (1 + steps // len(plan)))[:steps]
    for group in plan:
        trainer.train_batches(trainer.next_batches(group))
    losses = torch.stack(trainer._pending_losses).cpu().numpy()
    trainer.check_losses()
    return trainer, losses


@pytest.mark.parametrize("extra", [{}, SMART, {"update": "summed", "schedule": "round_robin"}])
def test_graphed_steps_match_eager_within_bf16(tiny_config, tmp_path, extra):
    """20 steps with dropout on: the graphed step draws the eager step's random numbers
    (dropout masks, SMART's noise and its replayed masks), so the losses agree to bf16
    rounding; graphs were captured and replayed."""
    cfg = tiny_config(device="cuda", batch_size=8, dropout=0.1, max_length=64, **extra)
    data = load_data(cfg)
    eager, loss_e = run_steps(cfg, data, tmp_path / "eager", "eager")
    graphed, loss_g = run_steps(cfg, data, tmp_path / "graphs", "graphs")
    stats = graphed.step_graphs.stats
    assert eager.step_graphs is None and stats.captured >= 2 and stats.replayed_steps >= 5
    np.testing.assert_allclose(loss_g, loss_e, rtol=3e-2, atol=3e-3)
    w_e = torch.cat([p.detach().flatten() for p in eager.model.parameters()])
    w_g = torch.cat([p.detach().flatten() for p in graphed.model.parameters()])
    assert ((w_g - w_e).norm() / w_e.norm()).item() < 1e-3


def test_resume_after_a_graphed_run_is_exact(tiny_config, tmp_path):
    """An interrupted graphed run resumed from its checkpoint (its steps warm up eagerly
    again, then are captured anew) reports what the uninterrupted run reported."""
    cfg = tiny_config(device="cuda", epochs=2, eval_every=40, max_examples=200, dropout=0.2,
                      eval_dev=False, step_mode="graphs", **SMART)
    data = load_data(cfg)
    straight = []
    Trainer(cfg, data, tmp_path / "a", report=lambda m, d: straight.append(m["val/overall"])).fit()

    class Stop(Exception):
        pass

    interrupted = []

    def stop_after_two(metrics, checkpoint_dir):
        interrupted.append(metrics["val/overall"])
        if len(interrupted) == 2:
            raise Stop

    graph_reuse.forget()  # each run captures its own (reuse: the test below)
    with pytest.raises(Stop):
        Trainer(cfg, data, tmp_path / "b", report=stop_after_two).fit()
    resumed = []
    trainer = Trainer(cfg, data, tmp_path / "b", resume_from=tmp_path / "b" / "checkpoint",
                      report=lambda m, d: resumed.append(m["val/overall"]))
    trainer.fit()
    assert trainer.step_graphs.stats.replayed_steps > 0
    assert interrupted == straight[:2]
    np.testing.assert_allclose(resumed, straight[2:], rtol=0, atol=1e-6)


def test_a_diverged_graphed_run_stops_with_its_reason(tiny_config, tmp_path):
    cfg = tiny_config(device="cuda", schedule="sequential", loss_weighting="fixed", w_qqp=1e39,
                      eval_every=100, eval_dev=False, eval_at_start=False, step_mode="graphs")
    trainer = Trainer(cfg, load_data(cfg), tmp_path)
    with pytest.raises(NonFiniteLossError, match=r"^qqp loss became nan at 62 examples"):
        trainer.fit()
    assert trainer.history == [] and not (tmp_path / "checkpoint").exists()


def test_a_reused_worker_replays_its_graphs_for_the_next_trial(tiny_config, tmp_path):
    """What a reused Ray worker does: trial A trains from graphs and ends; trial B of the
    same structure (another seed, lr, dropout, SMART λ, ε, μ) replays A's task graphs --
    none is captured again, only B's optimizer graphs and those of shapes A had none of
    -- and trains as B built afresh (the same random numbers) to bf16 rounding."""
    a_cfg = tiny_config(device="cuda", step_mode="graphs", batch_size=8, max_length=64,
                        dropout=0.1, max_examples=240, eval_every=240, eval_dev=False,
                        eval_at_start=False, **SMART)
    data = load_data(a_cfg)
    a = Trainer(a_cfg, data, tmp_path / "a", checkpoints=False)
    a.fit()
    a_graphs = set(a.step_graphs.task_graphs)  # B may meet a shape A met too rarely
    b_cfg = a_cfg.replace(seed=3, lr=2e-3, dropout=0.3, smart_lambda_sst=0.2, smart_eps=1e-4,
                          smart_mu=1.0)
    kept = Trainer(b_cfg, data, tmp_path / "b", checkpoints=False)
    kept_final = kept.fit()
    stats = kept.step_graphs.stats
    assert kept.parts.model is a.model
    assert stats.kept == len(a_graphs) >= 3
    new_task_graphs = set(kept.step_graphs.task_graphs) - a_graphs  # shapes A had no graph of
    assert stats.task_graphs_captured == len(new_task_graphs)
    assert stats.captured > stats.task_graphs_captured  # its own optimizer graphs
    graph_reuse.forget()
    fresh = Trainer(b_cfg, data, tmp_path / "fresh", checkpoints=False)
    fresh_final = fresh.fit()
    assert fresh.step_graphs.stats.kept == 0
    for key in ("train/loss_sst", "train/loss_qqp", "train/loss_sts"):
        assert kept_final[key] == pytest.approx(fresh_final[key], rel=3e-2, abs=3e-3), key
    w_k = torch.cat([p.detach().flatten() for p in kept.parts.model.parameters()])
    w_f = torch.cat([p.detach().flatten() for p in fresh.model.parameters()])
    assert ((w_k - w_f).norm() / w_f.norm()).item() < 1e-3
