"""Fixed batch shapes (a fixed row count per task, filler rows of weight 0, a few static
lengths) train exactly as the batches without them, and the bookkeeping of the graphed
step (its bodies run eagerly on a CPU) gives the eager step's weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mtbert.data import ROW_WEIGHTS, STATIC_LENGTHS, collate, load_data, real_rows
from mtbert.core.errors import ConfigError
from mtbert.techniques.losses import task_loss
from mtbert.step.step_engine import reached_parameters
from mtbert.step.step_graphs import StepGraphs, batch_shapes, eager_reason
from mtbert.loop.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SMART = dict(smart_lambda_sst=1.0, smart_lambda_qqp=2.0, smart_lambda_sts=1.0, smart_mu=0.5,
             smart_steps=2)


def fixed_noise(x: torch.Tensor) -> torch.Tensor:
    """SMART's initial noise as a function of the embeddings, not of the RNG: the same on a
    row whether or not filler rows follow it."""
    return 1e-3 * torch.sin(1000.0 * x)


def without_dropout(trainer: Trainer) -> Trainer:
    """Every dropout off, the encoder's attention dropout too (``dropout`` sets the hidden
    one): dropout draws a number per padded position, so it differs with filler rows."""
    for module in trainer.model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return trainer


def loss_and_grads(trainer: Trainer, task: str, batch: dict) -> tuple[float, list]:
    trainer.model.train()
    trainer.model.zero_grad(set_to_none=True)
    out = trainer.model(task, batch)
    loss = task_loss(task, out, batch["labels"], trainer.cfg, batch.get(ROW_WEIGHTS))
    if trainer.regulariser is not None:
        loss = loss + trainer.regulariser.term(trainer.model, task, batch, out)
    trainer.loss_combiner.weighted({task: loss})[task].backward()
    return loss.item(), [p.grad.clone() if p.grad is not None else None
                         for p in trainer.model.parameters()]


@pytest.mark.parametrize("pair_encoding,extra", [
    ("cross", {}), ("cross", SMART), ("siamese", SMART),
    ("siamese", {"sts_head": "cosine", "sts_loss": "cosine_embedding"}),
    ("cross", {"sts_loss": "ce_bins", "loss_weighting": "uncertainty"}),
])
def test_filler_rows_change_no_loss_and_no_gradient(tiny_config, tmp_path, pair_encoding, extra):
    """5 rows alone against the same 5 rows + 3 filler rows at a static length: the same
    loss and gradients (float32 rounding of the longer rows: 1e-5 relative)."""
    cfg = tiny_config(dropout=0.0, pair_encoding=pair_encoding, **extra)
    trainer = without_dropout(Trainer(cfg, load_data(cfg), tmp_path, checkpoints=False))
    if trainer.regulariser is not None:
        trainer.regulariser.initial_noise = fixed_noise
    for task in ("sst", "qqp", "sts"):
        split, encoding = trainer.train_splits[task], trainer.encodings[task]
        rows = np.arange(3, 8)
        plain = collate(split, rows, encoding, trainer.data.pad_id)
        fixed = collate(split, rows, encoding, trainer.data.pad_id, static_max_length=32, rows=8)
        assert real_rows(fixed) == 5 and len(fixed["labels"]) == 8
        assert {v.shape[1] for k, v in fixed.items() if v.dim() == 2} == {32}
        loss_plain, grads_plain = loss_and_grads(trainer, task, plain)
        loss_fixed, grads_fixed = loss_and_grads(trainer, task, fixed)
        assert loss_fixed == pytest.approx(loss_plain, rel=1e-5), task
        scale = max(a.abs().max().item() for a in grads_plain if a is not None)
        for a, b in zip(grads_plain, grads_fixed):
            assert (a is None) == (b is None)
            if a is not None:  # rounding-level gradients (~1e-12) compared at the scale
                torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6 * scale)


@pytest.mark.parametrize("update,pcgrad", [("summed", True), ("summed", False)])
def test_a_partial_super_batch_trains_the_same_with_filler_rows(tiny_config, tmp_path, update,
                                                                 pcgrad):
    """One optimizer step on a super-batch of partial batches (PCGrad's per-task backwards
    too): the same weights after it, filler rows or not."""
    weights = {}
    for pad in ("batch", "buckets"):
        cfg = tiny_config(dropout=0.0, update=update, pcgrad=pcgrad, pad_lengths=pad, **SMART)
        torch.manual_seed(0)
        trainer = without_dropout(Trainer(cfg, load_data(cfg), tmp_path / pad, checkpoints=False))
        trainer.regulariser.initial_noise = fixed_noise
        torch.manual_seed(1)  # PCGrad's random task order
        batches = {t: collate(trainer.train_splits[t], np.arange(5), trainer.encodings[t],
                              trainer.data.pad_id, trainer.static_max_length,
                              rows=8 if pad == "buckets" else 0) for t in ("sst", "qqp", "sts")}
        trainer.train_batches(batches)
        assert trainer.examples_seen == 15
        weights[pad] = [p.detach().clone() for p in trainer.model.parameters()]
    for a, b in zip(weights["batch"], weights["buckets"]):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)


def test_a_trial_meets_few_batch_shapes(tiny_config, tmp_path):
    """Static lengths up to max_length 128 and a fixed row count: at most 3 shapes a task
    over every step of a run (3 x 3 graphs), every batch of its task's size."""
    cfg = tiny_config(max_length=128, pad_lengths="buckets", batch_size=8, batch_size_sts=4,
                      epochs=2)
    trainer = Trainer(cfg, load_data(cfg), tmp_path, checkpoints=False)
    shapes: dict[str, set] = {"sst": set(), "qqp": set(), "sts": set()}
    for epoch in (1, 2):
        for group in trainer.epoch_plan(epoch):
            for task, batch in trainer.next_batches(group).items():
                shapes[task].add(batch_shapes(batch))
                assert len(batch["labels"]) == cfg.task_batch_size(task)
                widths = {v.shape[1] for v in batch.values() if v.dim() == 2}
                assert len(widths) == 1 and widths <= set(STATIC_LENGTHS)
    assert all(1 <= len(s) <= 3 for s in shapes.values()), shapes


