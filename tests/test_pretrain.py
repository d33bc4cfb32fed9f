"""Pre-training stages: the SimCSE loss against its closed forms, the stages on a tiny
model, and the on-disk stage cache (hit, key, corrupt file, two processes racing)."""

from __future__ import annotations

import hashlib
import math
import multiprocessing as mp
from pathlib import Path

import numpy as np
import pytest
import torch

from mtbert.data import load_data, pad_rows
from mtbert.model.model import MultitaskModel
from mtbert.techniques.pretrain import (cache_key, run_pretraining, sentence_vectors, simcse_loss,
                             simcse_sentences, stage_modules)

CPU = torch.device("cpu")


pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ------------------------------------------------------------------ the loss
def simplex(n: int) -> torch.Tensor:
    """n unit vectors with pairwise cosine −1/(n − 1) (centred standard basis)."""
    e = torch.eye(n, dtype=torch.float64)
    return torch.nn.functional.normalize(e - e.mean(0), dim=-1)


@pytest.mark.parametrize("tau", [0.05, 0.5])
def test_simcse_loss_closed_forms(tau):
    n = 6
    # collapse: every sentence has the same vector -> all logits equal -> log n
    z = torch.ones(n, 4)
    assert simcse_loss(z, z, tau).item() == pytest.approx(math.log(n), rel=1e-6)
    # identical views, negatives spread as a regular simplex: the known minimum
    # −log e^{1/τ} / (e^{1/τ} + (n−1) e^{−1/((n−1)τ)}) = log(1 + (n−1) e^{−(1 + 1/(n−1))/τ})
    z = simplex(n)
    minimum = math.log1p((n - 1) * math.exp(-(1 + 1 / (n - 1)) / tau))
    assert simcse_loss(z, z, tau).item() == pytest.approx(minimum, rel=1e-4, abs=1e-6)
    # two antipodal sentences: log(1 + e^{−2/τ})
    z2 = torch.tensor([[1.0, 0.0], [-1.0, 0.0]])
    assert simcse_loss(z2, z2, tau).item() == pytest.approx(math.log1p(math.exp(-2 / tau)), rel=1e-4, abs=1e-7)
    # anything else is not below the minimum: random unit vectors, perturbed simplices,
    # and views that differ
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        r = torch.randn(n, n, generator=gen, dtype=torch.float64)
        assert simcse_loss(r, r, tau).item() >= minimum - 1e-6
        p = z + 0.05 * torch.randn(n, n, generator=gen, dtype=torch.float64)
        assert simcse_loss(p, p, tau).item() >= minimum - 1e-6
        assert simcse_loss(z, p, tau).item() >= minimum - 1e-6
    # scale-free: sim is the cosine
    assert simcse_loss(3 * z, 0.5 * z, tau).item() == pytest.approx(minimum, rel=1e-4, abs=1e-6)


# ------------------------------------------------------------------ the stages
@pytest.fixture(scope="module")
def make(tiny_model_dir, tiny_data_dir, tmp_path_factory):
    from mtbert.core.config import TrainConfig
    cache = str(tmp_path_factory.mktemp("pretrain-cache"))

    def make(**overrides):
        base = dict(model=tiny_model_dir, data_dir=tiny_data_dir, batch_size=8, epochs=1,
                    max_length=32, progress=False, threads=1, pretrain="simcse",
                    pretrain_examples=640, pretrain_lr=1e-3, pretrain_batch_size=32,
                    cache_dir=cache)
        base.update(overrides)
        return TrainConfig(**base)
    return make


@pytest.fixture(scope="module")
def data(make):
    return load_data(make())


def new_model(cfg):
    torch.manual_seed(cfg.seed)
    return MultitaskModel.from_config(cfg)


