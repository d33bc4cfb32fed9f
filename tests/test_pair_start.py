"""The siamese / cosine path starts where the encoder is.

The STS cosine maps' fixed points, the QQP head's cosine start (a logistic fit on
training rows), the evaluation at 0 examples, and the per-module learning-rate groups.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from mtbert.model.cosine_init import fit_logistic_1d, qqp_cosines
from mtbert.data import collate, load_data
from mtbert.model.model import MultitaskModel
from mtbert.loop.trainer import Trainer


@pytest.fixture(scope="module")
def tiny_data(tiny_model_dir, tiny_data_dir):
    from mtbert.core.config import TrainConfig
    return load_data(TrainConfig(model=tiny_model_dir, data_dir=tiny_data_dir, max_length=32))


def identical_pairs(data, n=6):
    """A siamese STS batch whose second sentence is the first one (cos = 1)."""
    batch = collate(data.split("sts", "train"), np.arange(n), "siamese", data.pad_id)
    batch["input_ids_b"] = batch["input_ids_a"].clone()
    batch["attention_mask_b"] = batch["attention_mask_a"].clone()
    return batch


# ------------------------------------------------------------------ STS cosine maps
@pytest.mark.parametrize("cos_map,at_zero,learned", [
    ("affine", 0.0, True), ("scaled", 0.0, False), ("report002", 2.5, False)])
def test_cosine_map_fixed_points(tiny_config, tiny_data, cos_map, at_zero, learned):
    cfg = tiny_config(pair_encoding="siamese", sts_head="cosine", sts_cosine_map=cos_map)
    model = MultitaskModel.from_config(cfg).eval()
    # identical sentences -> cos 1 -> score 5 under every map (at the start)
    out = model("sts", identical_pairs(tiny_data))
    assert torch.allclose(out.score, torch.full_like(out.score, 5.0), atol=1e-4)
    assert torch.allclose(model.predict("sts", identical_pairs(tiny_data)),
                          torch.full((6,), 5.0), atol=1e-4)
    # cos 0 (unrelated) -> 0 with the default maps (label / 5 fit), 2.5 with report 002's
    assert model.cosine_score(torch.tensor(0.0)).item() == pytest.approx(at_zero)
    assert model.cosine_score(torch.tensor(-1.0)).item() == pytest.approx(
        {"affine": -5.0, "scaled": -5.0, "report002": 0.0}[cos_map])
    head_names = {n for n, _ in model.head_parameters()}
    assert ("sts_cos_scale" in head_names) == learned  # only the affine map is trained
    assert "sts_cos_scale" in model.state_dict()       # and every map is in the checkpoint


def test_affine_map_learns_scale_and_shift(tiny_config, tiny_data):
    cfg = tiny_config(pair_encoding="siamese", sts_head="cosine")
    model = MultitaskModel.from_config(cfg)
    batch = collate(tiny_data.split("sts", "train"), np.arange(8), "siamese", tiny_data.pad_id)
    from mtbert.techniques.losses import task_loss
    loss = task_loss("sts", model("sts", batch), batch["labels"], cfg)
    loss.backward()
    assert model.sts_cos_scale.grad is not None and model.sts_cos_scale.grad.abs() > 0
    assert model.sts_cos_shift.grad is not None and model.sts_cos_shift.grad.abs() > 0


# ------------------------------------------------------------------ QQP cosine start
def test_logistic_fit_recovers_the_generating_line():
    rng = np.random.default_rng(0)
    x = rng.uniform(0, 1, 40000)
    y = (rng.uniform(size=x.size) < 1 / (1 + np.exp(-(8 * x - 5)))).astype(float)
    a, b = fit_logistic_1d(x, y, l2=0.0)
    assert a == pytest.approx(8, rel=0.08) and b == pytest.approx(-5, rel=0.08)
    # an offset is taken as given: fitting y against x with offset o recovers the rest
    a2, b2 = fit_logistic_1d(x, y, offset=np.full_like(x, -5.0), l2=0.0)
    assert a2 == pytest.approx(a, rel=1e-3) and b2 == pytest.approx(b + 5, abs=1e-2)
    # separable rows stay finite (the l2 term)
    a3, _ = fit_logistic_1d(np.array([0.1, 0.2, 0.8, 0.9]), np.array([0, 0, 1, 1.0]))
    assert np.isfinite(a3) and a3 > 0


def test_siamese_qqp_head_starts_as_the_fitted_cosine(tiny_config, tiny_data, tmp_path):
    cfg = tiny_config(pair_encoding="siamese", sts_head="cosine", cosine_fit_rows=40,
                      eval_dev=False)
    trainer = Trainer(cfg, tiny_data, tmp_path)
    model = trainer.model
    assert torch.count_nonzero(model.qqp_out.weight) == 0 and model.qqp_out.bias.item() == 0
    split = tiny_data.split("qqp", "train")
    pick = np.sort(np.random.default_rng([cfg.seed, 13]).permutation(len(split))[:40])
    cos, rest = qqp_cosines(model, split.subset(pick), tiny_data.pad_id, 32, trainer.device)
    assert np.allclose(rest, 0.0, atol=1e-6)  # the zero layer adds nothing yet
    a, b = fit_logistic_1d(cos, split.labels[pick])
    assert model.qqp_cos_scale.item() == pytest.approx(a, rel=1e-5)
    assert model.qqp_cos_shift.item() == pytest.approx(b, rel=1e-5, abs=1e-6)
    # the logit is a·cos + b (eval mode: the cosine feature is never dropped)
    batch = collate(split, np.arange(8), "siamese", tiny_data.pad_id)
    model.eval()
    out = model("qqp", batch)
    c = F.cosine_similarity(out.u, out.v, dim=-1)
    assert torch.allclose(out.logits, a * c + b, atol=1e-5)
    # report 002's random head is still there when asked for
    random_head = MultitaskModel.from_config(cfg.replace(pair_head_init="random"))
    assert torch.count_nonzero(random_head.qqp_out.weight) > 0
    assert not hasattr(random_head, "qqp_cos_scale")


# ------------------------------------------------------------------ 0-example evaluation
def test_evaluation_at_zero_examples_is_recorded_and_reported(tiny_config, tiny_data, tmp_path):
    cfg = tiny_config(pair_encoding="siamese", sts_head="cosine", eval_every=60,
                      max_examples=120, eval_dev=False)
    reports = []
    trainer = Trainer(cfg, tiny_data, tmp_path,
                      report=lambda m, d: reports.append((dict(m), d and json.loads(
                          (Path(d) / "metrics.json").read_text()))))
    # what the untrained model scores, computed before fit()
    before = trainer.evaluate("val")
    trainer.fit()
    history = [json.loads(line) for line in (tmp_path / "history.jsonl").open()]
    seen = [h["examples_seen"] for h in history]
    assert seen[0] == 0 and len(seen) == 3 and 60 <= seen[1] < seen[2] == trainer.examples_seen
    start = history[0]
    assert start["optimizer_steps"] == 0 and not any(k.startswith("train/loss") for k in start)
    for key in ("val/sst_acc", "val/qqp_acc", "val/sts_corr", "val/overall"):
        assert start[key] == pytest.approx(before[key])
    # reported like every evaluation, but with no checkpoint (nothing resumes from or
    # ranks an untrained model); the later evaluations come with theirs
    assert [m["examples_seen"] for m, _ in reports] == seen
    assert reports[0][1] is None
    assert [c["examples_seen"] for _, c in reports[1:]] == seen[1:]
    # the STS score at 0 examples is the untrained encoder's cosine (× 5): Pearson r of the
    # raw cosine on the same rows
    split = tiny_data.split("sts", "val")
    fresh = MultitaskModel.from_config(cfg).eval()
    cos = []
    for i in range(len(split)):
        b = collate(split, np.array([i]), "siamese", tiny_data.pad_id)
        o = fresh("sts", b)
        cos.append(F.cosine_similarity(o.u, o.v, dim=-1).item())
    from mtbert.run.metrics import pearson
    assert start["val/sts_corr"] == pytest.approx(pearson(np.clip(5 * np.array(cos), 0, 5),
                                                          split.labels), abs=1e-3)


def test_eval_at_start_can_be_switched_off(tiny_config, tiny_data, tmp_path):
    cfg = tiny_config(eval_every=60, max_examples=120, eval_dev=False, eval_at_start=False)
    seen = []
    Trainer(cfg, tiny_data, tmp_path, report=lambda m, d: seen.append(m["examples_seen"])).fit()
    assert len(seen) == 2 and seen[0] >= 60  # no evaluation at 0


# ------------------------------------------------------------------ learning-rate groups
@pytest.mark.parametrize("mult", [1.0, 20.0])
def test_head_learning_rate_groups(tiny_config, tiny_data, tmp_path, mult):
    cfg = tiny_config(pair_encoding="siamese", sts_head="cosine", head_lr_multiplier=mult,
                      lr=1e-4, warmup_ratio=0.0, loss_weighting="uncertainty", eval_dev=False,
                      max_examples=64, update="summed")
    trainer = Trainer(cfg, tiny_data, tmp_path)
    groups = {g["name"]: g for g in trainer.optimizer.param_groups}
    assert set(groups) == {"encoder", "encoder_no_decay", "heads", "heads_no_decay",
                           "loss_combiner"}
    assert groups["encoder"]["lr"] == groups["encoder_no_decay"]["lr"] == pytest.approx(1e-4)
    assert groups["heads"]["lr"] == groups["heads_no_decay"]["lr"] == pytest.approx(1e-4 * mult)
    assert groups["loss_combiner"]["lr"] == pytest.approx(1e-4)
    assert groups["heads"]["weight_decay"] == 0.01 and groups["heads_no_decay"]["weight_decay"] == 0
    # every trainable parameter in exactly one group; heads = everything outside the encoder
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    in_groups = [id(p) for g in trainer.optimizer.param_groups for p in g["params"]]
    assert len(in_groups) == len(set(in_groups))
    model_ids = {id(p) for p in trainer.model.parameters() if p.requires_grad}
    assert model_ids <= set(in_groups)
    heads = {names[id(p)] for g in ("heads", "heads_no_decay") for p in groups[g]["params"]}
    assert heads and not any(n.startswith("encoder.") for n in heads)
    assert {"sst_out.weight", "qqp_out.weight", "sts_cos_scale", "qqp_cos_shift"} <= heads
    # one step on a super-batch of the three tasks: Adam's first update is lr·g/(|g| + eps)
    # ≈ lr per weight with a clear gradient, so the heads move mult times as far as the encoder
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train_batches(trainer.next_batches(("sst", "qqp", "sts")))
    assert trainer.optimizer_steps == 1

    def median_step(names_in):
        steps = []
        for n, p in trainer.model.named_parameters():
            if n in names_in and p.grad is not None:
                clear = p.grad.abs() > 1e-6
                steps.append((p.detach() - before[n]).abs()[clear])
        return torch.cat([s.flatten() for s in steps]).median().item()

    enc = {n for n in before if n.startswith("encoder.")}
    assert median_step(enc) == pytest.approx(1e-4, rel=0.02)
    assert median_step({"sst_out.weight", "qqp_out.weight"}) == pytest.approx(1e-4 * mult,
                                                                               rel=0.02)
    # the schedule keeps the ratio
    trainer.lr_scheduler.step()
    lrs = {g["name"]: g["lr"] for g in trainer.optimizer.param_groups}
    assert lrs["heads"] / lrs["encoder"] == pytest.approx(mult)


def test_checkpoints_from_before_the_cosine_maps_load_with_their_predictions(
        tiny_config, tiny_data):
    # a model as it was: report 002's map, a random QQP head; its state without the maps
    old_cfg = tiny_config(pair_encoding="siamese", sts_head="cosine",
                          sts_cosine_map="report002", pair_head_init="random")
    old = MultitaskModel.from_config(old_cfg).eval()
    state = {k: v for k, v in old.state_dict().items() if "_cos_" not in k}
    # what its config.yaml (no new fields) now builds: the defaults (affine, cosine start)
    new = MultitaskModel.from_config(tiny_config(pair_encoding="siamese", sts_head="cosine"))
    new.load_state_dict(new.complete_legacy_state(state))
    new.eval()
    for task in ("qqp", "sts"):
        batch = collate(tiny_data.split(task, "train"), np.arange(8), "siamese", tiny_data.pad_id)
        assert torch.allclose(new.predict(task, batch), old.predict(task, batch), atol=1e-6)
