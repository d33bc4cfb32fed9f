"""PCGrad (Yu et al. 2020): the projection on hand-made vectors, the combiner on a real
model against independently computed per-task gradients, and a real training run with
PCGrad + SMART + uncertainty weighting."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from mtbert.data import collate, encoding_for, load_data
from mtbert.techniques.gradients import (PCGradGradients, SumGradients, build_gradient_combiner, pcgrad,
                              project_conflicting, random_orders)
from mtbert.techniques.losses import UncertaintyCombiner, task_loss
from mtbert.model.model import MultitaskModel
from mtbert.loop.trainer import Trainer

TASKS = ("sst", "qqp", "sts")


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def vec(*xs):
    return torch.tensor(xs, dtype=torch.float64)


# ------------------------------------------------------------------ the projection
def test_two_conflicting_vectors():
    g1, g2 = vec(1.0, 0.0), vec(-1.0, 1.0)  # g1·g2 = −1
    p1, p2 = project_conflicting([g1, g2], orders=[[1], [0]])
    assert torch.equal(p1, vec(0.5, 0.5))   # g1 − (−1/2) g2
    assert torch.equal(p2, vec(0.0, 1.0))   # g2 − (−1/1) g1
    total = p1 + p2
    assert torch.dot(total, g1) >= 0 and torch.dot(total, g2) >= 0
    # random conflicting pairs in many dimensions
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        a, b = torch.randn(50, generator=gen, dtype=torch.float64), torch.randn(50, generator=gen, dtype=torch.float64)
        if torch.dot(a, b) >= 0:
            b = b - 2 * torch.dot(a, b) / torch.dot(a, a) * a  # reflect: now conflicting
        assert torch.dot(a, b) < 0
        pa, pb = project_conflicting([a, b])
        assert abs(torch.dot(pa, b).item()) < 1e-9 and abs(torch.dot(pb, a).item()) < 1e-9
        total = pcgrad([a, b])
        assert torch.dot(total, a).item() >= -1e-9 and torch.dot(total, b).item() >= -1e-9
        assert torch.allclose(total, pa + pb)


def test_non_conflicting_gradients_pass_unchanged():
    gen = torch.Generator().manual_seed(1)
    grads = [torch.rand(40, generator=gen) for _ in range(3)]  # positive entries: all dots > 0
    grads.append(torch.zeros(40))  # a task that does not reach the shared weights
    out = project_conflicting(grads)
    assert all(torch.equal(o, g) for o, g in zip(out, grads))
    assert torch.equal(pcgrad(grads), grads[0] + grads[1] + grads[2] + grads[3])
    # orthogonal is not conflicting either
    assert torch.equal(pcgrad([vec(1, 0), vec(0, 3)]), vec(1, 3))


def test_three_tasks_by_hand():
    g = [vec(2.0, 0.0), vec(-1.0, 1.0), vec(0.0, -1.0)]
    # g1·g2 = −2, g1·g3 = 0, g2·g3 = −1; ‖g1‖² = 4, ‖g2‖² = 2, ‖g3‖² = 1
    # order A: task 1 vs (2, 3): (2,0) → (2,0)+(−1,1) = (1,1) → (1,1)+(0,−1) = (1,0)
    #          task 2 vs (1, 3): (−1,1) → (−1,1)+(1,0) = (0,1) → (0,1)+(0,−1) = (0,0)
    #          task 3 vs (1, 2): (0,−1) → unchanged → (0,−1)+(−.5,.5) = (−.5,−.5)
    out = project_conflicting(g, orders=[[1, 2], [0, 2], [0, 1]])
    assert [o.tolist() for o in out] == [[1.0, 0.0], [0.0, 0.0], [-0.5, -0.5]]
    assert pcgrad(g, orders=[[1, 2], [0, 2], [0, 1]]).tolist() == [0.5, -0.5]
    # order B: task 1 vs (3, 2): (2,0) → (1,1); task 2 vs (3, 1): (−1,0) → (0,0);
    #          task 3 vs (2, 1): (−.5,−.5) → (−.5,−.5) + (1/4)(2,0) = (0,−.5)
    out = project_conflicting(g, orders=[[2, 1], [2, 0], [1, 0]])
    assert [o.tolist() for o in out] == [[1.0, 1.0], [0.0, 0.0], [0.0, -0.5]]
    assert all(torch.equal(a, b) for a, b in zip(g, [vec(2.0, 0.0), vec(-1.0, 1.0), vec(0.0, -1.0)]))
    # random order from torch's global RNG: reproducible, each task lands on one of its two
    # hand-computed outcomes, and both outcomes occur over seeds
    seen = {0: set(), 2: set()}
    for seed in range(20):
        torch.manual_seed(seed)
        first = project_conflicting(g)
        torch.manual_seed(seed)
        assert all(torch.equal(a, b) for a, b in zip(first, project_conflicting(g)))
        assert first[0].tolist() in ([1.0, 0.0], [1.0, 1.0])
        assert first[1].tolist() == [0.0, 0.0]
        assert first[2].tolist() in ([-0.5, -0.5], [0.0, -0.5])
        seen[0].add(tuple(first[0].tolist()))
        seen[2].add(tuple(first[2].tolist()))
    assert len(seen[0]) == 2 and len(seen[2]) == 2


def test_the_trial_axis_projection_is_each_trial_s_own():
    """One projection for N trials (``[N, D]`` gradients, each trial's orders as ``[N]``
    tensors, :func:`trial_orders`) gives each trial what the one-trial projection gives it
    with its own orders, also for a trial that lacks a task in the step."""
    from mtbert.techniques.gradients import trial_orders

    gen = torch.Generator().manual_seed(3)
    tasks = ["sst", "qqp", "sts"]
    trial_tasks = [["sst", "qqp", "sts"], ["sts", "sst"], ["qqp", "sts", "sst"], None]
    drawn = {0: [[2, 1], [0, 2], [1, 0]], 1: [[1], [0]], 2: [[1, 2], [2, 0], [0, 1]]}
    grads = [torch.randn(4, 30, generator=gen, dtype=torch.float64) for _ in tasks]
    for n, own in enumerate(trial_tasks):  # a task a trial does not train: g = 0 there
        for t, task in enumerate(tasks):
            if own is None or task not in own:
                grads[t][n] = 0.0
    orders = trial_orders(tasks, trial_tasks, lambda n, count: drawn[n], torch.device("cpu"))
    together = pcgrad(grads, orders)
    for n, own in enumerate(trial_tasks):
        if own is None:
            assert torch.equal(together[n], torch.zeros(30, dtype=torch.float64))
            continue
        mine = [grads[tasks.index(t)][n] for t in own]
        alone = pcgrad(mine, drawn[n])
        assert torch.allclose(together[n], alone, rtol=1e-14, atol=1e-15), n


def test_random_orders_are_permutations_of_the_others():
    torch.manual_seed(0)
    orders = random_orders(4)
    for i, order in enumerate(orders):
        assert sorted(order) == [j for j in range(4) if j != i]


# ------------------------------------------------------------------ the combiner on a model
@pytest.fixture(scope="module")
def setup(tiny_model_dir, tiny_data_dir):
    from mtbert.core.config import TrainConfig

    cfg = TrainConfig(model=tiny_model_dir, data_dir=tiny_data_dir, batch_size=8, epochs=1,
                      max_length=32, progress=False, threads=1, dropout=0.0, update="summed",
                      pcgrad=True)
    return cfg, load_data(cfg)


def batches(cfg, data, tasks=TASKS):
    return {t: collate(data.split(t, "train"), np.arange(8), encoding_for(t, cfg.pair_encoding),
                       data.pad_id) for t in tasks}


def fresh_model(cfg):
    torch.manual_seed(0)
    return MultitaskModel.from_config(cfg)


def losses_of(model, cfg, bs, combiner=None):
    losses = {t: task_loss(t, model(t, b), b["labels"], cfg) for t, b in bs.items()}
    return combiner.weighted(losses) if combiner is not None else losses


def grads_of(model):
    return {n: (p.grad.clone() if p.grad is not None else None)
            for n, p in model.named_parameters()}


def test_one_task_equals_plain_backprop(setup):
    cfg, data = setup
    assert isinstance(build_gradient_combiner(cfg), PCGradGradients)
    for task in TASKS:
        bs = batches(cfg, data, (task,))
        plain_model, pc_model = fresh_model(cfg), fresh_model(cfg)
        SumGradients().backward(losses_of(plain_model, cfg, bs), plain_model.shared_parameters())
        PCGradGradients().backward(losses_of(pc_model, cfg, bs), pc_model.shared_parameters())
        plain, pc = grads_of(plain_model), grads_of(pc_model)
        for name in plain:
            if plain[name] is None:
                assert pc[name] is None, name  # e.g. the unused pooler stays without a grad
            else:
                assert torch.equal(plain[name], pc[name]), (task, name)


def test_three_tasks_match_independent_per_task_gradients(setup):
    cfg, data = setup
    bs = batches(cfg, data)
    # reference: autograd.grad of each task loss separately, then pcgrad on the flat vectors
    ref_model = fresh_model(cfg)
    ref_comb = UncertaintyCombiner()
    with torch.no_grad():
        for t, v in zip(TASKS, (0.3, -0.2, 0.1)):
            ref_comb.s[t].fill_(v)
    shared = ref_model.shared_parameters()
    heads = [p for n, p in ref_model.named_parameters() if not n.startswith("encoder.")]
    weighted = losses_of(ref_model, cfg, bs, ref_comb)
    flats, head_sum, s_grads = [], [torch.zeros_like(p) for p in heads], {}
    for t in TASKS:
        g = torch.autograd.grad(weighted[t], shared + heads + [ref_comb.s[t]],
                                retain_graph=True, allow_unused=True)
        flats.append(torch.cat([(x if x is not None else torch.zeros_like(p)).reshape(-1)
                                for x, p in zip(g[:len(shared)], shared)]))
        for k, x in enumerate(g[len(shared):len(shared) + len(heads)]):
            if x is not None:
                head_sum[k] += x
        s_grads[t] = g[-1]
    penalty = 1e-3 * sum(p.pow(2).sum() for p in shared)
    penalty_grad = torch.cat([g.reshape(-1) for g in torch.autograd.grad(penalty, shared)])
    assert any(torch.dot(flats[i], flats[j]) < 0 for i in range(3) for j in range(3)), \
        "the example should contain a conflict"
    torch.manual_seed(11)
    expected_shared = pcgrad(flats) + penalty_grad

    model = fresh_model(cfg)
    comb = UncertaintyCombiner()
    comb.load_state_dict(ref_comb.state_dict())
    weighted = losses_of(model, cfg, bs, comb)
    penalty = 1e-3 * sum(p.pow(2).sum() for p in model.shared_parameters())
    torch.manual_seed(11)
    PCGradGradients().backward(weighted, model.shared_parameters(), penalty)
    got = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                     for p in model.shared_parameters()])
    assert torch.allclose(got, expected_shared, rtol=1e-5, atol=1e-8)
    # plain sum would differ: the projection did something
    assert not torch.allclose(got, sum(flats) + penalty_grad, rtol=1e-3, atol=1e-6)
    model_heads = [p for n, p in model.named_parameters() if not n.startswith("encoder.")]
    for p, expected in zip(model_heads, head_sum):
        assert torch.allclose(p.grad, expected, rtol=1e-6, atol=1e-9)
    for t in TASKS:  # learned weights: ordinary gradient 1 − exp(−s)·L
        assert torch.allclose(comb.s[t].grad, s_grads[t])
    # no task loss reaches the pooler: its gradient is the (unprojected) penalty's alone
    pooler = model.encoder.pooler.dense.weight
    assert torch.allclose(pooler.grad, 2e-3 * pooler.detach(), rtol=1e-6, atol=0)


# ------------------------------------------------------------------ the real trainer
def test_trainer_with_pcgrad_and_smart(tiny_config, tmp_path):
    cfg = tiny_config(epochs=6, lr=3e-3, eval_dev=False, schedule="round_robin", update="summed",
                      pcgrad=True, smart_lambda_sst=1.0, smart_lambda_qqp=1.0, smart_lambda_sts=1.0,
                      smart_mu=0.5, smart_eps=1e-3, smart_step_size=1e-2, smart_noise=1e-5,
                      loss_weighting="uncertainty", l2_lambda=1e-5)
    trainer = Trainer(cfg, load_data(cfg), tmp_path)
    assert isinstance(trainer.grad_combiner, PCGradGradients)
    trainer.fit()
    first, last = trainer.history[1], trainer.history[-1]  # [0]: the 0-example evaluation
    for m in trainer.history:
        assert all(math.isfinite(v) for k, v in m.items() if isinstance(v, float)), m
    for task in ("sst", "sts"):
        assert last[f"train/loss_{task}"] < 0.9 * first[f"train/loss_{task}"], task
    # the learned loss weights moved away from 0
    assert any(abs(p.item()) > 1e-4 for p in trainer.loss_combiner.s.values())