def state_hash(module) -> str:
    h = hashlib.sha256()
    for k, v in module.state_dict().items():
        h.update(k.encode())
        h.update(v.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def quiet(_msg):
    pass


def fixed_batch_loss(model, data, temp):
    """SimCSE loss of every distinct sentence in one batch, with fixed dropout masks."""
    ids, mask = pad_rows(simcse_sentences(data), data.pad_id)
    with torch.random.fork_rng(), torch.no_grad():
        torch.manual_seed(123)
        model.train()
        z = sentence_vectors(model, torch.cat([ids, ids]), torch.cat([mask, mask]))
    return simcse_loss(*z.chunk(2), temp).item()


def test_simcse_loss_falls_on_a_tiny_model(make, data):
    cfg = make(pretrain_examples=1280, seed=1)
    model = new_model(cfg)
    before = fixed_batch_loss(model, data, cfg.simcse_temp)
    res = run_pretraining(cfg, data, model, CPU, log=quiet)
    after = fixed_batch_loss(model, data, cfg.simcse_temp)
    assert not res.hit and res.examples == 1280 and len(res.losses) >= 1280 // 32
    assert after < 0.7 * before, (before, after)
    assert np.mean(res.losses[-5:]) < 0.7 * np.mean(res.losses[:5]), res.losses
    # the heads are untouched by a SimCSE stage
    fresh = new_model(cfg)
    assert torch.equal(model.sst_out.weight, fresh.sst_out.weight)
    assert not torch.equal(model.encoder.embeddings.word_embeddings.weight,
                           fresh.encoder.embeddings.word_embeddings.weight)


def test_sentences_are_distinct_token_rows(data):
    sentences = simcse_sentences(data)
    assert len({s.tobytes() for s in sentences}) == len(sentences)
    sst = data.split("sst", "train").tokens.a
    assert any(np.array_equal(sst[0], s) for s in sentences)
    assert all(s[0] == 101 and s[-1] == 102 for s in sentences)  # [CLS] .. [SEP]


@pytest.mark.parametrize("stage", ["simcse_sup", "qqp"])
def test_other_stages_train_their_modules(make, data, stage):
    cfg = make(pretrain=stage, pretrain_examples=96, pretrain_batch_size=16)
    model, fresh = new_model(cfg), new_model(cfg)
    res = run_pretraining(cfg, data, model, CPU, log=quiet)
    assert not res.hit and res.examples == 96 and len(res.losses) >= 96 // 16
    assert all(math.isfinite(v) for v in res.losses)
    assert state_hash(model.encoder) != state_hash(fresh.encoder)
    assert torch.equal(model.sst_out.weight, fresh.sst_out.weight)
    qqp_changed = not torch.equal(model.qqp_out.weight, fresh.qqp_out.weight)
    assert qqp_changed == (stage == "qqp")
    # the cache restores every trained module
    again = new_model(cfg)
    assert run_pretraining(cfg, data, again, CPU, log=quiet).hit
    assert state_hash(again) == state_hash(model)


def test_cache_hit_key_and_rng(make, data):
    cfg = make(seed=4, pretrain_examples=128)
    first = new_model(cfg)
    rng_before = torch.get_rng_state()
    res1 = run_pretraining(cfg, data, first, CPU, log=quiet)
    assert torch.equal(torch.get_rng_state(), rng_before)  # the stage forks the RNG
    second = new_model(cfg)
    messages = []
    res2 = run_pretraining(cfg, data, second, CPU, log=messages.append)
    assert (res1.hit, res2.hit) == (False, True) and res1.path == res2.path
    assert "loaded from cache" in messages[0]
    assert torch.equal(torch.get_rng_state(), rng_before)
    assert state_hash(first) == state_hash(second)
    # the key follows everything that changes the result, and nothing else
    probe = new_model(cfg)
    key = cache_key(cfg, data, stage_modules(cfg, probe), CPU)
    assert key == res1.key
    assert cache_key(cfg.replace(lr=1e-2, w_sst=3.0, smart_mu=1.0), data,
                     stage_modules(cfg, probe), CPU) == key
    for change in (dict(simcse_temp=0.1), dict(seed=5), dict(pretrain_examples=129),
                   dict(pretrain_lr=2e-3), dict(dropout=0.2), dict(pooling="cls"),
                   dict(pretrain_batch_size=16), dict(max_length=31), dict(pretrain="simcse_sup")):
        assert cache_key(cfg.replace(**change), data, stage_modules(cfg, probe), CPU) != key, change
    fewer_rows = load_data(cfg.replace(max_train_per_task=40))
    assert cache_key(cfg, fewer_rows, stage_modules(cfg, probe), CPU) != key
    with torch.no_grad():  # different starting weights (e.g. another checkpoint) -> new key
        probe.encoder.pooler.dense.bias.add_(1e-3)
    assert cache_key(cfg, data, stage_modules(cfg, probe), CPU) != key


def test_corrupt_cache_file_is_recomputed(make, data):
    cfg = make(seed=6, pretrain_examples=64)
    reference = new_model(cfg)
    res = run_pretraining(cfg, data, reference, CPU, log=quiet)
    res.path.write_bytes(b"not a torch file")
    model = new_model(cfg)
    again = run_pretraining(cfg, data, model, CPU, log=quiet)
    assert not again.hit and state_hash(model) == state_hash(reference)
    assert run_pretraining(cfg, data, new_model(cfg), CPU, log=quiet).hit


def test_trainer_runs_the_stage_once(make, data, tmp_path):
    from mtbert.loop.trainer import Trainer
    cfg = make(seed=7, pretrain_examples=64, eval_dev=False)
    a = Trainer(cfg, data, tmp_path / "a")
    b = Trainer(cfg, data, tmp_path / "b")
    assert state_hash(a.model) == state_hash(b.model)
    assert state_hash(a.model.encoder) != state_hash(new_model(cfg).encoder)
    assert list((Path(cfg.cache_dir) / "pretrain").glob("simcse-*.pt"))


# ------------------------------------------------------------------ two processes racing
def _race_worker(cfg_dict, data, barrier, queue):
    import torch
    from mtbert.core.config import TrainConfig
    from mtbert.model.model import MultitaskModel
    from mtbert.techniques.pretrain import run_pretraining
    torch.set_num_threads(1)
    cfg = TrainConfig.from_dict(cfg_dict)
    torch.manual_seed(cfg.seed)
    model = MultitaskModel.from_config(cfg)
    barrier.wait(timeout=60)
    res = run_pretraining(cfg, data, model, torch.device("cpu"), log=lambda m: None)
    queue.put((res.hit, state_hash(model)))


def test_two_processes_racing_share_one_result(make, data):
    cfg = make(seed=8, pretrain_examples=960)
    ctx = mp.get_context("spawn")
    barrier, queue = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_race_worker, args=(cfg.to_dict(), data, barrier, queue))
             for _ in range(2)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    # exactly one computed the stage, the other waited on the lock and loaded it
    assert sorted(hit for hit, _ in results) == [False, True]
    assert results[0][1] == results[1][1]
    folder = Path(cfg.cache_dir) / "pretrain"
    assert not list(folder.glob(".*.tmp"))
    # the file is complete and matches a fresh load (weights_only) in this process
    model = new_model(cfg)
    assert run_pretraining(cfg, data, model, CPU, log=quiet).hit
    assert state_hash(model) == results[0][1]
