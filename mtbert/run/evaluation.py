"""A trial's evaluations, beside its state (:class:`~mtbert.run.trial_run.TrialRun`): its
model scored on a split (val at every evaluation, dev at the end), the test split predicted,
the prediction files written, and what an evaluation records -- the run's figures beside
the scores, a line of ``history.jsonl``, the progress line.

The trial run decides when to evaluate and what the checkpoint of an evaluation holds
(:mod:`mtbert.run.checkpoint`); this module does the scoring and the records, from the
model and the values it is handed at the time (a test may swap a run's model or autocast).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from mtbert.core.tasks import TASK_NAMES
from mtbert.data import MultitaskData
from mtbert.run.inference import as_label, predict_split
from mtbert.run.metrics import scalar_metrics, split_metrics, task_metrics
from mtbert.run.predictions import write_predictions as write_prediction_files


@dataclass(frozen=True)
class Scoring:
    """How a trial's model is scored: each task's splits and encoding, on the trial's device
    (bf16 autocast on CUDA), in evaluation batches of at most ``rows`` rows and
    ``max_tokens`` tokens, padded to ``static_max_length`` (0: each batch's longest row)."""
    data: MultitaskData
    encodings: dict[str, str]
    device: torch.device
    autocast: bool
    static_max_length: int
    rows: int
    max_tokens: int

    def predict(self, model: torch.nn.Module, task: str, split,
                sst_probabilities: bool = False) -> np.ndarray:
        return predict_split(model, split, self.encodings[task], self.data.pad_id, self.rows,
                             self.device, self.autocast, self.static_max_length,
                             sst_probabilities=sst_probabilities, max_tokens=self.max_tokens)

    def score(self, model: torch.nn.Module, split_name: str
              ) -> tuple[dict, dict[str, np.ndarray]]:
        """Every task scored on ``split_name`` (val or dev): (the prefixed metrics, each
        task's predictions)."""
        per_task, predictions = {}, {}
        for task in TASK_NAMES:
            split = self.data.split(task, split_name)
            scores = self.predict(model, task, split, sst_probabilities=True)
            pred = scores.argmax(-1) if task == "sst" else scores
            predictions[task] = pred
            per_task[task] = task_metrics(task, as_label(task, pred), split.labels,
                                          probabilities=None if task == "sts" else scores)
        return split_metrics(split_name, per_task), predictions

    def predict_test(self, model: torch.nn.Module) -> dict[str, np.ndarray]:
        """Each task's predictions for its test split, where the data have one."""
        predictions = {}
        for task in TASK_NAMES:
            split = self.data.split(task, "test")
            if split is not None:
                predictions[task] = self.predict(model, task, split)
        return predictions

    def write_predictions(self, folder: Path, split_name: str,
                          predictions: dict[str, np.ndarray]) -> None:
        write_prediction_files(folder, split_name,
                               {t: self.data.split(t, split_name) for t in predictions},
                               predictions)


def train_losses(sums: dict[str, float], counts: dict[str, int]) -> dict[str, float]:
    """The mean train loss of each task since the last evaluation (tasks not trained since
    left out)."""
    return {f"train/loss_{t}": sums[t] / counts[t] for t in TASK_NAMES if counts[t]}


def append_history(out_dir: Path, metrics: dict) -> None:
    """One evaluation's scalar metrics as a line of ``out_dir/history.jsonl``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "history.jsonl", "a", encoding="utf-8") as fh:
        fh.write(json.dumps(scalar_metrics(metrics)) + "\n")


def progress_line(examples_seen: int, metrics: dict) -> str:
    return (f"[mtbert] eval @ {examples_seen} examples: val overall "
            f"{metrics['val/overall']:.4f} (sst {metrics['val/sst_acc']:.3f}, "
            f"qqp {metrics['val/qqp_acc']:.3f}, sts {metrics['val/sts_corr']:.3f})")
