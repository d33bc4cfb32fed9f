"""SMART (Jiang et al. 2020): the divergences ℓ_s, the adversarial regulariser R_s, the
EMA Bregman teacher, and exact resume of a SMART run."""

from __future__ import annotations

import copy
import io
import math
import shutil

import numpy as np
import pytest
import torch

from mtbert.core.trial_streams import MaskStream
from mtbert.data import collate, encoding_for, load_data
from mtbert.model.dropout_rate import hold_dropout_in_tensor
from mtbert.model.fused_attention import draw_attention_from
from mtbert.model.model import MultitaskModel
from mtbert.techniques.smart import (SmartRegulariser, build_regulariser, divergence, smart_output,
                          symmetric_kl_bernoulli, symmetric_kl_logits)
from mtbert.loop.trainer import Trainer

MASK_KEY = {"input": "attention_mask", "a": "attention_mask_a", "b": "attention_mask_b"}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def setup(tiny_config):
    return tiny_config, load_data(tiny_config())


def model_for(cfg, seed=0, double=False):
    torch.manual_seed(seed)
    model = MultitaskModel.from_config(cfg)
    return model.double() if double else model


def trial_masks(model, reg, p: float) -> MaskStream:
    """The model's dropouts (at ``p``) and the regulariser on a trial's masks and stream, as
    a TrialRun gives them; the mask stream's seed drawn as a step begins."""
    stream = torch.Generator().manual_seed(0)
    masks = MaskStream(1, torch.device("cpu"))
    hold_dropout_in_tensor(model, p, torch.device("cpu"), number=True).masks = masks
    draw_attention_from(model, masks, torch.device("cpu"))
    reg.draw_from(stream, masks)
    masks.draw({0: stream})
    return masks


def batch_for(data, task, pair_encoding, start=0, size=8):
    split = data.split(task, "train")
    return collate(split, np.arange(start, start + size), encoding_for(task, pair_encoding),
                   data.pad_id)


# ------------------------------------------------------------------ ℓ_s by hand
def test_symmetric_kl_matches_hand_computation():
    p = torch.tensor([[math.log(0.5), math.log(0.25), math.log(0.25)]], dtype=torch.float64)
    q = torch.tensor([[math.log(0.25), math.log(0.5), math.log(0.25)]], dtype=torch.float64)
    # KL(P‖Q) = .5 ln 2 + .25 ln .5 = .25 ln 2, KL(Q‖P) the same: total .5 ln 2
    assert symmetric_kl_logits(p, q).item() == pytest.approx(0.5 * math.log(2), abs=1e-12)
    assert symmetric_kl_logits(p + 7.0, q).item() == pytest.approx(0.5 * math.log(2), abs=1e-12)
    # batch mean against the textbook four-term formula, random rows
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(16, 5, generator=g, dtype=torch.float64), torch.randn(16, 5, generator=g, dtype=torch.float64)
    P, Q = a.softmax(-1), b.softmax(-1)
    expected = ((P * (P / Q).log()).sum(-1) + (Q * (Q / P).log()).sum(-1)).mean()
    assert symmetric_kl_logits(a, b).item() == pytest.approx(expected.item(), rel=1e-12)
    assert symmetric_kl_logits(a, a).item() == 0.0


def test_bernoulli_symmetric_kl_closed_form():
    a = torch.tensor([2.0, -1.0, 0.3], dtype=torch.float64)
    b = torch.tensor([-0.5, -1.0, 1.7], dtype=torch.float64)
    pa, pb = torch.sigmoid(a), torch.sigmoid(b)

    def kl(p, q):
        return p * (p / q).log() + (1 - p) * ((1 - p) / (1 - q)).log()
    expected = (kl(pa, pb) + kl(pb, pa)).mean()
    assert symmetric_kl_bernoulli(a, b).item() == pytest.approx(expected.item(), rel=1e-12)
    # hand value for the first pair: (σ(2) − σ(−.5))·2.5
    assert symmetric_kl_bernoulli(a[:1], b[:1]).item() == pytest.approx(
        (1 / (1 + math.exp(-2)) - 1 / (1 + math.exp(0.5))) * 2.5, rel=1e-12)
    # stable for large logits where σ saturates
    big = symmetric_kl_bernoulli(torch.tensor([40.0]), torch.tensor([-40.0])).item()
    assert big == pytest.approx(80.0, rel=1e-6)


