"""Fused trials (mtbert/step/fused_model.py, mtbert/loop/training_group.py,
mtbert/techniques/trial_adamw.py): N trials of one structure trained as one stacked model
train as their solo runs do."""

from __future__ import annotations

import json
import math

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from conftest import make_tiny_model

from mtbert.core.trial_streams import MaskStream
from mtbert.data import TaskBatcher, collate, encoding_for, load_data
from mtbert.model.fused_attention import BATCHED_ATTENTION
from mtbert.techniques.trial_adamw import TrialAdamW
from mtbert.step.fused_model import FusedModel, stack_batches
from mtbert.loop.trainer import train_fused
from mtbert.loop.training_group import TrainingGroup, fuse_key, plan_groups
from mtbert.run.inference import load_checkpoint_model, predict_split
from mtbert.techniques.losses import task_loss
from mtbert.model.model import FOUR_D_MASK, MultitaskModel
from mtbert.loop.trainer import NonFiniteLossError, Trainer
from mtbert.run.trial_run import TrialRun

pytestmark = pytest.mark.usefixtures("one_torch_thread", "no_kept_step")


@pytest.fixture(scope="module")
def quiet_model_dir(tmp_path_factory) -> str:
    """A tinier random BERT (hidden 16, one layer: the float64 runs below take 63 steps)
    without its attention-probability dropout (which the ``dropout`` setting does not
    govern), so that dropout 0 draws no random numbers at all."""
    folder = make_tiny_model(tmp_path_factory.mktemp("quiet-bert"), hidden=16, layers=1)
    config = json.loads((folder / "config.json").read_text())
    config["attention_probs_dropout_prob"] = 0.0
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


@pytest.fixture(scope="module")
def quiet_config(tiny_config, quiet_model_dir):
    def make(**overrides):
        return tiny_config(**{"model": quiet_model_dir, "dropout": 0.0, "eval_dev": False,
                              **overrides})
    return make


def _model(cfg, dtype):
    torch.manual_seed(cfg.seed)
    return MultitaskModel.from_config(cfg).to(dtype)


def _recording(trainer) -> list[tuple[str, float]]:
    """Every step's (task, loss) of ``trainer``, in order, as it notes them."""
    seen, note = [], trainer._note_losses

    def record(losses):
        seen.extend((task, float(loss.detach())) for task, loss in losses.items())
        note(losses)
    trainer._note_losses = record
    return seen


def _solo_runs(cfgs, data, folder, dtype) -> list[tuple[list, dict]]:
    """Each configuration trained alone: (its recorded step losses, its final metrics)."""
    solo = []
    for i, cfg in enumerate(cfgs):
        trainer = Trainer(cfg, data, folder / f"solo-{i}", model=_model(cfg, dtype))
        seen = _recording(trainer)
        solo.append((seen, trainer.fit()))
    return solo


def _solo_and_fused(cfgs, tmp_path, dtype):
    data = load_data(cfgs[0])
    solo = _solo_runs(cfgs, data, tmp_path, dtype)
    group = TrainingGroup(cfgs, data, [tmp_path / f"fused-{i}" for i in range(len(cfgs))],
                       models=[_model(cfg, dtype) for cfg in cfgs])
    seens = [_recording(t) for t in group.trials.values()]
    return solo, list(zip(seens, group.fit()))


def _largest_differences(solo, fused) -> tuple[float, float]:
    """(the largest step-loss difference, the largest val-metric difference) of trials
    that stepped the same tasks in the same order."""
    loss_diff = metric_diff = 0.0
    for (solo_seen, solo_final), (seen, final) in zip(solo, fused):
        assert [t for t, _ in seen] == [t for t, _ in solo_seen]
        loss_diff = max(loss_diff, max(abs(a - b) for (_, a), (_, b) in zip(solo_seen, seen)))
        keys = [k for k, v in solo_final.items() if k.startswith("val/")
                and isinstance(v, float)]
        assert keys
        metric_diff = max(metric_diff, max(abs(solo_final[k] - final[k]) for k in keys))
    return loss_diff, metric_diff


def test_fused_trials_train_as_their_solo_runs_in_float64(quiet_config, tmp_path):
    """Three trials, each its own seed, learning rate, weight decay, clipping and fixed loss
    weights, 63 steps of round-robin per-task updates: every step's loss and the final val
    metrics are the solo runs' (measured: 1.8e-15 and 0; different schedules below:
    8.9e-16 and 0)."""
    common = dict(epochs=3, warmup_ratio=0.1, schedule="round_robin", eval_every=10**6,
                  eval_at_start=False, loss_weighting="fixed")  # one evaluation, at the end
    cfgs = [quiet_config(seed=0, lr=1e-3, weight_decay=0.0, **common),
            quiet_config(seed=1, lr=2e-3, weight_decay=0.01, w_sst=0.5, w_sts=2.0, **common),
            quiet_config(seed=2, lr=5e-4, weight_decay=0.1, max_grad_norm=0.5, w_qqp=3.0,
                         **common)]
    solo, fused = _solo_and_fused(cfgs, tmp_path, torch.float64)
    assert all(len(seen) >= 50 for seen, _ in solo)
    losses, metrics = _largest_differences(solo, fused)
    print(f"\n[equivalence] {losses:.2g} {metrics:.2g}")
    assert losses <= 1e-8 and metrics <= 1e-8
    # the trials did train apart: their losses differ from each other's
    assert abs(solo[0][0][-1][1] - solo[1][0][-1][1]) > 1e-3


