"""The evaluation at 0 examples kept for the runs that start from the same weights
(mtbert/run/start_scores.py): the tiny model, real data, real files."""

import json

import numpy as np
import pytest

from mtbert.data import load_data
from mtbert.loop.trainer import Trainer
from mtbert.run.start_scores import StartScores


def _start_row(trainer: Trainer) -> dict:
    trainer.start()
    return trainer.history[0]


def _scored(row: dict) -> dict:
    return {k: v for k, v in row.items() if k.startswith("val/")}


def test_a_second_run_from_the_same_weights_reads_the_kept_scores(tiny_config, tmp_path):
    """The first run scores and keeps one file; a run of another configuration from the same
    weights (seed) reads it back -- shown by a value only the file holds --; a run of
    another seed scores its own and keeps a second file."""
    cfg = tiny_config(eval_dev=False, lr=1e-3, dropout=0.3)
    data = load_data(cfg)
    memo = StartScores(tmp_path / "kept")
    first = _start_row(Trainer(cfg, data, tmp_path / "a", checkpoints=False, start_scores=memo))
    files = list((tmp_path / "kept").glob("*.json"))
    assert len(files) == 1
    alone = _start_row(Trainer(cfg, data, tmp_path / "b", checkpoints=False))  # no memo
    assert _scored(first) == _scored(alone) and "val/overall" in first

    kept = json.loads(files[0].read_text())
    kept["metrics"]["val/overall"] = 0.123456789  # only the file says this
    files[0].write_text(json.dumps(kept))
    other_lr = tiny_config(eval_dev=False, lr=5e-4, dropout=0.1)  # same seed: same weights
    read = _start_row(Trainer(other_lr, data, tmp_path / "c", checkpoints=False,
                              start_scores=memo))
    assert read["val/overall"] == 0.123456789
    assert {k: v for k, v in _scored(read).items() if k != "val/overall"} == \
        {k: v for k, v in _scored(first).items() if k != "val/overall"}

    reseeded = tiny_config(eval_dev=False, seed=7)
    own = _start_row(Trainer(reseeded, data, tmp_path / "d", checkpoints=False,
                             start_scores=memo))
    assert own["val/overall"] != 0.123456789
    assert len(list((tmp_path / "kept").glob("*.json"))) == 2


def test_the_kept_predictions_come_back_as_scored(tiny_config, tmp_path):
    cfg = tiny_config(eval_dev=False)
    data = load_data(cfg)
    trainer = Trainer(cfg, data, tmp_path / "a", checkpoints=False)
    memo = StartScores(tmp_path / "kept")
    metrics, predictions, read = memo.scores(trainer.model, trainer.scoring())
    assert not read
    again, kept, read = memo.scores(trainer.model, trainer.scoring())
    assert read and again == metrics
    for task, values in predictions.items():
        assert kept[task].dtype == values.dtype
        np.testing.assert_array_equal(kept[task], values)


def test_a_damaged_file_is_scored_again_and_replaced(tiny_config, tmp_path):
    cfg = tiny_config(eval_dev=False)
    data = load_data(cfg)
    trainer = Trainer(cfg, data, tmp_path / "a", checkpoints=False)
    memo = StartScores(tmp_path / "kept")
    key = memo.key(trainer.model, trainer.scoring())
    (tmp_path / "kept").mkdir()
    (tmp_path / "kept" / f"{key}.json").write_text('{"metrics": {"val/ov')  # cut short
    metrics, _, read = memo.scores(trainer.model, trainer.scoring())
    assert not read and metrics["val/overall"] == pytest.approx(metrics["val/overall"])
    assert memo.get(key)[0] == metrics  # replaced by a whole file


def test_the_key_follows_the_weights_and_the_scoring(tiny_config, tmp_path):
    import torch
    cfg = tiny_config(eval_dev=False)
    trainer = Trainer(cfg, load_data(cfg), tmp_path / "a", checkpoints=False)
    scoring = trainer.scoring()
    key = StartScores.key(trainer.model, scoring)
    assert StartScores.key(trainer.model, scoring) == key
    with torch.no_grad():
        weight = next(trainer.model.parameters())
        weight.view(-1)[0] = torch.nextafter(weight.view(-1)[0], torch.tensor(1.0))
    assert StartScores.key(trainer.model, scoring) != key  # one ulp of one weight
    from dataclasses import replace
    assert StartScores.key(trainer.model, replace(scoring, rows=scoring.rows + 1)) != \
        StartScores.key(trainer.model, scoring)