def test_divergences_are_nonnegative_and_zero_on_equal_outputs():
    g = torch.Generator().manual_seed(1)
    for task, shape in (("sst", (32, 5)), ("qqp", (32,)), ("sts", (32,))):
        for _ in range(20):
            p, q = torch.randn(*shape, generator=g) * 3, torch.randn(*shape, generator=g) * 3
            assert divergence(task, p, q).item() >= 0
            assert divergence(task, p, q).item() == pytest.approx(divergence(task, q, p).item())
        assert divergence(task, p, p).item() == 0.0
    assert divergence("sts", torch.tensor([1.0, 3.0]), torch.tensor([2.0, 1.0])).item() == 2.5


# ------------------------------------------------------------------ building / plain loss
def test_all_zero_weights_give_no_regulariser_and_plain_loss(setup):
    make, data = setup
    assert build_regulariser(make(), model_for(make())) is None
    # λ only for SST and μ = 0: the QQP and STS terms are exactly 0.0 (their loss unchanged)
    cfg = make(smart_lambda_sst=2.0)
    model = model_for(cfg)
    reg = build_regulariser(cfg, model)
    assert isinstance(reg, SmartRegulariser) and reg.teacher is None  # no teacher kept
    for task in ("qqp", "sts"):
        batch = batch_for(data, task, cfg.pair_encoding)
        out = model(task, batch)
        term = reg.term(model, task, batch, out)
        assert term.item() == 0.0 and not term.requires_grad
    batch = batch_for(data, "sst", cfg.pair_encoding)
    assert reg.term(model, "sst", batch, model(task="sst", batch=batch)).item() > 0


# ------------------------------------------------------------------ R_s
@pytest.mark.parametrize("pair_encoding", ["cross", "siamese"])
def test_regulariser_nonnegative_and_zero_for_zero_perturbation(setup, pair_encoding):
    """In *train* mode (dropout 0.3 on): the perturbed forwards replay the clean forward's
    dropout masks, so δ = 0 gives exactly 0 and the adversarial δ gives > 0."""
    make, data = setup
    cfg = make(pair_encoding=pair_encoding, dropout=0.3, smart_lambda_sst=1.0,
               smart_lambda_qqp=1.0, smart_lambda_sts=1.0, smart_eps=1e-3,
               smart_step_size=1e-2, smart_noise=1e-6)
    model = model_for(cfg, double=True).train()
    reg = SmartRegulariser(cfg, model)
    masks = trial_masks(model, reg, 0.3)  # the masks and ν of a trial's stream
    for task in ("sst", "qqp", "sts"):
        batch = batch_for(data, task, pair_encoding)
        masks.start(task)  # its task's forward begins
        clean = model(task, batch)
        rng = reg._replay_state(task, batch)
        assert rng is not None, "the pre-hook did not record the clean forward"
        x = {k: e.detach() for k, e in model.embed_inputs(task, batch).items()}
        zero = {k: torch.zeros_like(v) for k, v in x.items()}
        assert reg.divergence_at(model, task, batch, clean, x, zero, rng).item() == 0.0
        # without replaying the masks the same δ = 0 would not give 0 (dropout differs)
        assert reg.divergence_at(model, task, batch, clean, x, zero, None).item() > 0
        _, delta = reg.perturbation(model, task, batch, clean, rng)
        value = reg.divergence_at(model, task, batch, clean, x, delta, rng)
        assert value.item() > 0 and value.requires_grad