def test_fused_trials_in_float32_drift_within_1e_4(quiet_config, tmp_path):
    """In float32 the fused step's batched kernels round differently from the solo ones:
    measured over 42 steps, losses within 9.5e-7 and val metrics within 8.5e-7."""
    common = dict(epochs=2, schedule="round_robin", eval_every=10**6, eval_at_start=False)
    cfgs = [quiet_config(seed=0, lr=1e-3, **common),
            quiet_config(seed=1, lr=3e-3, weight_decay=0.05, **common)]
    solo, fused = _solo_and_fused(cfgs, tmp_path, torch.float32)
    losses, metrics = _largest_differences(solo, fused)
    print(f"\n[equivalence] {losses:.2g} {metrics:.2g}")
    assert losses <= 1e-4 and metrics <= 1e-4


def test_trials_of_different_task_schedules_train_as_their_solo_runs(quiet_config, tmp_path):
    """``proportional`` draws each step's task from the trial's seed: the trials train
    different tasks in the same fused step (the others' heads and moments must not move)
    and each still trains as its solo run; the second ends at half the budget and the
    first trains on alone."""
    # one length bucket: with buckets, a trial drawing a task in a step takes the bucket
    # of the first trial drawing it, so different schedules draw other rows than alone
    # (test_trials_drawing_a_task_together_take_one_length_bucket)
    common = dict(schedule="proportional", eval_every=10**6, eval_at_start=False,
                  length_bucketing=False)
    cfgs = [quiet_config(seed=3, lr=2e-3, weight_decay=0.01, **common),
            quiet_config(seed=4, lr=1e-3, weight_decay=0.01, max_examples=80, **common)]
    solo, fused = _solo_and_fused(cfgs, tmp_path, torch.float64)
    tasks = [[t for t, _ in seen] for seen, _ in solo]
    assert any(a != b for a, b in zip(*tasks))  # the schedules do differ step by step
    assert len(tasks[1]) < len(tasks[0])
    losses, metrics = _largest_differences(solo, fused)
    print(f"\n[equivalence] {losses:.2g} {metrics:.2g}")
    assert losses <= 1e-8 and metrics <= 1e-8


def test_fixed_weights_with_l1_l2_siamese_cosine_head_and_wsd_train_as_solo_in_float64(
        quiet_config, tmp_path):
    """The loss weighting and penalty written once (:mod:`mtbert.techniques.losses`, one trial or
    ``[N]``), over other choices than the tests above: siamese pairs, the cosine STS head
    with the cosine MSE loss, the L1 and L2 penalties, the ``wsd`` LR schedule, each trial
    its own fixed weights: every step's loss and the final val metrics are the solo runs'
    (measured: 5.2e-14 and 0)."""
    common = dict(epochs=2, schedule="round_robin", eval_every=10**6, eval_at_start=False,
                  loss_weighting="fixed", l1_lambda=1e-4, l2_lambda=1e-3,
                  pair_encoding="siamese", sts_head="cosine", sts_loss="cosine_mse",
                  lr_schedule="wsd", warmup_ratio=0.1)
    cfgs = [quiet_config(seed=5, lr=2e-3, w_sts=3.0, **common),
            quiet_config(seed=6, lr=1e-3, w_sst=0.25, weight_decay=0.01, **common)]
    solo, fused = _solo_and_fused(cfgs, tmp_path, torch.float64)
    losses, metrics = _largest_differences(solo, fused)
    print(f"\n[equivalence] fixed+l1/l2 siamese cosine wsd: {losses:.2g} {metrics:.2g}")
    assert losses <= 1e-8 and metrics <= 1e-8


#: three SMART trials: every term on, each its own λ_t, ε, μ, β, noise and step size
SMART_TRIALS = [dict(seed=0, lr=1e-3, smart_lambda_sst=1.0, smart_lambda_qqp=0.5,
                     smart_lambda_sts=2.0, smart_eps=1e-3, smart_mu=0.5),
                dict(seed=1, lr=2e-3, smart_lambda_sst=3.0, smart_lambda_qqp=0.2,
                     smart_lambda_sts=0.5, smart_eps=3e-3, smart_mu=2.0, smart_beta=0.9,
                     smart_noise=4e-6, smart_step_size=2e-3),
                dict(seed=2, lr=5e-4, smart_lambda_sst=0.3, smart_lambda_qqp=4.0,
                     smart_lambda_sts=1.0, smart_eps=2e-4, smart_mu=0.1, smart_beta=0.5,
                     smart_noise=1e-4, weight_decay=0.01)]


def test_fused_smart_trials_train_as_their_solo_runs_in_float64(quiet_config, tmp_path):
    """SMART fused: three trials with their own λ_t, ε, μ, β, noise and step size (each
    draws its noise from its own stream), 63 per-task steps of two-step ascents and the
    Bregman teacher: every step's loss and the final val metrics are the solo runs'
    (measured: 4.4e-15 and 0, in float32 1.9e-6 and 3.6e-6; with the noise from the
    process's stream instead: 0.045)."""
    common = dict(epochs=3, schedule="round_robin", eval_every=10**6, eval_at_start=False,
                  smart_steps=2, pair_encoding="siamese")
    cfgs = [quiet_config(**trial, **common) for trial in SMART_TRIALS]
    solo, fused = _solo_and_fused(cfgs, tmp_path, torch.float64)
    assert all(len(seen) >= 50 for seen, _ in solo)
    losses, metrics = _largest_differences(solo, fused)
    print(f"\n[equivalence] {losses:.2g} {metrics:.2g}")
    assert losses <= 1e-8 and metrics <= 1e-8
    assert abs(solo[0][0][-1][1] - solo[1][0][-1][1]) > 1e-3


