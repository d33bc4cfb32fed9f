"""The checkpoint layout (weights apart from the optimizer state, each tensor once) and
the background checkpoint writer."""

from __future__ import annotations

import filecmp

import pytest
import torch

from mtbert.data import load_data
from mtbert.loop.trainer import Trainer


def test_checkpoint_weights_are_an_exported_model_and_apart_from_the_state(tiny_config,
                                                                           tmp_path):
    from transformers import AutoModel

    from mtbert.run.model_files import export_checkpoint, load_model
    from mtbert.run.training_state import load_tensors, read_training_state
    cfg = tiny_config(max_examples=48, eval_dev=False, smart_mu=1.0)
    data = load_data(cfg)
    trainer = Trainer(cfg, data, tmp_path / "run")
    trainer.fit()
    checkpoint = tmp_path / "run" / "checkpoint"
    assert sorted(p.relative_to(checkpoint).as_posix() for p in checkpoint.rglob("*")
                  if p.is_file() and "predictions" not in p.parts) == [
        "config.yaml", "encoder/config.json", "encoder/model.safetensors",
        "heads.safetensors", "history.json", "metrics.json", "state.pt"]
    # the encoder folder is a transformers model holding the trained encoder's weights
    encoder = AutoModel.from_pretrained(checkpoint / "encoder")
    trained = trainer.model.encoder.state_dict()
    assert all(torch.equal(v, trained[k]) for k, v in encoder.state_dict().items())
    heads = load_tensors(checkpoint / "heads.safetensors")
    assert heads and not any(k.startswith("encoder.") for k in heads)
    # state.pt: no weights, the SMART teacher (an EMA of the weights, not derivable) kept
    state = read_training_state(checkpoint / "state.pt")
    assert "model" not in state and state["regulariser"]["teacher"]
    assert set(state["optimizer"]["state"]) and state["counters"]["examples_seen"] >= 48
    # exporting is a copy of the weight files; the export predicts as the trainer does
    folder = export_checkpoint(checkpoint, tmp_path / "kept")
    for name in ("encoder/model.safetensors", "heads.safetensors", "encoder/config.json"):
        assert filecmp.cmp(checkpoint / name, folder / name, shallow=False), name
    assert not (folder / "state.pt").exists()
    _, model = load_model(folder)
    trainer.model = model
    assert trainer.evaluate("val")["val/overall"] == trainer.history[-1]["val/overall"]


def test_each_tensor_is_stored_once(tmp_path):
    """Tied entries (one tensor under two names) are one host copy, written once and
    restored as one tensor."""
    from mtbert.run.training_state import HostCopy, load_tensors, save_tensors
    shared = torch.randn(256, 64)
    live = {"embeddings.weight": shared, "decoder.weight": shared, "bias": torch.zeros(64)}
    copier = HostCopy()
    snapshot = copier.copy(live)
    assert snapshot["embeddings.weight"] is snapshot["decoder.weight"]
    assert snapshot["bias"] is not live["bias"] and torch.equal(snapshot["bias"], live["bias"])
    size = save_tensors(tmp_path / "w.safetensors", snapshot)
    assert shared.numel() * 4 < size < 1.5 * shared.numel() * 4  # not twice
    back = load_tensors(tmp_path / "w.safetensors")
    assert back["embeddings.weight"] is back["decoder.weight"]
    assert torch.equal(back["decoder.weight"], shared)
    # the buffers are reused: a second snapshot copies into the same memory
    shared.add_(1.0)
    again = copier.copy(live)
    assert again["decoder.weight"] is snapshot["decoder.weight"]
    assert torch.equal(again["decoder.weight"], shared)


def test_a_report_that_raises_stops_training_at_the_next_step(tiny_config, tmp_path):
    """A report runs on the checkpoint thread while training goes on; what it raises (the
    SystemExit with which Ray's report stops a trial, here) is raised in the training
    thread at its next step (or evaluation), after the checkpoint was written."""
    import threading
    cfg = tiny_config(epochs=3, eval_every=40, eval_dev=False, eval_at_start=False)
    threads = []

    def stop(metrics, checkpoint_dir):
        threads.append(threading.current_thread())
        raise SystemExit(0)

    trainer = Trainer(cfg, load_data(cfg), tmp_path, report=stop)
    with pytest.raises(SystemExit):
        trainer.fit()
    assert threads and threads[0] is not threading.current_thread()
    # stopped before a second evaluation was recorded (at the latest when that one
    # waited for the first's report)
    assert len(trainer.history) == 1 and 40 <= trainer.examples_seen < 80 + 3 * cfg.batch_size
    assert (tmp_path / "checkpoint" / "heads.safetensors").is_file()
    assert not list(tmp_path.glob(".checkpoint.*"))  # no half-written folder left


def test_a_failed_checkpoint_job_lets_go_of_what_it_held():
    """Once a job's error is raised on the training thread, the job's thread has ended, so
    nothing it held (the trainer, through the job) outlives the error's handling."""
    import gc
    import threading
    import weakref

    from mtbert.run.training_state import CheckpointWriter

    class Held:
        pass

    held = Held()
    seen = weakref.ref(held)

    def job(obj=held):
        raise SystemExit(0)

    writer = CheckpointWriter()
    writer.submit(job)
    del held, job
    with pytest.raises(SystemExit):
        writer.wait()
    assert not [t for t in threading.enumerate() if t.name == "mtbert-checkpoint"]
    gc.collect()
    assert seen() is None


def test_a_restore_names_the_part_that_does_not_fit_and_a_damaged_counter(tiny_config,
                                                                           tmp_path):
    """mtbert.run.checkpoint puts the parts back in order and names the first that fails: a
    loss weighting state with a foreign key, then (state fitting again) counters that are
    not numbers, a damaged file.  A fitting checkpoint gives back its counters and history."""
    from mtbert.run.checkpoint import COUNTERS, restore_checkpoint
    from mtbert.core.errors import DataError
    cfg = tiny_config(max_examples=16, eval_dev=False, loss_weighting="uncertainty")
    data = load_data(cfg)
    trainer = Trainer(cfg, data, tmp_path / "run")
    trainer.fit()
    checkpoint = tmp_path / "run" / "checkpoint"
    state_file = checkpoint / "state.pt"
    good = torch.load(state_file, weights_only=True)
    fresh = Trainer(cfg, data, tmp_path / "fresh")

    def restore():
        return restore_checkpoint(checkpoint, fresh._training_parts(), cfg, fresh.device,
                                  fresh.configured_lrs)

    counters, history = restore()
    assert counters == {k: getattr(trainer, k) for k in COUNTERS}
    assert [h["examples_seen"] for h in history] == [h["examples_seen"]
                                                     for h in trainer.history]
    torch.save({**good, "loss_combiner": {"not_a_log_variance": torch.zeros(3)}}, state_file)
    with pytest.raises(DataError, match=r"state\.pt: the loss weighting state does not fit"):
        restore()
    torch.save({**good, "counters": {**good["counters"], "epoch": "one"}}, state_file)
    with pytest.raises(DataError, match=r"state\.pt: damaged training state \(ValueError"):
        restore()
