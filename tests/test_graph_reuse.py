"""The values a captured step reads from device tensors (the dropout rate, SMART's λ_t, ε
and μ) give the step their floats give, and a worker's next trial of the same structure,
built on the kept model, regulariser and step graphs, trains exactly as a fresh trial.

On a CPU nothing is captured (the graphs' bodies run eagerly), so these tests pin down
the bookkeeping -- what is copied in place, what is built anew, what is left for the next
trial -- with ``graphs_wanted`` answering yes on the CPU; the replay of kept graphs is in
tests/test_step_graphs.py (CUDA)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from mtbert.loop import graph_reuse
from mtbert.core.config import TrainConfig
from mtbert.data import load_data
from mtbert.model.dropout_rate import RateDropout, hold_dropout_in_tensor
from mtbert.model.model import MultitaskModel
from mtbert.loop.trainer import NonFiniteLossError, Trainer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SMART = dict(smart_lambda_sst=1.0, smart_lambda_qqp=0.5, smart_lambda_sts=2.0, smart_mu=0.5,
             smart_eps=2e-4, smart_step_size=1e-2)


@pytest.fixture
def graphs_on_cpu(monkeypatch, no_kept_step):
    """The trainer takes the graphed path on the CPU (bodies run eagerly); nothing kept
    outlives the test."""
    monkeypatch.setattr("mtbert.loop.trainer.graphs_wanted", lambda cfg, device: True)


def weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def run(cfg: TrainConfig, data, folder, steps: int = 6) -> Trainer:
    trainer = Trainer(cfg, data, folder, checkpoints=False)
    for group in trainer.epoch_plan(1)[:steps]:
        trainer.train_batches(trainer.next_batches(group))
    trainer.check_losses()
    return trainer


def test_smart_values_in_tensors_give_the_step_of_the_floats(tiny_config, tmp_path):
    """Six SMART steps (the ε clamp active, the teacher on) with λ_t, ε, μ as 0-d tensors
    against the floats: the same weights; a tensor refilled with another ε is what the
    step reads (the weights then differ)."""
    cfg = tiny_config(dropout=0.1, **SMART)
    data = load_data(cfg)
    torch.manual_seed(0)
    floats = run(cfg, data, tmp_path / "floats")
    assert not isinstance(floats.regulariser.values["eps"], torch.Tensor)
    held = {}
    for name, eps in (("same", cfg.smart_eps), ("other", 1e-5)):
        torch.manual_seed(0)
        trainer = Trainer(cfg, data, tmp_path / name, checkpoints=False)
        trainer.regulariser.hold_in_tensors(trainer.device)
        trainer.regulariser.refill(cfg.replace(smart_eps=eps), trainer.model)
        assert isinstance(trainer.regulariser.values["eps"], torch.Tensor)
        for group in trainer.epoch_plan(1)[:6]:
            trainer.train_batches(trainer.next_batches(group))
        held[name] = weights(trainer)
    for key, value in weights(floats).items():
        torch.testing.assert_close(held["same"][key], value, rtol=1e-6, atol=1e-7, msg=key)
    assert any(not torch.allclose(held["other"][k], v) for k, v in weights(floats).items())


def test_rate_dropout_drops_at_its_tensor_rate(tiny_config):
    """RateDropout keeps each element with probability 1 - p, scaled by 1/(1 - p); a new
    rate filled into the tensor is the rate the same module drops at; eval passes through.
    The swap takes the hidden and head dropouts, not an attention module's own."""
    cfg = tiny_config(dropout=0.3, shared_pair_layer=True)
    model = MultitaskModel.from_config(cfg)
    attention_rates = [m.p for n, m in model.named_modules() if n.endswith("attention.self.dropout")]
    rate = hold_dropout_in_tensor(model, cfg.dropout, torch.device("cpu"))
    swapped = [n for n, m in model.named_modules() if isinstance(m, RateDropout)]
    layers = model.encoder.config.num_hidden_layers
    assert len(swapped) == 1 + 2 * layers + 2  # embeddings, 2 a layer, the heads' two
    assert "dropout" in swapped and "pair_shared.2" in swapped
    assert all(isinstance(m, torch.nn.Dropout) and m.p == p for m, p in zip(
        [m for n, m in model.named_modules() if n.endswith("attention.self.dropout")],
        attention_rates))
    module = model.dropout.train()
    x = torch.full((1000, 1000), 2.0)
    torch.manual_seed(0)
    for p in (0.3, 0.6, 0.0):
        rate.fill(p)
        assert module.p == p  # the number follows the tensor
        out = module(x)
        dropped = (out == 0).float().mean().item()
        assert dropped == pytest.approx(p, abs=3e-3)
        assert torch.allclose(out[out != 0], torch.tensor(2.0 / (1 - p)))
    assert module.eval()(x) is x