def test_fused_uncertainty_weighting_trains_as_the_solo_runs_in_float64(quiet_config,
                                                                        tmp_path):
    """Uncertainty weighting fused: each trial's learned log variances s_t stacked, trained
    in its own optimizer group at its own lr; summed updates (every step all three tasks'
    exp(−s_t)·L_t + s_t): every task loss and the final val metrics are the solo runs', and
    so are the learned s_t, to the rounding of float32 (the s_t are float32 in both runs, as
    the solo combiner makes them; the fused update's float32 arithmetic is torch AdamW's in
    another op order: measured 9.1e-9 on the losses, 7.5e-9 on the metrics)."""
    common = dict(epochs=3, schedule="round_robin", update="summed", eval_every=10**6,
                  eval_at_start=False, loss_weighting="uncertainty")
    cfgs = [quiet_config(seed=0, lr=1e-2, **common),
            quiet_config(seed=1, lr=3e-2, weight_decay=0.01, **common),
            quiet_config(seed=2, lr=5e-3, max_grad_norm=0.5, **common)]
    data = load_data(cfgs[0])
    solo = [Trainer(cfg, data, tmp_path / f"solo-{i}", model=_model(cfg, torch.float64))
            for i, cfg in enumerate(cfgs)]
    solo_runs = [(_recording(t), t) for t in solo]
    solo_runs = [(seen, t.fit()) for seen, t in solo_runs]
    group = TrainingGroup(cfgs, data, [tmp_path / f"fused-{i}" for i in range(3)],
                       models=[_model(cfg, torch.float64) for cfg in cfgs])
    trials = list(group.trials.values())
    seens = [_recording(t) for t in trials]
    fused = list(zip(seens, group.fit()))
    assert all(len(seen) >= 50 for seen, _ in solo_runs)
    losses, metrics = _largest_differences(solo_runs, fused)
    print(f"\n[equivalence] {losses:.2g} {metrics:.2g}")
    assert losses <= 1e-7 and metrics <= 1e-7
    for alone, together in zip(solo, trials):
        for task in ("sst", "qqp", "sts"):
            learned = float(alone.loss_combiner.s[task])
            assert learned != 0.0
            assert abs(learned - float(together.loss_combiner.s[task])) <= 1e-7


def test_fused_pcgrad_trials_train_as_their_solo_runs_in_float64(quiet_config, tmp_path):
    """PCGrad fused: one backward per task of the trials' summed loss, the projection
    batched over the trials, each trial's random task orders from its own stream; with an
    L2 penalty (added unprojected) and summed updates: every task loss and the final val
    metrics are the solo runs' (measured: 1.8e-15 and 0)."""
    common = dict(epochs=3, schedule="round_robin", update="summed", pcgrad=True,
                  l2_lambda=1e-3, eval_every=10**6, eval_at_start=False)
    cfgs = [quiet_config(seed=0, lr=1e-3, **common),
            quiet_config(seed=1, lr=3e-3, weight_decay=0.01, **common),
            quiet_config(seed=2, lr=2e-3, max_grad_norm=0.5, **common)]
    solo, fused = _solo_and_fused(cfgs, tmp_path, torch.float64)
    assert all(len(seen) >= 50 for seen, _ in solo)
    losses, metrics = _largest_differences(solo, fused)
    print(f"\n[equivalence] {losses:.2g} {metrics:.2g}")
    assert losses <= 1e-8 and metrics <= 1e-8


def test_fused_pcgrad_with_siamese_pairs_and_l1_trains_as_its_solo_runs_in_float64(
        quiet_config, tmp_path):
    """PCGrad written once (:func:`mtbert.techniques.gradients.pcgrad_backward`, one trial or a trial
    axis) with siamese pairs (the pair tasks' shared encoder run twice a row) and an L1
    penalty, summed updates: every step's loss and the final val metrics are the solo
    runs' (measured: 1.8e-15 and 0)."""
    common = dict(epochs=2, schedule="round_robin", update="summed", pcgrad=True,
                  l1_lambda=1e-4, pair_encoding="siamese", eval_every=10**6,
                  eval_at_start=False)
    cfgs = [quiet_config(seed=7, lr=2e-3, **common),
            quiet_config(seed=8, lr=1e-3, weight_decay=0.01, **common)]
    solo, fused = _solo_and_fused(cfgs, tmp_path, torch.float64)
    losses, metrics = _largest_differences(solo, fused)
    print(f"\n[equivalence] pcgrad siamese l1: {losses:.2g} {metrics:.2g}")
    assert losses <= 1e-8 and metrics <= 1e-8


def test_smart_trials_of_other_settings_and_pcgrad_orders_train_as_their_solo_runs_in_float64(
        quiet_config, tmp_path):
    """One group, three trials of other SMART settings (λ_t, ε, μ, β, noise, step size) and
    seeds, so other PCGrad task orders too (each drawn from its own stream), summed steps:
    every step's loss and the final val metrics are the solo runs' (float64, within 1e-8)."""
    common = dict(epochs=1, schedule="round_robin", update="summed", pcgrad=True,
                  eval_every=10**6, eval_at_start=False, pair_encoding="siamese")
    cfgs = [quiet_config(**trial, **common) for trial in SMART_TRIALS]
    solo, fused = _solo_and_fused(cfgs, tmp_path, torch.float64)
    losses, metrics = _largest_differences(solo, fused)
    print(f"\n[equivalence] smart + pcgrad: {losses:.2g} {metrics:.2g}")
    assert losses <= 1e-8 and metrics <= 1e-8