@pytest.mark.parametrize("pair_encoding", ["cross", "siamese"])
def test_perturbation_stays_in_eps_ball_on_real_tokens(setup, pair_encoding):
    make, data = setup
    eps = 2e-4
    cfg = make(pair_encoding=pair_encoding, smart_lambda_qqp=1.0, smart_eps=eps,
               smart_step_size=1e-2, smart_noise=1e-4, smart_steps=3)
    model = model_for(cfg).eval()
    reg = SmartRegulariser(cfg, model)
    batch = batch_for(data, "qqp", pair_encoding)
    _, delta = reg.perturbation(model, "qqp", batch, model("qqp", batch))
    for key, d in delta.items():
        mask = batch[MASK_KEY[key]].bool()
        assert d.abs().max().item() <= eps * (1 + 1e-6)
        assert (d[~mask] == 0).all()  # padding is never perturbed
        # a step of 1e-2 ≫ ε saturates the largest-gradient coordinates at ±ε
        assert d.abs().max().item() == pytest.approx(eps)


@pytest.mark.parametrize("pair_encoding", ["cross", "siamese"])
def test_adversarial_beats_random_noise_of_the_same_norm(setup, pair_encoding):
    """On a fixed model (eval, float64) the ascent direction finds a much larger divergence
    than random directions with the same per-example L2 norm (the max over 8 draws)."""
    make, data = setup
    cfg = make(pair_encoding=pair_encoding, smart_lambda_sst=1.0, smart_lambda_qqp=1.0,
               smart_lambda_sts=1.0, smart_eps=1e-3, smart_step_size=1e-2, smart_noise=1e-6)
    model = model_for(cfg, double=True).eval()
    reg = SmartRegulariser(cfg, model)
    gen = torch.Generator().manual_seed(0)
    for task in ("sst", "qqp", "sts"):
        for start in (0, 16, 32):
            batch = batch_for(data, task, pair_encoding, start=start)
            clean = model(task, batch)
            x, delta = reg.perturbation(model, task, batch, clean)
            adv = reg.divergence_at(model, task, batch, clean, x, delta).item()
            norm = torch.sqrt(sum(d.pow(2).sum((1, 2)) for d in delta.values())).view(-1, 1, 1)
            best_random = 0.0
            for _ in range(8):
                r = {k: torch.randn(d.shape, generator=gen, dtype=d.dtype)
                     * batch[MASK_KEY[k]].unsqueeze(-1) for k, d in delta.items()}
                r_norm = torch.sqrt(sum(v.pow(2).sum((1, 2)) for v in r.values())).view(-1, 1, 1)
                r = {k: v * norm / r_norm for k, v in r.items()}
                best_random = max(best_random,
                                  reg.divergence_at(model, task, batch, clean, x, r).item())
            assert adv > 5 * best_random, (task, start, adv, best_random)


def test_noise_comes_from_the_global_rng(setup):
    make, data = setup
    cfg = make(smart_lambda_sst=1.0, smart_noise=1e-2, smart_eps=1e-1, smart_step_size=1e-3)
    model = model_for(cfg).eval()
    reg = SmartRegulariser(cfg, model)
    batch = batch_for(data, "sst", "cross")
    clean = model("sst", batch)
    values = []
    for seed in (5, 5, 6):
        torch.manual_seed(seed)
        values.append(reg.term(model, "sst", batch, clean).item())
        # one randn per embedding element was drawn from the global stream
        after = torch.randn(()).item()
        torch.manual_seed(seed)
        torch.randn(batch["input_ids"].shape + (32,))
        assert torch.randn(()).item() == after
    assert values[0] == values[1] != values[2]


# ------------------------------------------------------------------ Bregman teacher
def test_teacher_follows_the_ema_formula(setup):
    make, data = setup
    beta = 0.75
    cfg = make(smart_mu=1.0, smart_beta=beta)
    model = model_for(cfg)
    reg = build_regulariser(cfg, model)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert list(reg.teacher) == names
    expected = {n: p.detach().clone() for n, p in model.named_parameters()}
    for step in range(3):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        reg.after_step(model)
        params = dict(model.named_parameters())
        for n in names:
            formula = beta * expected[n] + (1 - beta) * params[n].detach()
            # computed as one lerp, θ̃ + (1 − β)(θ − θ̃): exactly that, and the β-form to
            # float32 rounding
            expected[n] = torch.lerp(expected[n], params[n].detach(), 1 - beta)
            assert torch.equal(reg.teacher[n], expected[n]), (step, n)
            torch.testing.assert_close(reg.teacher[n], formula, rtol=1e-6, atol=1e-6,
                                       msg=f"step {step}, {n}")
    # the teacher is a copy, not a view of the live weights
    assert all(reg.teacher[n].data_ptr() != params[n].data_ptr() for n in names)


