"""Predictions of a model, in row order, for a whole split, and a checkpoint's model
loaded for predicting (the ensemble's members, a kept model)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from mtbert.core.config import TrainConfig
from mtbert.data import Split, collate, eval_batches, eval_rows
from mtbert.core.devices import prefer_stable_attention_kernels, to_device
from mtbert.model.model import MultitaskModel
from mtbert.core.tasks import TASKS
from mtbert.run.training_state import HEADS_FILE, read_weights, state_mismatch


def as_label(task: str, pred: np.ndarray) -> np.ndarray:
    """Model output -> the metric's label space (QQP probability -> 0/1)."""
    return (pred >= 0.5).astype(np.int64) if task == "qqp" else pred


@torch.no_grad()
def predict_split(model: MultitaskModel, split: Split, encoding: str, pad_id: int,
                  batch_size: int, device: torch.device, autocast: bool = False,
                  static_max_length: int = 0, sst_probabilities: bool = False,
                  max_tokens: int = 0) -> np.ndarray:
    """Predictions for every row of ``split`` in row order (SST class -- or, with
    ``sst_probabilities``, its 5 class probabilities, rows x 5 --, QQP probability, STS
    score). Batches of ``batch_size`` rows (and ``max_tokens`` padded tokens, if not 0) in
    length order (padded to static lengths with ``static_max_length``); predictions stay
    on the device until one copy per split, and the pass is one autocast region (entering
    one per batch costs host time a GPU waits for). ``batch_size`` 0: :func:`eval_rows`."""
    model.eval()
    orders, preds = [], []
    batch_size = eval_rows(batch_size, device.type)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
        for indices in eval_batches(split, batch_size, encoding, max_tokens):
            batch = collate(split, indices, encoding, pad_id, static_max_length)
            batch.pop("labels", None)
            preds.append(model.predict(split.task, to_device(batch, device),
                                       sst_probabilities=sst_probabilities).float())
            orders.append(indices)
    probabilities = sst_probabilities and split.task == "sst"
    out = np.zeros((len(split), 5) if probabilities else len(split), dtype=np.float64)
    if preds:
        out[np.concatenate(orders)] = torch.cat(preds).cpu().numpy()
    if probabilities:
        return out
    return out.astype(np.int64) if TASKS[split.task].label_kind == "class" else out


def load_checkpoint_model(checkpoint_dir: str | Path, device: str = "cpu",
                          ) -> tuple[TrainConfig, MultitaskModel]:
    """The config and model weights of a checkpoint folder (for the ensemble)."""
    checkpoint_dir = Path(checkpoint_dir)
    if torch.device(device).type == "cuda":
        prefer_stable_attention_kernels()
    cfg = TrainConfig.from_yaml(checkpoint_dir / "config.yaml")
    model = MultitaskModel.from_config(cfg)
    weights = read_weights(checkpoint_dir, device)  # the weight files only, not state.pt
    try:
        model.load_state_dict(model.complete_legacy_state(weights))
    except (RuntimeError, ValueError, KeyError, TypeError) as exc:
        raise state_mismatch(checkpoint_dir, cfg, "model", exc,
                             checkpoint_dir / HEADS_FILE) from None
    return cfg, model.to(device).eval()