def test_smart_pcgrad_and_uncertainty_fused_in_float32_drift_within_1e_4(quiet_config,
                                                                         tmp_path):
    """All three together in float32, each trial its own SMART values, uncertainty weights
    and PCGrad orders, two epochs of summed steps: losses within 1.9e-6 and val metrics
    within 6.3e-6 of the solo runs (measured at ff90629 and after SMART and PCGrad were
    written once over the trial axis alike; float64: 3.6e-15 and 0, also with
    ``proportional`` schedules, whose trials train different tasks in a step)."""
    common = dict(epochs=2, schedule="round_robin", update="summed", pcgrad=True,
                  loss_weighting="uncertainty", eval_every=10**6, eval_at_start=False,
                  pair_encoding="siamese")
    cfgs = [quiet_config(**trial, **common) for trial in SMART_TRIALS]
    solo, fused = _solo_and_fused(cfgs, tmp_path, torch.float32)
    losses, metrics = _largest_differences(solo, fused)
    print(f"\n[equivalence] {losses:.2g} {metrics:.2g}")
    assert losses <= 1e-4 and metrics <= 1e-4


def test_trial_adamw_is_torch_adamw_on_each_slice():
    """Each trial's slice steps as ``torch.optim.AdamW(fused=True)`` on that trial's
    parameter alone, clipped as ``clip_grad_norm_`` clips it (float64: within 1e-14 over 12
    steps); a masked-out slice keeps its weights, moments and step bit for bit."""
    torch.manual_seed(0)
    lrs, decays, clips = [1e-3, 2e-3, 5e-4], [0.0, 0.01, 0.1], [0.0, 1.0, 0.05]
    solo = [torch.randn(5, 4, dtype=torch.float64, requires_grad=True) for _ in lrs]
    stacked = torch.stack([p.detach() for p in solo]).requires_grad_()
    optimizers = [torch.optim.AdamW([p], lr=lr, weight_decay=wd, fused=True)
                  for p, lr, wd in zip(solo, lrs, decays)]
    fused = TrialAdamW({"w": stacked}, {"w": 0}, [decays])
    scale = torch.logspace(-12, 0, 20, dtype=torch.float64).view(5, 4)
    rates = torch.tensor([lrs], dtype=torch.float64)
    for step in range(12):
        grads = torch.randn(3, 5, 4, dtype=torch.float64) * scale
        mask = [True, step % 3 != 0, step % 2 == 0]
        before = stacked.detach().clone()
        moments = fused.state["w"]["exp_avg"].clone()
        for n, on in enumerate(mask):
            if on:
                solo[n].grad = grads[n].clone()
                if clips[n]:
                    torch.nn.utils.clip_grad_norm_([solo[n]], clips[n])
                optimizers[n].step()
        stacked.grad = grads.clone()
        on = {"w": torch.tensor([float(m) for m in mask], dtype=torch.float64)}
        fused.clip_(torch.tensor(clips, dtype=torch.float64), on)
        fused.step(rates, on)
        for n, on in enumerate(mask):
            assert torch.allclose(stacked[n], solo[n], rtol=1e-14, atol=0), n
            if not on:
                assert torch.equal(stacked[n], before[n])
                assert torch.equal(fused.state["w"]["exp_avg"][n], moments[n])
    state = fused.state["w"]
    for n in range(3):
        assert torch.allclose(state["exp_avg"][n], optimizers[n].state[solo[n]]["exp_avg"],
                              rtol=1e-14, atol=0)
        assert float(state["step"][n]) == float(optimizers[n].state[solo[n]]["step"])
    assert [float(s) for s in state["step"]] == [12.0, 8.0, 6.0]


def test_dropout_masks_are_each_trials_own(quiet_config):
    """Each trial's masks come from its own seed: two trials with the same weights, batch,
    rate and seed get the same loss, another seed another loss; a trial at rate 0 gets its
    solo model's loss while the other's drops."""
    cfg = quiet_config(dropout=0.3)
    data = load_data(cfg)
    batch = collate(data.split("sst", "train"), np.arange(8), "single", data.pad_id)
    model = _model(cfg, torch.float64)
    model.eval()  # no dropout: the loss at rate 0
    solo_loss = float(task_loss("sst", model("sst", batch), batch["labels"], cfg))
    stacked = stack_batches([batch, batch], data.pad_id)

    def losses(rates, seeds):
        masks = MaskStream(2, torch.device("cpu"))
        masks.draw({n: torch.Generator().manual_seed(s) for n, s in enumerate(seeds)})
        masks.start("sst")
        return FusedModel([model, model], rates, 0.3, masks).task_losses("sst", stacked, cfg)

    same = losses([0.3, 0.3], [5, 5])
    assert float(same[0]) == float(same[1]) and abs(float(same[0]) - solo_loss) > 1e-6
    other = losses([0.3, 0.3], [5, 6])
    assert abs(float(other[0] - other[1])) > 1e-6
    mixed = losses([0.0, 0.3], [5, 6])
    assert abs(float(mixed[0]) - solo_loss) <= 1e-12
    assert abs(float(mixed[1]) - solo_loss) > 1e-6


def test_fused_run_folders_are_a_solo_runs(quiet_config, tmp_path):
    """Each fused trial's folder holds a solo run's files; its checkpoint loads with the
    solo code and predicts its recorded val predictions, and resumes into a Trainer."""
    cfgs = [quiet_config(seed=s, max_examples=48, eval_dev=True) for s in (0, 1)]
    data = load_data(cfgs[0])
    outs = [tmp_path / f"seed-{s}" for s in (0, 1)]
    results = train_fused(cfgs, data, outs, log=lambda _: None)
    for out, result in zip(outs, results):
        metrics = json.loads((out / "metrics.json").read_text())
        assert metrics["val/overall"] == result["val/overall"]
        assert len((out / "history.jsonl").read_text().splitlines()) == 2
        assert (out / "predictions" / "sst-test-output.csv").is_file()
        cfg, model = load_checkpoint_model(out / "checkpoint")
        recorded = pq.read_table(out / "predictions" / "val-sts.parquet").column(
            "prediction").to_numpy()
        split = data.split("sts", "val")
        again = predict_split(model, split, "cross", data.pad_id, 32, torch.device("cpu"))
        np.testing.assert_allclose(again, recorded, rtol=0, atol=1e-6)
    resumed = Trainer(cfgs[1], data, outs[1], resume_from=outs[1] / "checkpoint")
    assert resumed.optimizer_steps == results[1]["optimizer_steps"] > 0
    steps = {float(s["step"]) for s in resumed.optimizer.state.values()}
    assert max(steps) == resumed.optimizer_steps  # the encoder stepped every step


