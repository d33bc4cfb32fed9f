"""A reused worker's kept step graphs in the sequences a search makes (CUDA only; skipped
with the reason where torch sees no GPU).  A trial taking a kept step may resume from a
checkpoint (ASHA's paused trials, Ray's restore after a failure), use another batch size
(new shapes captured into the kept graphs' memory pool) or follow a trial the scheduler
stopped.  Each must train as the same trial built afresh; a graph that reads freed memory
shows as an illegal-address error here (run one test per process:
``python -m pytest -q -m cuda tests/test_graph_reuse_cuda.py::NAME``)."""

from __future__ import annotations

import pytest
import torch

from mtbert.loop import graph_reuse
from mtbert.data import load_data
from mtbert.loop.trainer import Trainer

# skipped where torch sees no GPU (conftest.py); nothing kept from another test's trainers
pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("no_kept_step")]


@pytest.fixture
def cuda_config(tiny_config):
    def make(**overrides):
        base = dict(device="cuda", step_mode="graphs", batch_size=8, max_length=64,
                    dropout=0.1, max_examples=240, eval_every=120, eval_dev=False,
                    eval_at_start=False, smart_lambda_sst=1.0, smart_lambda_qqp=1.0,
                    smart_lambda_sts=1.0, smart_mu=0.5)
        return tiny_config(**{**base, **overrides})
    return make


def weights(trainer) -> torch.Tensor:
    return torch.cat([p.detach().float().flatten() for p in trainer.model.parameters()])


def trains_as_built_afresh(cfg, data, folder, resume_from=None) -> Trainer:
    """Train ``cfg`` on the kept step this process holds, then built afresh (nothing
    kept), from the same start; the two end with the same weights (bf16 rounding)."""
    kept = Trainer(cfg, data, folder / "kept", resume_from=resume_from, checkpoints=False)
    kept.fit()
    graph_reuse.forget()
    fresh = Trainer(cfg, data, folder / "fresh", resume_from=resume_from, checkpoints=False)
    fresh.fit()
    torch.cuda.synchronize()
    w_k, w_f = weights(kept), weights(fresh)
    assert torch.isfinite(w_k).all()
    assert ((w_k - w_f).norm() / w_f.norm()).item() < 2e-3
    return kept


def checkpointed(cfg, data, folder, examples: int):
    """A trial that trained ``examples`` and left its checkpoint (as a paused trial does)."""
    trainer = Trainer(cfg.replace(max_examples=examples, eval_every=examples), data, folder)
    trainer.fit()
    graph_reuse.forget()  # that worker is gone
    return folder / "checkpoint"


def test_a_resumed_trial_on_a_kept_step(cuda_config, tmp_path):
    cfg = cuda_config()
    data = load_data(cfg)
    ckpt = checkpointed(cfg.replace(seed=5), data, tmp_path / "c", 120)
    Trainer(cfg.replace(seed=1, lr=2e-3), data, tmp_path / "a", checkpoints=False).fit()
    kept = trains_as_built_afresh(cfg.replace(seed=5), data, tmp_path, resume_from=ckpt)
    assert kept.step_graphs.stats.kept >= 3


def test_another_batch_size_on_a_kept_step(cuda_config, tmp_path):
    cfg = cuda_config()
    data = load_data(cfg)
    Trainer(cfg.replace(seed=1), data, tmp_path / "a", checkpoints=False).fit()
    trains_as_built_afresh(cfg.replace(seed=2, batch_size=16), data, tmp_path)


def test_a_resumed_trial_of_another_batch_size_on_a_kept_step(cuda_config, tmp_path):
    cfg = cuda_config()
    data = load_data(cfg)
    ckpt = checkpointed(cfg.replace(seed=5, batch_size=16), data, tmp_path / "c", 128)
    Trainer(cfg.replace(seed=1), data, tmp_path / "a", checkpoints=False).fit()
    trains_as_built_afresh(cfg.replace(seed=5, batch_size=16), data, tmp_path,
                           resume_from=ckpt)


def test_a_kept_step_after_a_stopped_trial(cuda_config, tmp_path):
    """Tune stops a trial at a report (SystemExit(0) from the report callback); the next
    trial of the worker takes what it left."""
    cfg = cuda_config()
    data = load_data(cfg)

    def stop(metrics, checkpoint_dir):
        raise SystemExit(0)
    with pytest.raises(SystemExit):
        Trainer(cfg.replace(seed=1), data, tmp_path / "a", report=stop).fit()
    trains_as_built_afresh(cfg.replace(seed=2), data, tmp_path)


def test_a_chain_of_trials_as_a_search_makes_them(cuda_config, tmp_path):
    """Eight trials in one process, structures, batch sizes and resumes mixed."""
    cfg = cuda_config()
    data = load_data(cfg)
    ckpt16 = checkpointed(cfg.replace(seed=7, batch_size=16), data, tmp_path / "p16", 128)
    ckpt8 = checkpointed(cfg.replace(seed=8, smart_lambda_sst=0.0), data, tmp_path / "p8", 120)
    chain = [(cfg.replace(seed=1), None), (cfg.replace(seed=7, batch_size=16), ckpt16),
             (cfg.replace(seed=2, batch_size=32), None),
             (cfg.replace(seed=8, smart_lambda_sst=0.0), ckpt8),
             (cfg.replace(seed=3, smart_lambda_sst=0.0, batch_size=16), None),
             (cfg.replace(seed=4), None), (cfg.replace(seed=7, batch_size=16), ckpt16),
             (cfg.replace(seed=5, smart_mu=0.0), None)]
    for i, (trial_cfg, resume) in enumerate(chain):
        trainer = Trainer(trial_cfg, data, tmp_path / f"t{i}", resume_from=resume,
                          checkpoints=False)
        trainer.fit()
        torch.cuda.synchronize()
        assert torch.isfinite(weights(trainer)).all(), i