def graphed_on_cpu(trainer: Trainer) -> Trainer:
    """The graphed step's bookkeeping on a CPU: its bodies run eagerly (nothing captured),
    static gradient buffers from the third step on, as after a first capture on CUDA."""
    trainer.step_graphs = StepGraphs(trainer, log=lambda message: None)
    return trainer


@pytest.mark.parametrize("update,extra", [
    ("per_task", SMART),
    ("summed", {"loss_weighting": "uncertainty", "l2_lambda": 1e-3}),
    ("per_task", {"pair_encoding": "siamese", "shared_pair_layer": True}),
])
def test_graph_step_bookkeeping_gives_the_eager_weights(tiny_config, tmp_path, update, extra):
    """Six steps through StepGraphs (per-task backwards, only the reached parameters
    updated, static zeroed gradients, learning rates from a device vector) against the eager
    step: the same weights.  A strong weight decay makes an update of an unreached head
    (a zero gradient is not no gradient to AdamW) show."""
    cfg = tiny_config(dropout=0.0, update=update, pad_lengths="buckets", weight_decay=0.5,
                      schedule="round_robin", lr=1e-2, **extra)
    data = load_data(cfg)
    runs = {}
    for mode in ("eager", "graphed"):
        torch.manual_seed(0)
        trainer = without_dropout(Trainer(cfg, data, tmp_path / mode, checkpoints=False))
        if trainer.regulariser is not None:
            trainer.regulariser.initial_noise = fixed_noise
        if mode == "graphed":
            graphed_on_cpu(trainer)
        plan = trainer.epoch_plan(1)
        for i, group in enumerate(plan[:6]):
            if mode == "graphed" and i == 2:
                trainer.step_graphs.allocate_grads()
            trainer.train_batches(trainer.next_batches(group))
        trainer.check_losses()
        runs[mode] = ([p.detach().clone() for p in trainer.model.parameters()],
                      trainer.lr_scheduler.get_last_lr(), trainer._loss_sums)
    (w_e, lr_e, loss_e), (w_g, lr_g, loss_g) = runs["eager"], runs["graphed"]
    assert lr_g == lr_e and all(isinstance(lr, float) for lr in lr_g)
    for task in loss_e:
        assert loss_g[task] == pytest.approx(loss_e[task], rel=1e-5)
    names = [name for name, _ in trainer.model.named_parameters()]
    for name, a, b in zip(names, w_e, w_g):
        # an attention key bias has a zero gradient in exact arithmetic (softmax ignores a
        # constant per query): its rounding-level gradient, which Adam scales to ~lr per
        # step, differs with the order of the sums; every other weight to 1e-5
        atol = 2 * cfg.lr * 6 if name.endswith("key.bias") else 1e-5
        torch.testing.assert_close(b, a, rtol=1e-4, atol=atol, msg=name)


def test_reached_parameters_are_those_backward_sets(tiny_config, tmp_path):
    cfg = tiny_config(dropout=0.0, pad_lengths="buckets", **SMART)
    trainer = Trainer(cfg, load_data(cfg), tmp_path, checkpoints=False)
    for task in ("sst", "qqp", "sts"):
        batch = trainer.next_batches((task,))[task]
        trainer.model.zero_grad(set_to_none=True)
        out = trainer.model(task, batch)
        loss = task_loss(task, out, batch["labels"], cfg, batch[ROW_WEIGHTS])
        loss = loss + trainer.regulariser.term(trainer.model, task, batch, out)
        reached = reached_parameters(loss)
        loss.backward()
        with_grad = {id(p) for p in trainer.model.parameters() if p.grad is not None}
        assert reached == with_grad and 0 < len(reached) < len(list(trainer.model.parameters()))


def test_step_mode_graphs_is_refused_where_it_cannot_run(tiny_config, tmp_path):
    with pytest.raises(ConfigError, match="step_mode=graphs cannot run with pcgrad=true") as err:
        tiny_config(step_mode="graphs", update="summed", pcgrad=True)
    assert err.value.key == "step_mode"
    with pytest.raises(ConfigError, match="step_mode=graphs needs a CUDA device") as err:
        cfg = tiny_config(step_mode="graphs", device="cpu")
        Trainer(cfg, load_data(cfg), tmp_path)
    assert err.value.key == "step_mode"
    cfg = tiny_config(step_mode="auto", device="cpu")
    assert Trainer(cfg, load_data(cfg), tmp_path).step_graphs is None  # eager on a CPU


def test_the_progress_line_says_why_a_step_runs_eager(tiny_config, tmp_path, capsys):
    cuda = torch.device("cuda")  # a device name: no GPU needed to resolve the mode for it
    assert eager_reason(tiny_config(), cuda) is None
    assert eager_reason(tiny_config(update="summed", pcgrad=True), cuda).startswith("pcgrad")
    assert eager_reason(tiny_config(compile="default"), cuda) == "compile=default"
    assert eager_reason(tiny_config(step_mode="eager"), cuda) == "step_mode=eager"
    cfg = tiny_config(progress=True, max_examples=8, eval_dev=False, eval_at_start=False)
    Trainer(cfg, load_data(cfg), tmp_path).fit()
    assert "step=eager (no CUDA graphs on cpu)" in capsys.readouterr().err