def test_unfusable_configurations_train_alone_with_their_reason(quiet_config, tmp_path,
                                                                 monkeypatch):
    """Groups: one structure's configurations together; another batch size, PCGrad, SMART
    on and uncertainty weighting each a group of its own (they fuse); a non-BERT encoder
    alone with a one-line reason, and an unfusable group trains its trials alone."""
    other = tmp_path / "distil"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "distilbert", "dim": 32}))
    cfgs = [quiet_config(seed=0), quiet_config(seed=1, lr=3e-3), quiet_config(batch_size=4),
            quiet_config(pcgrad=True, update="summed"), quiet_config(smart_lambda_sst=1.0),
            quiet_config(model=str(other)), quiet_config(seed=2, dropout=0.2),
            quiet_config(loss_weighting="uncertainty"),
            quiet_config(seed=1, lr=3e-3, loss_weighting="uncertainty")]
    groups = plan_groups(cfgs)
    assert [members for members, _ in groups] == [[0, 1, 6], [2], [3], [4], [5], [7, 8]]
    reasons = [reason for _, reason in groups]
    assert reasons[:4] + reasons[5:] == [None] * 5
    assert "distilbert" in reasons[4] and "\n" not in reasons[4]
    monkeypatch.setattr("mtbert.loop.training_group.FUSABLE_MODEL_TYPES", ("roberta",))
    logged = []
    results = train_fused([quiet_config(seed=0, max_examples=16),
                           quiet_config(seed=1, max_examples=16)],
                          load_data(cfgs[0]), [tmp_path / "a", tmp_path / "b"],
                          log=logged.append)
    assert all("val/overall" in r for r in results)
    assert sum("trains alone: model_type 'bert'" in line for line in logged) == 2


def test_cli_fuse_seeds_writes_one_folder_per_seed(quiet_model_dir, tiny_data_dir, tmp_path):
    from mtbert.train import main

    out = tmp_path / "out"
    code = main(["--data-dir", tiny_data_dir, "--out", str(out), "--fuse-seeds", "0,1",
                 "--set", f"model={quiet_model_dir}", "--set", "max_examples=16",
                 "--set", "batch_size=8", "--set", "max_length=32", "--set", "eval_dev=false",
                 "--set", "threads=1", "--set", "progress=false"])
    assert code == 0
    for seed in (0, 1):
        folder = out / f"seed-{seed}"
        assert f"seed: {seed}" in (folder / "config.yaml").read_text()
        assert "val/overall" in json.loads((folder / "metrics.json").read_text())
    assert (json.loads((out / "seed-0" / "metrics.json").read_text())["val/overall"]
            != json.loads((out / "seed-1" / "metrics.json").read_text())["val/overall"])


@pytest.mark.cuda
def test_fused_trials_on_cuda_follow_their_solo_runs(quiet_config, tmp_path):
    """On a GPU (bf16 autocast, fixed batch shapes, the fused step eager): two fused
    trials stay within bf16 rounding of their eager solo runs over 36 steps."""
    common = dict(device="cuda", step_mode="eager", schedule="round_robin", max_examples=288,
                  eval_every=10**6, eval_at_start=False)
    cfgs = [quiet_config(seed=0, lr=1e-3, **common),
            quiet_config(seed=1, lr=2e-3, weight_decay=0.01, **common)]
    solo, fused = _solo_and_fused(cfgs, tmp_path, torch.float32)
    losses, metrics = _largest_differences(solo, fused)
    print(f"\n[equivalence] {losses:.2g} {metrics:.2g}")
    assert losses <= 5e-2 and metrics <= 5e-2


# ---------------------------------------------------------------------- events in a group
#: one length bucket, so a trial joining a running group draws its solo run's batches
#: (with buckets it takes those of the trials already there: the test after the join one)
EVENTS = dict(epochs=2, schedule="round_robin", eval_every=10**6, eval_at_start=False,
              length_bucketing=False)


@pytest.fixture(scope="module")
def event_runs(quiet_config, tmp_path_factory):
    """Three trials (each its own seed, lr, weight decay; 42 round-robin steps) in float64:
    their configs, the data, their solo runs and their group run without events, each run
    as (every step's (task, loss), final metrics)."""
    cfgs = [quiet_config(seed=0, lr=1e-3, **EVENTS),
            quiet_config(seed=1, lr=2e-3, weight_decay=0.01, **EVENTS),
            quiet_config(seed=2, lr=5e-4, weight_decay=0.1, **EVENTS)]
    data = load_data(cfgs[0])
    folder = tmp_path_factory.mktemp("event-references")
    solo = _solo_runs(cfgs, data, folder, torch.float64)
    group, seens = _group(cfgs, data, folder / "group")
    return cfgs, data, solo, list(zip(seens, group.fit()))


def _trial(cfg, data, folder, **options) -> TrialRun:
    return TrialRun(cfg, data, folder, model=_model(cfg, torch.float64), **options)


def _group(cfgs, data, folder, **options) -> tuple[TrainingGroup, list[list]]:
    """A group of ``cfgs``' trials (ids 0, 1, ...) and each one's recorded steps."""
    group, seens = TrainingGroup(), []
    for i, cfg in enumerate(cfgs):
        trial = _trial(cfg, data, folder / str(i), **options)
        seens.append(_recording(trial))
        group.add(trial)
    return group, seens


