"""The validation scores of a model before its first step, kept for the runs that start from
the same weights and are scored the same way.

A search's trials each evaluate at 0 examples, so every trial's curve starts where its
training did; with one seed and one model their untrained weights are the same, and so
are those scores (the main job: 8 trials, each evaluation about 5 s of a CPU core).
:class:`StartScores` keeps them in a folder (a search's: its trials share it), one JSON
file per key, the key a digest of what decides them: every weight and buffer of the
model, bit for bit, how it is scored (:class:`~mtbert.run.evaluation.Scoring`: device
type, autocast, batch sizes, padding, encodings) and the validation rows themselves.
The first run to score a key writes its file (atomically); a run that finds it reads the
metrics and predictions back instead of scoring.  A file that cannot be read is scored
again and replaced.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import torch

from mtbert.core.atomic import atomic_write_json
from mtbert.core.tasks import TASK_NAMES
from mtbert.run.evaluation import Scoring

#: the split the evaluation at 0 examples scores
SPLIT = "val"


class StartScores:
    """The scores at 0 examples kept in ``folder`` (made when the first is written)."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)

    @staticmethod
    def key(model: torch.nn.Module, scoring: Scoring) -> str:
        """The digest of ``model``'s weights and buffers, ``scoring``'s settings and the
        validation rows it scores."""
        digest = hashlib.blake2b(digest_size=20)
        settings = (scoring.device.type, scoring.autocast, scoring.static_max_length,
                    scoring.rows, scoring.max_tokens, sorted(scoring.encodings.items()))
        digest.update(repr(settings).encode())
        for name, tensor in sorted(model.state_dict().items()):
            digest.update(f"{name} {tensor.dtype} {tuple(tensor.shape)}".encode())
            digest.update(tensor.detach().cpu().contiguous().reshape(-1)
                          .view(torch.uint8).numpy())
        for task in TASK_NAMES:
            split = scoring.data.split(task, SPLIT)
            if split is None:
                continue
            digest.update(f"{task} {len(split)} ".encode() + "\t".join(split.ids).encode())
            if split.labels is not None:
                digest.update(np.ascontiguousarray(split.labels))
            for column, ragged in sorted(split.tokens.columns().items()):
                digest.update(column.encode())
                digest.update(np.ascontiguousarray(ragged.values))
                digest.update(np.ascontiguousarray(ragged.offsets))
        return digest.hexdigest()

    def _file(self, key: str) -> Path:
        return self.folder / f"{key}.json"

    def get(self, key: str) -> tuple[dict, dict[str, np.ndarray]] | None:
        """(metrics, predictions by task) kept under ``key``; None if none can be read."""
        try:
            kept = json.loads(self._file(key).read_text(encoding="utf-8"))
            predictions = {task: np.asarray(values, dtype=kept["dtypes"][task])
                           for task, values in kept["predictions"].items()}
            return kept["metrics"], predictions
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def put(self, key: str, metrics: dict, predictions: dict[str, np.ndarray]) -> None:
        """Keep ``metrics`` and ``predictions`` under ``key`` (a failed write keeps nothing
        and is no error: the next run scores again)."""
        try:
            atomic_write_json(self._file(key), {
                "metrics": metrics,
                "predictions": {t: np.asarray(p).tolist() for t, p in predictions.items()},
                "dtypes": {t: np.asarray(p).dtype.str for t, p in predictions.items()}})
        except OSError:
            pass

    def scores(self, model: torch.nn.Module, scoring: Scoring
               ) -> tuple[dict, dict[str, np.ndarray], bool]:
        """``model``'s validation (metrics, predictions), read where kept, else scored and
        kept; and whether they were read."""
        key = self.key(model, scoring)
        found = self.get(key)
        if found is not None:
            return (*found, True)
        metrics, predictions = scoring.score(model, SPLIT)
        self.put(key, metrics, predictions)
        return metrics, predictions, False
