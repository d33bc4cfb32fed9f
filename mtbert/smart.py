"""SMART regularisation (Jiang et al. 2020). Filled in by the techniques issue."""

from __future__ import annotations

from mtbert.config import TASKS, TrainConfig


def build_regulariser(cfg: TrainConfig, model):
    if all(cfg.smart_lambda(t) == 0 for t in TASKS) and cfg.smart_mu == 0:
        return None
    raise NotImplementedError("SMART is not implemented yet")