def _own_storage(trial: TrialRun) -> bool:
    """Whether every weight and moment of ``trial`` is a tensor of its own (no view of a
    stacked one)."""
    tensors = [p.data for p in trial.model.parameters()] + [
        v for state in trial.optimizer.state.values() for v in state.values()]
    return all(t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in tensors)


def test_a_stopped_trial_leaves_and_the_others_train_on_as_without_it(event_runs, tmp_path):
    """B removed after 20 of 42 steps (as a scheduler stops a trial): its weights and
    moments become its own tensors and stop moving; A and C train on as in the group
    without the event and as their solo runs (float64; measured step losses: equal, and
    1.8e-15 from the solo runs; val metrics equal)."""
    cfgs, data, solo, undisturbed = event_runs
    group, seens = _group(cfgs, data, tmp_path)
    group.run_steps(20)
    b = group.trials[1]
    end = group.remove(1)
    assert end.reason == "stopped" and 1 not in group.trials and group.ended[1] is end
    assert _own_storage(b)
    weights = [p.detach().clone() for p in b.model.parameters()]
    results = group.fit()
    assert all(torch.equal(w, p) for w, p in zip(weights, b.model.parameters()))
    assert len(seens[1]) == 20 and results[1] is end
    a_c = [(seens[0], results[0]), (seens[2], results[2])]
    assert max(_largest_differences([undisturbed[0], undisturbed[2]], a_c)) <= 1e-8
    assert max(_largest_differences([solo[0], solo[2]], a_c)) <= 1e-8


def test_a_trial_joins_a_running_group(event_runs, tmp_path):
    """C joins A and B after 10 steps (the group re-forms): all three train as their solo
    runs (float64, within 1e-8; measured: step losses 3.6e-15, val metrics equal)."""
    cfgs, data, solo, _ = event_runs
    group, seens = _group(cfgs[:2], data, tmp_path)
    group.run_steps(10)
    joining = _trial(cfgs[2], data, tmp_path / "2")
    seens.append(_recording(joining))
    assert group.add(joining, "c") == "c"
    results = group.fit()
    assert group.joined == [0, 1, "c"]
    assert max(_largest_differences(solo, list(zip(seens, results)))) <= 1e-8


def test_trials_drawing_a_task_together_take_one_length_bucket(quiet_config, tmp_path):
    """With length buckets, C joins A and B after 9 round-robin steps (so it trains the task
    they train) and then draws each batch from the bucket A, the first trial drawing that
    task in the step, is at -- its own rows, from its own seed -- while A and B, which
    joined together, draw exactly their solo runs' batches."""
    cfgs = [quiet_config(**{**EVENTS, "length_bucketing": True}, seed=s) for s in (0, 1, 2)]
    data = load_data(cfgs[0])
    group, _ = _group(cfgs[:2], data, tmp_path / "group")
    group.run_steps(9)
    joining = _trial(cfgs[2], data, tmp_path / "2")
    group.add(joining)
    members = list(group.trials.values())

    def state(member):
        return {t: (b.passes.copy(), b.positions.copy()) for t, b in member.batchers.items()}

    def drawn_buckets(member, before):
        """{task: the bucket its batcher drew from} since ``before``."""
        return {t: int(np.flatnonzero((b.passes != before[t][0])
                                      | (b.positions != before[t][1]))[0])
                for t, b in member.batchers.items()
                if (b.passes != before[t][0]).any() or (b.positions != before[t][1]).any()}

    followed = 0
    for _ in range(20):
        before = [state(m) for m in members]
        group.step_once()
        a, b, c = (drawn_buckets(m, s) for m, s in zip(members, before))
        assert a.keys() == c.keys() and len(c) == 1 and a == b == c  # one bucket a task
        task = next(iter(c))
        own = joining.batchers[task].bucket_at(joining.batchers[task].draws - 1)
        followed += c[task] != own
    assert followed > 0  # ... which is not its own sequence's
    for member in members[:2]:  # A and B: where their solo runs' batchers would be
        for task, batcher in member.batchers.items():
            alone = TaskBatcher(member.train_splits[task], batcher.batch_size,
                                member.encodings[task], member.cfg.seed,
                                bucket_batches=member.cfg.bucket_batches)
            for _ in range(batcher.draws):
                alone.next_batch()
            assert alone.state_dict() == batcher.state_dict()


def test_a_diverged_trial_and_a_failing_one_end_alone(event_runs, tmp_path):
    """B's QQP head diverged (an infinite bias), C's report callback fails at its first
    report and D's own stop check says stop after 5 schedule steps: each ends alone (B at
    its first check, after 3 steps; C at the end of the schedule step after its report, 12
    steps; D after 15), C's steps until then its solo run's; A trains as its solo run
    (float64, within 1e-8; measured: 1.1e-16, 1.8e-15)."""
    cfgs, data, solo, _ = event_runs
    trials = [_trial(cfgs[0], data, tmp_path / "a"), _trial(cfgs[1], data, tmp_path / "b")]
    with torch.no_grad():
        trials[1].model.qqp_out.bias.fill_(float("inf"))

    def failing_report(metrics, checkpoint):
        raise RuntimeError("the report could not be sent")
    trials.append(_trial(cfgs[2].replace(eval_every=48), data, tmp_path / "c",
                         report=failing_report))
    checks = iter(range(1, 100))
    trials.append(_trial(cfgs[0].replace(seed=3), data, tmp_path / "d",
                         stop_requested=lambda: next(checks) >= 5))
    group = TrainingGroup()
    seens = [_recording(t) for t in trials]
    for trial in trials:
        group.add(trial)
    results = group.fit()
    assert [group.ended[i].reason for i in range(4)] == ["finished", "failed", "failed",
                                                         "stopped"]
    assert isinstance(results[3], SystemExit) and len(seens[3]) == 15
    assert isinstance(results[1], NonFiniteLossError)
    assert "qqp loss became" in str(results[1])
    assert isinstance(results[2], RuntimeError) and "could not be sent" in str(results[2])
    assert 0 < len(seens[2]) < len(solo[2][0])
    assert max(abs(a - b) for (_, a), (_, b) in zip(seens[2], solo[2][0])) <= 1e-8
    assert [t for t, _ in seens[2]] == [t for t, _ in solo[2][0][:len(seens[2])]]
    assert max(_largest_differences([solo[0]], [(seens[0], results[0])])) <= 1e-8