def fit(cfg: TrainConfig, data, folder) -> tuple[Trainer, dict]:
    trainer = Trainer(cfg, data, folder, checkpoints=False)
    final = trainer.fit()
    return trainer, final


def test_the_next_trial_on_a_kept_step_trains_as_a_fresh_one(tiny_config, tmp_path,
                                                              graphs_on_cpu):
    """Trial A ends and leaves its step; trial B (another seed, lr, dropout, SMART values,
    teacher momentum, batch size and weight decay) takes A's model, regulariser and loss
    weighting and trains exactly as B built afresh: the same weights, losses and scores."""
    a_cfg = tiny_config(dropout=0.1, max_examples=64, eval_every=32, eval_dev=False,
                        loss_weighting="uncertainty", **SMART)
    data = load_data(a_cfg)
    b_cfg = a_cfg.replace(seed=3, lr=2e-3, dropout=0.3, smart_lambda_sst=0.2, smart_eps=1e-3,
                          smart_mu=1.0, smart_beta=0.9, batch_size=4, weight_decay=0.1)
    a, _ = fit(a_cfg, data, tmp_path / "a")
    b, b_final = fit(b_cfg, data, tmp_path / "b")
    assert b.model is a.model and b.regulariser is a.regulariser
    assert b.loss_combiner is a.loss_combiner and b.optimizer is not a.optimizer
    graph_reuse.forget()
    fresh, fresh_final = fit(b_cfg, data, tmp_path / "fresh")
    assert fresh.model is not a.model
    scores = [k for k in fresh_final if k.startswith(("val/", "train/loss"))]
    assert len(scores) > 10
    assert {k: b_final[k] for k in scores} == {k: fresh_final[k] for k in scores}
    for key, value in weights(fresh).items():
        assert torch.equal(weights(b)[key], value), key
    assert [h["train/loss_sst"] for h in b.history[1:]] == [
        h["train/loss_sst"] for h in fresh.history[1:]]


def test_another_structure_builds_its_own(tiny_config, tmp_path, graphs_on_cpu):
    """A SMART term switched on, or a setting the graphs are built from, is another
    structure: the trainer drops what was kept and builds its own model."""
    cfg = tiny_config(max_examples=32, eval_every=32, eval_dev=False, eval_at_start=False)
    data = load_data(cfg)
    first, _ = fit(cfg, data, tmp_path / "a")
    second, _ = fit(cfg.replace(smart_lambda_qqp=1.0), data, tmp_path / "b")
    assert second.model is not first.model
    third, _ = fit(cfg.replace(smart_lambda_qqp=1.0, pooling="cls"), data, tmp_path / "c")
    assert third.model is not second.model
    fourth, _ = fit(cfg.replace(smart_lambda_qqp=3.0, pooling="cls", lr=1e-4), data,
                    tmp_path / "d")
    assert fourth.model is third.model


def test_what_an_ended_trainer_leaves(tiny_config, tmp_path, graphs_on_cpu):
    """A stopped (SystemExit) or diverged trainer leaves its step; one that failed
    otherwise, or trained a caller's own model, leaves nothing."""
    cfg = tiny_config(max_examples=32, eval_every=16, eval_dev=False, eval_at_start=False)
    data = load_data(cfg)

    def stop(metrics, checkpoint_dir):
        raise SystemExit(0)

    trainer = Trainer(cfg, data, tmp_path / "stopped", report=stop)
    with pytest.raises(SystemExit):
        trainer.fit()
    model, ended = trainer.model, weakref.ref(trainer)
    del trainer
    gc.collect()
    assert ended() is None  # what is kept does not hold the trainer (its optimizer, buffers)
    assert graph_reuse.take(graph_reuse.structure(cfg)).parts.model is model

    diverging = cfg.replace(loss_weighting="fixed", w_qqp=1e39, schedule="sequential",
                            max_examples=100, eval_every=100)
    trainer = Trainer(diverging, data, tmp_path / "nan")
    with pytest.raises(NonFiniteLossError):
        trainer.fit()
    assert graph_reuse.take(graph_reuse.structure(diverging)).parts.model is trainer.model

    def fail(metrics, checkpoint_dir):
        raise OSError("disk full")

    trainer = Trainer(cfg, data, tmp_path / "failed", report=fail)
    with pytest.raises(OSError):
        trainer.fit()
    assert graph_reuse.take(graph_reuse.structure(cfg)) is None
    Trainer(cfg, data, tmp_path / "own", model=MultitaskModel.from_config(cfg)).fit()
    assert graph_reuse.take(graph_reuse.structure(cfg)) is None
