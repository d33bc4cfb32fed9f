"""Prediction files: Parquet (id, prediction, label) and CS 224N-style CSVs."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from mtbert.core.atomic import atomic_write
from mtbert.core.tasks import TASKS


def write_predictions(folder: Path, split_name: str, splits: dict, predictions: dict[str, np.ndarray]) -> None:
    """For each task: ``{split}-{task}.parquet`` and ``{task}-{split}-output.csv``.

    QQP's Parquet holds the duplicate probability and the 0/1 class; its CSV the class.
    """
    folder.mkdir(parents=True, exist_ok=True)
    for task, pred in predictions.items():
        split = splits[task]
        columns = {"id": pa.array(split.ids)}
        if task == "qqp":
            columns["probability"] = pa.array(pred.astype(np.float64))
            label = (pred >= 0.5).astype(np.int64)
        else:
            label = pred
        columns["prediction"] = pa.array(label)
        if split.labels is not None:
            columns["label"] = pa.array(split.labels)
        atomic_write(folder / f"{split_name}-{task}.parquet",
                lambda tmp, cols=columns: pq.write_table(pa.table(cols), tmp))
        atomic_write(folder / f"{task}-{split_name}-output.csv",
                lambda tmp, ids=split.ids, values=label, t=task: write_cs224n_csv(tmp, t, ids, values))


def read_predictions(folder: Path, split_name: str,
                     splits: dict) -> dict[str, np.ndarray] | None:
    """{task: raw prediction} from the Parquet files :func:`write_predictions` wrote for
    ``splits`` (SST's class, QQP's probability, STS's score); None where a task's file is
    missing, unreadable or not of that split's rows."""
    read = {}
    for task, split in splits.items():
        try:
            table = pq.read_table(Path(folder) / f"{split_name}-{task}.parquet")
            if table.column("id").to_pylist() != list(split.ids):
                return None
            column = "probability" if task == "qqp" else "prediction"  # QQP's raw value
            read[task] = table.column(column).to_numpy()
        except (OSError, KeyError, ValueError):
            return None
    return read


def write_cs224n_csv(path: str | Path, task: str, ids: list[str], values: np.ndarray) -> None:
    with open(path, "w", encoding="utf-8", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["id", TASKS[task].prediction_column])
        for row_id, value in zip(ids, values):
            writer.writerow([row_id, f"{value:.4f}" if task == "sts" else int(value)])