def test_a_paused_trial_resumes_from_its_checkpoint_into_the_group(event_runs, tmp_path):
    """B paused after 16 steps (amid a round-robin schedule step: it trains that step's last
    two updates alone first, the others not moving), resumed from its checkpoint into the
    group 6 steps later: every step of B, its final val metrics and train losses are its
    uninterrupted solo run's, and A and C train as their solo runs (float64, within 1e-8;
    measured: step losses 1.8e-15, val metrics and train losses equal)."""
    cfgs, data, solo, _ = event_runs
    group, seens = _group(cfgs, data, tmp_path)
    group.run_steps(16)
    end = group.pause(1)
    assert end.reason == "paused" and (end.checkpoint / "state.pt").is_file()
    assert len(seens[1]) == 18 and len(seens[0]) == 16  # B ended its schedule step alone
    group.run_steps(6)
    resumed = _trial(cfgs[1], data, tmp_path / "1", resume_from=end.checkpoint)
    seens.append(_recording(resumed))
    group.add(resumed)
    results = group.fit()
    b = (seens[1] + seens[3], results[3])
    runs = [(seens[0], results[0]), b, (seens[2], results[2])]
    assert max(_largest_differences(solo, runs)) <= 1e-8
    train = [k for k in solo[1][1] if k.startswith("train/loss_")]
    assert train and all(abs(b[1][k] - solo[1][1][k]) <= 1e-8 for k in train)
    assert b[1]["optimizer_steps"] == solo[1][1]["optimizer_steps"]


def test_a_paused_smart_pcgrad_trial_resumes_into_the_group_as_its_solo_run(quiet_config,
                                                                           tmp_path):
    """SMART, PCGrad and uncertainty weighting, B paused after 5 summed steps and resumed
    from its checkpoint into the group 2 steps later: its checkpoint holds its own random
    stream and teacher, so every step of B (its noise and task orders included) and its
    final val metrics are its uninterrupted solo run's; A and C train as their solo runs
    (float64, within 1e-8; measured: 3.6e-15, val metrics equal)."""
    common = dict(epochs=2, schedule="round_robin", update="summed", pcgrad=True,
                  loss_weighting="uncertainty", eval_every=10**6, eval_at_start=False,
                  pair_encoding="siamese", length_bucketing=False)  # (as EVENTS says)
    cfgs = [quiet_config(**trial, **common) for trial in SMART_TRIALS]
    data = load_data(cfgs[0])
    solo = _solo_runs(cfgs, data, tmp_path, torch.float64)
    group, seens = _group(cfgs, data, tmp_path / "group")
    group.run_steps(5)
    end = group.pause(1)
    assert end.reason == "paused"
    group.run_steps(2)
    resumed = _trial(cfgs[1], data, tmp_path / "group" / "1", resume_from=end.checkpoint)
    seens.append(_recording(resumed))
    group.add(resumed)
    results = group.fit()
    runs = [(seens[0], results[0]), (seens[1] + seens[3], results[3]), (seens[2], results[2])]
    assert len(seens[1]) == 15  # 5 summed steps of three tasks
    assert max(_largest_differences(solo, runs)) <= 1e-8


def test_fused_attention_batches_the_trials_on_the_cpu(quiet_config, recwarn):
    """On the CPU the fused encoder's attention is :mod:`mtbert.model.fused_attention`'s, which
    ``vmap`` batches (SDPA's CPU kernel has no batching rule: ``vmap`` would warn and loop
    over the trials), and each trial's loss is its own model's (float64, within 1e-12)."""
    cfg = quiet_config()
    data = load_data(cfg)
    models = [_model(quiet_config(seed=s), torch.float64) for s in (0, 1)]
    fused = FusedModel(models, [0.0, 0.0], 0.0)
    assert fused.skeleton.encoder.config._attn_implementation == BATCHED_ATTENTION
    assert BATCHED_ATTENTION in FOUR_D_MASK  # the model hands it SDPA's 4-D boolean mask
    for task in ("sst", "qqp", "sts"):
        rows = data.split(task, "train")
        batches = [collate(rows, np.arange(s, s + 6), encoding_for(task, cfg.pair_encoding),
                           data.pad_id) for s in (0, 3)]
        losses = fused.task_losses(task, stack_batches(batches, data.pad_id), cfg)
        for n, (model, batch) in enumerate(zip(models, batches)):
            model.eval()  # dropout 0 either way
            alone = float(task_loss(task, model(task, batch), batch["labels"], cfg))
            assert abs(float(losses[n]) - alone) <= 1e-12
    assert not [w for w in recwarn if "batching rule" in str(w.message)]


