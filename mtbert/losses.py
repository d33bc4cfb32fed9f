"""Task losses and loss combiners.

Task losses: SST cross-entropy; QQP binary cross-entropy on the logit; STS by
``sts_loss``:
  * ``mse``: MSE between the 0..5 score and the label;
  * ``ce_bins``: cross-entropy over the 6 rounded scores (the score is the expectation);
  * ``cosine_mse``: MSE between 2.5·(cos(u, v) + 1) and the label (report 002),
    plus the head's MSE when the head is a regression;
  * ``cosine_embedding``: ``nn.CosineEmbeddingLoss`` on (u, v) with the label
    binarised at 2.5 (report 002), plus the head's MSE when the head is a regression.

A loss combiner turns ``{task: loss}`` into per-task weighted losses (and may own
parameters); the gradient combiner (gradients.py) then sets the gradients.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mtbert.config import TrainConfig
from mtbert.model import TaskOutput


def task_loss(task: str, out: TaskOutput, labels: torch.Tensor, cfg: TrainConfig) -> torch.Tensor:
    if task == "sst":
        return F.cross_entropy(out.logits.float(), labels.long())
    if task == "qqp":
        return F.binary_cross_entropy_with_logits(out.logits.float(), labels.float())
    return sts_loss(out, labels.float(), cfg)


def sts_loss(out: TaskOutput, y: torch.Tensor, cfg: TrainConfig) -> torch.Tensor:
    kind = cfg.sts_loss
    if kind == "mse":
        return F.mse_loss(out.score.float(), y)
    if kind == "ce_bins":
        return F.cross_entropy(out.logits.float(), y.round().long())
    head_mse = F.mse_loss(out.score.float(), y) if cfg.sts_head == "regression" else 0.0
    if kind == "cosine_mse":
        cos_score = 2.5 * (F.cosine_similarity(out.u.float(), out.v.float(), dim=-1) + 1.0)
        return F.mse_loss(cos_score, y) + head_mse
    if kind == "cosine_embedding":
        target = torch.where(y >= 2.5, 1.0, -1.0)
        return F.cosine_embedding_loss(out.u.float(), out.v.float(), target) + head_mse
    raise ValueError(f"unknown sts_loss {kind!r}")


class LossCombiner(nn.Module):
    """``weighted({task: loss}) -> {task: weighted loss}``; ``penalty(model)`` adds a term."""

    def weighted(self, losses: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return dict(losses)

    def penalty(self, model: nn.Module) -> torch.Tensor | None:
        return None


class SumCombiner(LossCombiner):
    """L = Σ_i L_i."""


class FixedCombiner(LossCombiner):
    """L = Σ_i w_i L_i with the config's ``w_sst``, ``w_qqp``, ``w_sts``."""

    def __init__(self, cfg: TrainConfig):
        super().__init__()
        self.weights = {t: getattr(cfg, f"w_{t}") for t in ("sst", "qqp", "sts")}

    def weighted(self, losses):
        return {t: self.weights[t] * loss for t, loss in losses.items()}


def build_loss_combiner(cfg: TrainConfig) -> LossCombiner:
    if cfg.loss_weighting == "fixed":
        return FixedCombiner(cfg)
    return SumCombiner()
