"""Loss combination: sum, fixed and uncertainty weights (Kendall et al. 2018), the L1/L2
weight penalties (report 002), and the STS cosine losses, against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from mtbert.core.config import TrainConfig
from mtbert.techniques.losses import (FixedCombiner, SumCombiner, UncertaintyCombiner, build_loss_combiner,
                           penalised_parameters, sts_loss)
from mtbert.model.model import TaskOutput


def cfg(**kw):
    return TrainConfig(**kw)


LOSSES = {"sst": 1.5, "qqp": 0.25, "sts": 3.0}


def losses():
    return {t: torch.tensor(v, requires_grad=True) for t, v in LOSSES.items()}


def test_builder_picks_the_combiner():
    assert type(build_loss_combiner(cfg())) is SumCombiner
    assert type(build_loss_combiner(cfg(loss_weighting="fixed"))) is FixedCombiner
    assert type(build_loss_combiner(cfg(loss_weighting="uncertainty"))) is UncertaintyCombiner


def test_sum_and_fixed():
    out = build_loss_combiner(cfg()).weighted(losses())
    assert {t: v.item() for t, v in out.items()} == LOSSES
    fixed = build_loss_combiner(cfg(loss_weighting="fixed", w_sst=0.5, w_qqp=2.0, w_sts=0.0))
    out = fixed.weighted(losses())
    assert {t: v.item() for t, v in out.items()} == {"sst": 0.75, "qqp": 0.5, "sts": 0.0}


def test_uncertainty_is_the_sum_at_zero_and_gets_gradients():
    comb = build_loss_combiner(cfg(loss_weighting="uncertainty"))
    params = dict(comb.named_parameters())
    assert set(params) == {"s.sst", "s.qqp", "s.sts"}
    assert all(isinstance(p, nn.Parameter) and p.requires_grad and p.item() == 0.0
               for p in params.values())
    ls = losses()
    out = comb.weighted(ls)
    assert {t: v.item() for t, v in out.items()} == LOSSES  # exp(0)·L + 0 = L, exactly
    sum(out.values()).backward()
    for t, value in LOSSES.items():
        # d/ds [exp(−s)·L + s] = 1 − exp(−s)·L = 1 − L at s = 0; d/dL = exp(−s) = 1
        assert comb.s[t].grad.item() == pytest.approx(1 - value)
        assert ls[t].grad.item() == 1.0


def test_uncertainty_formula_and_optimum():
    comb = UncertaintyCombiner()
    s = {"sst": 0.5, "qqp": -1.0, "sts": 2.0}
    with torch.no_grad():
        for t, v in s.items():
            comb.s[t].fill_(v)
    out = comb.weighted(losses())
    for t in LOSSES:
        assert out[t].item() == pytest.approx(math.exp(-s[t]) * LOSSES[t] + s[t], rel=1e-6)
    # only the tasks present in the step are weighted (per_task updates)
    assert set(comb.weighted({"qqp": torch.tensor(1.0)})) == {"qqp"}
    # gradient descent on s alone reaches the analytic optimum s* = log L
    comb = UncertaintyCombiner()
    opt = torch.optim.SGD(comb.parameters(), lr=0.2)
    fixed = {t: torch.tensor(v) for t, v in LOSSES.items()}
    for _ in range(400):
        opt.zero_grad()
        sum(comb.weighted(fixed).values()).backward()
        opt.step()
    for t, v in LOSSES.items():
        assert comb.s[t].item() == pytest.approx(math.log(v), abs=1e-4)


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.LayerNorm = nn.LayerNorm(2)
        self.emb = nn.Embedding(3, 1)
        with torch.no_grad():
            self.lin.weight.copy_(torch.tensor([[1.0, -2.0], [0.5, 0.0]]))
            self.lin.bias.fill_(10.0)
            self.LayerNorm.weight.fill_(7.0)
            self.LayerNorm.bias.fill_(-7.0)
            self.emb.weight.copy_(torch.tensor([[3.0], [-1.0], [0.0]]))


@pytest.mark.parametrize("weighting", ["sum", "fixed", "uncertainty"])
def test_penalties_add_the_right_amount(weighting):
    model = Tiny()
    assert [id(p) for p in penalised_parameters(model)] == [id(model.lin.weight), id(model.emb.weight)]
    assert build_loss_combiner(cfg(loss_weighting=weighting)).penalty(model) is None
    # weights (biases and LayerNorm excluded): 1, −2, .5, 0, 3, −1, 0
    l1_sum, l2_sum = 1 + 2 + 0.5 + 3 + 1, 1 + 4 + 0.25 + 9 + 1
    comb = build_loss_combiner(cfg(loss_weighting=weighting, l1_lambda=0.1))
    assert comb.penalty(model).item() == pytest.approx(0.1 * l1_sum)
    comb = build_loss_combiner(cfg(loss_weighting=weighting, l2_lambda=0.01))
    assert comb.penalty(model).item() == pytest.approx(0.01 * l2_sum)
    comb = build_loss_combiner(cfg(loss_weighting=weighting, l1_lambda=0.1, l2_lambda=0.01))
    penalty = comb.penalty(model)
    assert penalty.item() == pytest.approx(0.1 * l1_sum + 0.01 * l2_sum)
    penalty.backward()
    w = model.lin.weight.detach()
    assert torch.allclose(model.lin.weight.grad, 0.1 * torch.sign(w) + 0.02 * w)
    assert model.lin.bias.grad is None and model.LayerNorm.weight.grad is None


def test_penalty_on_the_real_model_excludes_biases_and_layernorm(tiny_config):
    from mtbert.model.model import MultitaskModel
    config = tiny_config(l2_lambda=1e-3)
    model = MultitaskModel.from_config(config)
    names = {id(p): n for n, p in model.named_parameters()}
    chosen = [names[id(p)] for p in penalised_parameters(model)]
    assert "encoder.embeddings.word_embeddings.weight" in chosen and "sst_out.weight" in chosen
    assert not any("LayerNorm" in n or n.endswith("bias") for n in chosen)
    expected = 1e-3 * sum(p.detach().pow(2).sum() for p in penalised_parameters(model))
    assert build_loss_combiner(config).penalty(model).item() == pytest.approx(expected.item(), rel=1e-5)


# ------------------------------------------------------------------ STS cosine losses
def sts_output(head_score=None):
    u = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 2.0]])
    v = torch.tensor([[1.0, 0.0], [0.0, 3.0], [0.0, -1.0]])   # cos = 1, 0, −1
    return TaskOutput(score=head_score, u=u, v=v)


def test_sts_cosine_mse():
    y = torch.tensor([5.0, 1.0, 0.0])
    c = cfg(sts_loss="cosine_mse", sts_head="cosine", sts_cosine_map="report002")
    # cosine scores 2.5·(cos + 1) = 5, 2.5, 0 → squared errors 0, 2.25, 0
    assert sts_loss(sts_output(), y, c).item() == pytest.approx(2.25 / 3)
    # the default map starts at 5·cos = 5, 0, −5 → squared errors 0, 1, 25
    c = cfg(sts_loss="cosine_mse", sts_head="cosine")
    assert sts_loss(sts_output(), y, c).item() == pytest.approx(26 / 3)
    # with a regression head its MSE is added: head scores 4, 1, 1 → errors 1, 0, 1
    c = cfg(sts_loss="cosine_mse", sts_head="regression", sts_cosine_map="report002")
    out = sts_output(torch.tensor([4.0, 1.0, 1.0]))
    assert sts_loss(out, y, c).item() == pytest.approx(2.25 / 3 + 2 / 3)


def test_sts_cosine_embedding():
    y = torch.tensor([5.0, 2.5, 1.0])   # targets +1, +1 (≥ 2.5), −1
    c = cfg(sts_loss="cosine_embedding", sts_head="cosine")
    # +1: 1 − cos → 0 and 1; −1: max(0, cos) → max(0, −1) = 0
    assert sts_loss(sts_output(), y, c).item() == pytest.approx(1 / 3)
    y = torch.tensor([0.0, 0.0, 5.0])   # −1: max(0, 1) = 1, max(0, 0) = 0; +1: 1 − (−1) = 2
    assert sts_loss(sts_output(), y, c).item() == pytest.approx(1.0)
    c = cfg(sts_loss="cosine_embedding", sts_head="regression")
    out = sts_output(torch.tensor([0.0, 0.0, 2.0]))     # head errors 0, 0, 9
    assert sts_loss(out, y, c).item() == pytest.approx(1.0 + 3.0)


def test_trainer_optimises_the_learned_weights(tiny_config, tmp_path):
    from mtbert.data import load_data
    from mtbert.loop.trainer import Trainer
    config = tiny_config(loss_weighting="uncertainty", update="summed", max_examples=72,
                         eval_dev=False, l1_lambda=1e-6)
    trainer = Trainer(config, load_data(config), tmp_path)
    s_params = list(trainer.loss_combiner.parameters())
    grouped = [p for g in trainer.optimizer.param_groups for p in g["params"]]
    assert all(any(p is q for q in grouped) for p in s_params)
    trainer.fit()
    assert all(p.item() != 0.0 for p in s_params)
    state = torch.load(tmp_path / "checkpoint" / "state.pt", weights_only=True)
    assert set(state["loss_combiner"]) == {"s.sst", "s.qqp", "s.sts"}


def test_a_combiner_without_a_fused_form_is_refused_not_summed(tiny_config):
    """A loss combiner the fused step does not know (here a subclass weighting in its own
    way) is an error naming it, not a silent plain sum of the tasks (each at weight 1)."""
    from mtbert.techniques.losses import LossCombiner, build_loss_combiner, stack_combiners

    class Halved(LossCombiner):
        def weighted(self, losses):
            return {t: 0.5 * loss for t, loss in losses.items()}

    cfg = tiny_config(loss_weighting="fixed", w_sst=2.0)
    known = stack_combiners([build_loss_combiner(cfg), build_loss_combiner(tiny_config())],
                            torch.device("cpu"))
    assert known.weights["sst"].tolist() == [2.0, 1.0]
    with pytest.raises(ValueError, match="cannot train fused: loss combiner Halved"):
        stack_combiners([Halved(cfg), Halved(cfg)], torch.device("cpu"))


def test_one_trial_and_a_trial_axis_weigh_alike(tiny_config):
    """The weighting is written once: each trial's slice of the stacked combiners' weighted
    ``[N]`` losses is its own combiner's weighted loss (fixed and uncertainty), and the
    trial-axis penalty each trial's own."""
    from mtbert.techniques.losses import build_loss_combiner, stack_combiners, weight_penalty

    losses = torch.tensor([0.7, 1.3], dtype=torch.float64)
    for kind in ("fixed", "uncertainty"):
        cfgs = [tiny_config(loss_weighting=kind, w_qqp=3.0), tiny_config(loss_weighting=kind)]
        combiners = [build_loss_combiner(c) for c in cfgs]
        if kind == "uncertainty":
            with torch.no_grad():
                combiners[0].s["qqp"].fill_(0.4)
                combiners[1].s["qqp"].fill_(-1.5)
        stacked = stack_combiners(combiners, torch.device("cpu"))
        together = stacked.weighted({"qqp": losses})["qqp"]
        for n, combiner in enumerate(combiners):
            assert together[n].item() == combiner.weighted({"qqp": losses[n]})["qqp"].item()
    weights = [torch.randn(2, 3, 4, dtype=torch.float64), torch.randn(2, 5, dtype=torch.float64)]
    per_trial = weight_penalty(weights, 0.1, 0.01, trial_axis=True)
    for n in range(2):
        alone = weight_penalty([w[n] for w in weights], 0.1, 0.01)
        assert per_trial[n].item() == pytest.approx(alone.item(), rel=1e-15)