def test_bregman_zero_for_equal_teacher_and_exact_after_drift(setup):
    make, data = setup
    mu = 0.7
    cfg = make(smart_mu=mu, smart_beta=0.5, dropout=0.3)
    model = model_for(cfg).train()
    reg = build_regulariser(cfg, model)
    masks = trial_masks(model, reg, 0.3)
    for task in ("sst", "qqp", "sts"):
        batch = batch_for(data, task, cfg.pair_encoding)
        masks.start(task)
        # θ̃ = θ and the same dropout masks (train mode): exactly 0
        assert reg.term(model, task, batch, model(task, batch)).item() == 0.0
    original = copy.deepcopy(model).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model.eval()
    for task in ("sst", "qqp", "sts"):
        batch = batch_for(data, task, cfg.pair_encoding)
        out = model(task, batch)
        term = reg.term(model, task, batch, out)
        teacher = original(task, batch)
        expected = mu * divergence(task, smart_output(task, out), smart_output(task, teacher))
        assert term.item() > 0
        assert term.item() == pytest.approx(expected.item(), rel=1e-5)
    # the gradient reaches the student, not the teacher copy
    term.backward()
    assert model.sts_out.weight.grad is not None
    assert all(not t.requires_grad and t.grad is None for t in reg.teacher.values())


def test_teacher_state_roundtrips_through_weights_only_load(setup):
    make, _ = setup
    cfg = make(smart_mu=0.5, smart_lambda_sts=1.0)
    model = model_for(cfg)
    reg = build_regulariser(cfg, model)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)
    reg.after_step(model)
    buffer = io.BytesIO()
    torch.save(reg.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    other = build_regulariser(cfg, model_for(cfg, seed=3))
    other.load_state_dict(state)
    assert all(torch.equal(other.teacher[n], reg.teacher[n]) for n in reg.teacher)


# ------------------------------------------------------------------ the real trainer
def test_resume_with_smart_is_exact(setup, tmp_path):
    make, data = setup
    cfg = make(epochs=2, eval_every=48, max_examples=144, update="summed",
               schedule="round_robin", dropout=0.2, eval_dev=False, smart_lambda_sst=1.0,
               smart_lambda_qqp=0.5, smart_lambda_sts=1.0, smart_mu=0.5, smart_beta=0.9,
               smart_eps=1e-3, smart_step_size=1e-2, smart_noise=1e-5)
    straight = Trainer(cfg, data, tmp_path / "a")
    final = straight.fit()
    middle = tmp_path / "middle"

    class Stop(Exception):
        pass

    def stop_after_first(metrics, checkpoint_dir):
        if metrics["examples_seen"] == 0:  # the evaluation before the first step goes on
            return
        shutil.copytree(checkpoint_dir, middle)
        raise Stop

    with pytest.raises(Stop):
        Trainer(cfg, data, tmp_path / "b", report=stop_after_first).fit()
    state = torch.load(middle / "state.pt", weights_only=True)
    assert state["regulariser"]["teacher"], "the teacher is saved in the checkpoint"
    resumed = Trainer(cfg, data, tmp_path / "b", resume_from=middle)
    assert 48 <= resumed.examples_seen < cfg.max_examples
    again = resumed.fit()
    keys = [k for k in final if k.startswith(("val/", "train/")) and "confusion" not in k]
    assert keys and all(final[k] == again[k] for k in keys), {
        k: (final[k], again[k]) for k in keys if final[k] != again[k]}
    for (name, p), q in zip(straight.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(p, q), name
