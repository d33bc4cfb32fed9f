"""A trial that starts again keeps every row of its result logs (search/result_logs.py).

Ray 2.60's loggers copied the storage copy of ``result.json`` / ``progress.csv`` over the
driver's when a trial with a checkpoint started again; the storage copy is only as new as
the last experiment sync, so the rows written since were lost from the search's records.
Here the sync Ray's timer makes at a moment of its own under load is forced at the worst
one (after the trial's first row, before its second), then the trial pauses at its third
row (a rung) and is resumed: every row must be in Ray's logs afterwards."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import pytest

from mtbert.tune.search.tuner import make_tuner
from mtbert.tune.trial.objective import OBJECTIVE

ROWS = 5


def _rows_trainable(config):
    """Reports ROWS results, each with a checkpoint, from where its checkpoint left it."""
    from ray import tune

    start = 0
    checkpoint = tune.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as folder:
            start = json.loads((Path(folder) / "at.json").read_text())["at"] + 1
    for at in range(start, ROWS):
        with tempfile.TemporaryDirectory() as folder:
            (Path(folder) / "at.json").write_text(json.dumps({"at": at}))
            tune.report({OBJECTIVE: at / ROWS, "examples_seen": at},
                        checkpoint=tune.Checkpoint.from_directory(folder))


def _sync_then_pause_scheduler():
    """FIFO, which at the trial's second result (before the loggers write it) forces an
    experiment sync and waits for it, and pauses the trial once at its third (a rung);
    Ray's FIFO resumes a paused trial when nothing is pending."""
    from ray.tune.schedulers import FIFOScheduler, TrialScheduler

    class SyncThenPause(FIFOScheduler):
        paused = False

        def on_trial_result(self, tune_controller, trial, result):
            if result["examples_seen"] == 1:
                tune_controller.checkpoint(force=True, wait=True)
            if result["examples_seen"] == 2 and not self.paused:
                self.paused = True
                return TrialScheduler.PAUSE
            return TrialScheduler.CONTINUE

    return SyncThenPause()


def test_a_trial_paused_after_an_experiment_sync_keeps_every_row(shared_ray, tmp_path):
    from ray import cloudpickle  # the trainable goes to Ray's workers by value

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    scheduler = _sync_then_pause_scheduler()
    tuner = make_tuner(_rows_trainable, {}, name="rows", storage_path=str(tmp_path),
                       num_samples=1, scheduler=scheduler, num_to_keep=None, verbose=0)
    grid = tuner.fit()
    assert scheduler.paused  # the trial was paused after the sync, and resumed
    (result,) = list(grid)
    assert result.error is None
    assert list(result.metrics_dataframe["examples_seen"]) == list(range(ROWS))
    trial_dir = Path(result.path)
    rows = [json.loads(line) for line in (trial_dir / "result.json").read_text().splitlines()]
    assert [r["examples_seen"] for r in rows] == list(range(ROWS))
    assert [r["training_iteration"] for r in rows] == list(range(1, ROWS + 1))
