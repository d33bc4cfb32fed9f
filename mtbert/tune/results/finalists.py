"""The finalists of a search: their best checkpoints predict, and are ensembled.

Selection uses only the validation split carved from train; dev metrics are computed
for the finalists (the ensemble's candidates, which include the best trial) and
reported, never used to select.  Each finalist's *best* checkpoint (by validation
overall) is loaded with :func:`~mtbert.run.inference.load_checkpoint_model` and predicts the
val, dev and test splits of the data the driver already loaded; :mod:`mtbert.run.ensemble`
combines them (``vote``: SST/QQP by mode with ties to the best member, STS by median;
``greedy``: Caruana forward selection with replacement on val, per task).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from mtbert.core.devices import uses_bf16
from mtbert.data import encoding_for, eval_token_cap
from mtbert.run.ensemble import combine, greedy_task_selection, task_labels
from mtbert.run.metrics import scalar_metrics, split_metrics, task_metrics
from mtbert.run.predictions import read_predictions, write_predictions
from mtbert.core.tasks import TASK_NAMES
from mtbert.run.inference import load_checkpoint_model, predict_split
from mtbert.tune.infra.location import weights_at_hand

SPLITS = ("val", "dev", "test")


def kept_val_predictions(checkpoint_dir: str, data) -> dict[str, np.ndarray] | None:
    """{task: raw prediction} on val that a trial wrote with this checkpoint (the
    evaluation it belongs to: ``predictions/val-{task}.parquet``), as :func:`predict_member`
    gives them; None where a task's file is missing, unreadable or not of ``data``'s val
    rows (an exported model, another data)."""
    splits = {t: s for t in TASK_NAMES if (s := data.split(t, "val")) is not None}
    return read_predictions(Path(checkpoint_dir) / "predictions", "val", splits)


def predict_member(checkpoint_dir: str, data, device: str = "cpu",
                   splits: tuple[str, ...] = SPLITS) -> dict[str, dict[str, np.ndarray]]:
    """{split: {task: raw prediction}} of one best checkpoint on ``splits`` (val, dev, test);
    val read from the checkpoint's own predictions where it has them (the same model,
    batches and precision scored them: :func:`kept_val_predictions`)."""
    import torch

    cfg, model = load_checkpoint_model(checkpoint_dir, device=device)
    dev = torch.device(device)
    out: dict[str, dict[str, np.ndarray]] = {}
    for split_name in splits:
        if split_name == "val" and (kept := kept_val_predictions(checkpoint_dir, data)):
            out[split_name] = kept
            continue
        out[split_name] = {}
        for task in TASK_NAMES:
            split = data.split(task, split_name)
            if split is None:
                continue
            out[split_name][task] = predict_split(
                model, split, encoding_for(task, cfg.pair_encoding), data.pad_id,
                cfg.eval_batch_size, dev, autocast=uses_bf16(cfg.precision, dev),
                max_tokens=eval_token_cap(cfg.eval_batch_tokens, dev.type))
    return out


def score_split(data, split_name: str, labels: dict[str, np.ndarray]) -> dict[str, Any]:
    """Metrics (``{split}/sst_acc`` ... ``{split}/overall``) of label arrays."""
    per_task = {t: task_metrics(t, pred, data.split(t, split_name).labels)
                for t, pred in labels.items()}
    return split_metrics(split_name, per_task)


@dataclass
class EnsembleResult:
    method: str
    members: list[str]                       # candidate trial ids, best first
    weights: dict[str, list[int]]            # per task, aligned with members (0 = unused)
    labels: dict[str, dict[str, np.ndarray]]  # split -> task -> ensemble labels
    metrics: dict[str, Any] = field(default_factory=dict)          # val + dev
    best_single: dict[str, Any] = field(default_factory=dict)      # val + dev of member 0

    @property
    def selected(self) -> list[str]:
        """Members with a non-zero weight in at least one task (all of them for vote)."""
        return [m for i, m in enumerate(self.members)
                if any(w[i] > 0 for w in self.weights.values())]

    def weights_by_member(self) -> dict[str, dict[str, int]]:
        return {task: {m: int(c) for m, c in zip(self.members, w) if c}
                for task, w in self.weights.items()}


def build_ensemble(member_ids: list[str], preds: dict[str, dict[str, dict[str, np.ndarray]]],
                   data, method: str = "vote") -> EnsembleResult:
    """Combine members (best first); ``preds[trial_id][split][task]`` = raw predictions."""

    weights: dict[str, list[int]] = {}
    for task in TASK_NAMES:
        if method == "greedy":
            gold = data.split(task, "val").labels
            sel = greedy_task_selection(task, [preds[m]["val"][task] for m in member_ids], gold)
            weights[task] = sel.counts
        else:
            weights[task] = [1] * len(member_ids)
    labels: dict[str, dict[str, np.ndarray]] = {}
    for split_name in SPLITS:
        labels[split_name] = {}
        for task in TASK_NAMES:
            if task not in preds[member_ids[0]][split_name]:
                continue
            member_preds = [preds[m][split_name][task] for m in member_ids]
            labels[split_name][task] = combine(task, member_preds, weights[task])
    metrics, single = {}, {}
    best = member_ids[0]
    for split_name in ("val", "dev"):
        metrics.update(score_split(data, split_name, labels[split_name]))
        single.update(score_split(data, split_name, {
            t: task_labels(t, p) for t, p in preds[best][split_name].items()}))
    return EnsembleResult(method, list(member_ids), weights, labels, metrics, single)


def write_ensemble_predictions(folder: Path, data, result: EnsembleResult) -> Path:
    """CS 224N CSVs (``{task}-{split}-output.csv``) + Parquet of the ensemble labels.

    QQP holds the voted 0/1 class (also in the Parquet ``probability`` column)."""
    folder.mkdir(parents=True, exist_ok=True)
    for split_name, by_task in result.labels.items():
        if by_task:
            write_predictions(folder, split_name, {t: data.split(t, split_name) for t in by_task},
                              {t: np.asarray(v, dtype=np.float64) if t != "sst" else v
                               for t, v in by_task.items()})
    return folder


def write_member_predictions(folder: Path, data, preds: dict[str, dict[str, np.ndarray]]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for split_name, by_task in preds.items():
        if by_task:
            write_predictions(folder, split_name, {t: data.split(t, split_name) for t in by_task},
                              by_task)
    return folder


def ensemble_candidates(ranking, top_k: int) -> tuple[list, dict[str, str]]:
    """(The ``top_k`` best trials whose weights are at hand, ``{trial_id: why left out}``
    for better-ranked trials skipped: an earlier search's trial (``--extend``) whose
    weights its ``--keep-checkpoints`` removed, or whose folder is gone since)."""
    candidates, left_out = [], {}
    for r in ranking:
        if len(candidates) == top_k:
            break
        # this search's checkpoints may be on a URI storage (staged later); an earlier
        # search's weights are a folder or a URI (staged once chosen)
        if r.best_checkpoint and (not r.origin or weights_at_hand(r.best_checkpoint)):
            candidates.append(r)
        else:
            left_out[r.trial_id] = (
                f"trained in {r.origin or 'this search'}; its weights were not kept there"
                if not r.best_checkpoint else f"its weights folder {r.best_checkpoint} is gone")
    return candidates, left_out


def predict_finalists(finalists, data, device: str = "cpu") -> dict[str, dict[str, dict[str, np.ndarray]]]:
    """``{trial_id: {split: {task: raw prediction}}}`` of each finalist's best checkpoint."""
    preds = {}
    for r in finalists:
        print(f"[tune] predicting val/dev/test with {r.trial_id}'s best checkpoint "
              f"(val overall {r.best_score:.4f})", flush=True)
        preds[r.trial_id] = predict_member(r.best_checkpoint, data, device)
    return preds


def dev_metrics(preds: dict[str, dict[str, dict[str, np.ndarray]]], data) -> dict[str, dict[str, float]]:
    """``{trial_id: dev metrics}`` of each finalist (reported, never used to select)."""
    return {tid: scalar_metrics(score_split(data, "dev", {
        t: task_labels(t, v) for t, v in p["dev"].items()}), finite=True)
        for tid, p in preds.items()}