def test_with_dropout_fused_trials_train_as_their_solo_runs_in_float64(tiny_config,
                                                                      tmp_path):
    """Dropout on (0.1, 0.2, 0.3, and the attention probabilities' 0.1): each trial's masks
    are its own (its step seed hashed with each draw's place and each element's coordinates,
    mtbert.core.trial_streams), so in a group, its batches padded to the group's shapes,
    every step's loss and the final val metrics are its solo run's (measured: 1.8e-15 and
    0); and dropout did act: at rate 0 the first trial's losses differ."""
    common = dict(epochs=2, schedule="round_robin", eval_every=10**6, eval_at_start=False,
                  eval_dev=False)
    cfgs = [tiny_config(seed=s, dropout=rate, lr=2e-3, **common)
            for s, rate in enumerate((0.1, 0.2, 0.3))]
    solo, fused = _solo_and_fused(cfgs, tmp_path, torch.float64)
    losses, metrics = _largest_differences(solo, fused)
    print(f"\n[equivalence with dropout] {losses:.2g} {metrics:.2g}")
    assert losses <= 1e-8 and metrics <= 1e-8
    still = _solo_runs([tiny_config(seed=0, dropout=0.0, **common)], load_data(cfgs[0]),
                       tmp_path / "still", torch.float64)
    assert max(abs(a - b) for (_, a), (_, b) in zip(solo[0][0], still[0][0])) > 1e-4


def test_fused_trials_under_bf16_autocast_follow_their_solo_runs_on_the_cpu(quiet_config,
                                                                             tmp_path):
    """The GPU's precision path on the CPU: bf16 autocast (what a CUDA trial trains under)
    through the fused step, its batched attention and per-trial dropout buffers; two
    fused trials stay within bf16 rounding of their autocast solo runs (measured over 42
    steps: losses within 2.0e-2, val metrics within 2.9e-4)."""
    common = dict(schedule="round_robin", epochs=2, eval_every=10**6, eval_at_start=False)
    cfgs = [quiet_config(seed=0, lr=1e-3, **common),
            quiet_config(seed=1, lr=2e-3, weight_decay=0.01, **common)]
    data = load_data(cfgs[0])
    solo = []
    for i, cfg in enumerate(cfgs):
        trainer = Trainer(cfg, data, tmp_path / f"solo-{i}", model=_model(cfg, torch.float32))
        trainer.autocast = True
        seen = _recording(trainer)
        solo.append((seen, trainer.fit()))
    group = TrainingGroup(cfgs, data, [tmp_path / f"fused-{i}" for i in range(2)],
                       models=[_model(cfg, torch.float32) for cfg in cfgs])
    for trial in group.trials.values():
        trial.autocast = True
    seens = [_recording(t) for t in group.trials.values()]
    fused = list(zip(seens, group.fit()))
    losses, metrics = _largest_differences(solo, fused)
    print(f"\n[equivalence] {losses:.2g} {metrics:.2g}")
    assert losses <= 5e-2 and metrics <= 5e-2
    # bf16 did act: the float32 runs of the same trials differ from the autocast ones
    plain = Trainer(cfgs[0], data, tmp_path / "plain", model=_model(cfgs[0], torch.float32))
    plain_seen = _recording(plain)
    plain.fit()
    assert max(abs(a - b) for (_, a), (_, b) in zip(plain_seen, solo[0][0])) > 1e-4


#: structures the other equivalence tests leave out, each with two trials that differ in
#: what a fused trial keeps its own: LR schedule, lr, clipping, head lr, fixed loss weights
MORE_STRUCTURES = {
    "siamese-cosine-cls": (
        dict(pair_encoding="siamese", sts_head="cosine", sts_loss="cosine_mse", pooling="cls"),
        [dict(seed=5, lr=1e-3, lr_schedule="linear", max_grad_norm=1.0),
         dict(seed=6, lr=2e-3, lr_schedule="constant", max_grad_norm=0.5,
              head_lr_multiplier=5.0, weight_decay=0.01)]),
    "cross-shared-layer-bins-fixed-summed": (
        dict(shared_pair_layer=True, sts_loss="ce_bins", loss_weighting="fixed",
             update="summed"),
        [dict(seed=7, lr=1e-3, lr_schedule="wsd", w_sst=0.5, w_qqp=2.0, w_sts=1.0),
         dict(seed=8, lr=3e-3, lr_schedule="linear", w_sst=1.5, w_qqp=0.3, w_sts=0.7,
              max_grad_norm=0.3)]),
}


@pytest.mark.parametrize("name", list(MORE_STRUCTURES))
def test_more_structures_train_as_their_solo_runs_in_float64(quiet_config, tmp_path, name):
    """Pair encodings, heads, pooling, STS losses, loss weightings and LR schedules beyond
    the tests above: each fused trial trains as its solo run (float64, within 1e-8), with
    length buckets on (the trials start together, so they draw their solo batches)."""
    common, trials = MORE_STRUCTURES[name]
    cfgs = [quiet_config(epochs=2, schedule="round_robin", eval_every=10**6,
                         eval_at_start=False, **common, **trial) for trial in trials]
    assert len({fuse_key(c) for c in cfgs}) == 1
    solo, fused = _solo_and_fused(cfgs, tmp_path, torch.float64)
    losses, metrics = _largest_differences(solo, fused)
    assert losses <= 1e-8 and metrics <= 1e-8


def test_trials_of_other_length_buckets_do_not_fuse(quiet_config):
    """A fused step's trials share each task's length bucket, so the buckets' cut is part
    of the structure: trials of another ``bucket_batches`` or without bucketing form
    groups of their own."""
    cfgs = [quiet_config(seed=0), quiet_config(seed=1), quiet_config(seed=2, bucket_batches=4),
            quiet_config(seed=3, length_bucketing=False)]
    groups = sorted(sorted(indices) for indices, _ in plan_groups(cfgs))
    assert groups == [[0, 1], [2], [3]]
