"""Task losses and loss combiners.

Task losses: SST cross-entropy; QQP binary cross-entropy on the logit; STS by
``sts_loss``:
  * ``mse``: MSE between the 0..5 score and the label;
  * ``ce_bins``: cross-entropy over the 6 rounded scores (the score is the expectation);
  * ``cosine_mse``: MSE between the cosine score s·cos(u, v) + t (``sts_cosine_map``;
    report 002's is 2.5·(cos + 1)) and the label, plus the head's MSE when the head is a
    regression;
  * ``cosine_embedding``: ``nn.CosineEmbeddingLoss`` on (u, v) with the label
    binarised at 2.5 (report 002), plus the head's MSE when the head is a regression.

A loss combiner turns ``{task: loss}`` into per-task weighted losses (and may own
parameters) and adds the L1/L2 weight penalty (``loss_weighting``: ``sum``, ``fixed``
with ``w_sst/w_qqp/w_sts``, or ``uncertainty`` with learned s_i; ``l1_lambda``,
``l2_lambda``); the gradient combiner (gradients.py) then sets the gradients.  The
weighting and the penalty are written once for one trial and for N stacked trials (a
fused step's ``[N]`` losses; :func:`stack_combiners`, :func:`weight_penalty`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mtbert.core.config import TrainConfig
from mtbert.data import ROW_WEIGHTS
from mtbert.model.model import COSINE_MAPS, TaskOutput
from mtbert.model.trial_axis import fold_trials
from mtbert.core.tasks import TASK_NAMES


def weighted_mean(values: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """The mean of per-row ``values`` over the rows of weight 1 (a fixed-size batch's filler
    rows weigh 0: the same value, and gradient, as the batch without them)."""
    if weights is None:
        return values.mean()
    weights = weights.to(values.dtype)
    return (values * weights).sum() / weights.sum().clamp(min=1.0)


def _wide(x: torch.Tensor) -> torch.Tensor:
    """``x`` in float32 for the loss, or as it is when wider (a float64 model, as the tests
    that compare runs to 1e-8 train)."""
    return x if x.dtype == torch.float64 else x.float()


def _cross_entropy_rows(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Each row's cross-entropy (in a fused step, every trial's rows in one call)."""
    return F.cross_entropy(logits, labels, reduction="none")


def _binary_cross_entropy_rows(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Each row's binary cross-entropy on its logit (fused: every trial's rows at once)."""
    return F.binary_cross_entropy_with_logits(logits, labels, reduction="none")


def task_loss(task: str, out: TaskOutput, labels: torch.Tensor, cfg: TrainConfig,
              weights: torch.Tensor | None = None) -> torch.Tensor:
    """The task's loss, a mean over the batch's rows (``weights``: 0 for filler rows)."""
    if task == "sst":
        rows = fold_trials(_cross_entropy_rows, _wide(out.logits), labels.long())
    elif task == "qqp":
        logits = _wide(out.logits)
        rows = fold_trials(_binary_cross_entropy_rows, logits, labels.to(logits.dtype))
    else:
        return sts_loss(out, labels.float(), cfg, weights)
    return weighted_mean(rows, weights)


def loss_and_output(model, task: str, batch: dict[str, torch.Tensor], cfg: TrainConfig
                    ) -> tuple[torch.Tensor, TaskOutput]:
    """``model``'s forward on a task batch and its :func:`task_loss` (filler rows weigh 0):
    the loss before any regulariser's term, and the output the term compares."""
    out = model(task, batch)
    return task_loss(task, out, batch["labels"], cfg, batch.get(ROW_WEIGHTS)), out


def batch_loss(model, task: str, batch: dict[str, torch.Tensor], cfg: TrainConfig,
               regulariser=None) -> torch.Tensor:
    """One task batch's training loss: ``model``'s forward, :func:`task_loss` (filler rows
    weigh 0) and the regulariser's term (SMART) when there is one -- the eager step, the
    captured step and the fused step all take it from here."""
    loss, out = loss_and_output(model, task, batch, cfg)
    if regulariser is not None:
        loss = loss + regulariser.term(model, task, batch, out)
    return loss


def sts_loss(out: TaskOutput, y: torch.Tensor, cfg: TrainConfig,
             weights: torch.Tensor | None = None) -> torch.Tensor:
    def mse(score: torch.Tensor) -> torch.Tensor:
        return weighted_mean((_wide(score) - y) ** 2, weights)
    kind = cfg.sts_loss
    if kind == "mse":
        return mse(out.score)
    if kind == "ce_bins":
        return weighted_mean(fold_trials(_cross_entropy_rows, _wide(out.logits),
                                         y.round().long()), weights)
    head_mse = mse(out.score) if cfg.sts_head == "regression" else 0.0
    if kind == "cosine_mse":
        cos_score = out.cos_score
        if cos_score is None:  # an output built without the model: the map's starting (s, t)
            scale, shift = COSINE_MAPS[cfg.sts_cosine_map]
            cos_score = scale * F.cosine_similarity(_wide(out.u), _wide(out.v), dim=-1) + shift
        return mse(cos_score) + head_mse
    if kind == "cosine_embedding":
        target = torch.where(y >= 2.5, 1.0, -1.0)
        rows = F.cosine_embedding_loss(_wide(out.u), _wide(out.v), target, reduction="none")
        return weighted_mean(rows, weights) + head_mse
    raise ValueError(f"unknown sts_loss {kind!r}")


def penalised_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The weights the L1/L2 penalties act on: every trainable parameter with ≥ 2 dims
    (weight matrices and embedding tables), *excluding* biases and LayerNorm gains/shifts
    (the same split as the trainer's weight-decay groups: penalising LayerNorm gains
    towards 0 would fight the normalisation, and biases carry no capacity to regularise)."""
    return [p for name, p in model.named_parameters()
            if p.requires_grad and p.ndim >= 2 and "LayerNorm" not in name
            and not name.endswith("bias")]


def weight_penalty(params: list[torch.Tensor], l1: float, l2: float,
                   trial_axis: bool = False) -> torch.Tensor | None:
    """``l1 · Σ|θ| + l2 · Σ θ²`` over ``params`` (report 002 §4.2.2), or None when both are
    0: one number, or with ``trial_axis`` one a trial (``[N]``: each tensor's leading axis
    is the trials', as a fused step stacks them)."""
    if not params or not (l1 or l2):
        return None

    def summed(values) -> torch.Tensor:  # over each tensor (within a trial), then over them
        per_tensor = torch.stack([v.flatten(1).sum(1) if trial_axis else v.sum()
                                  for v in values])
        return per_tensor.sum(0) if trial_axis else per_tensor.sum()

    total = l1 * summed(p.abs() for p in params) if l1 else None
    if l2:
        term = l2 * summed(p.pow(2) for p in params)
        total = term if total is None else total + term
    return total


def fixed_weighted(loss: torch.Tensor, weight: float | torch.Tensor) -> torch.Tensor:
    """w_t · L_t: ``weight`` a number (one trial) or an ``[N]`` tensor of each trial's."""
    if isinstance(weight, torch.Tensor):
        weight = weight.to(loss.dtype)
    return weight * loss


def uncertainty_weighted(loss: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """exp(−s_t) · L_t + s_t (Kendall et al. 2018): ``s`` the learned log variance, 0-d (one
    trial) or ``[N]`` (each trial's)."""
    return torch.exp(-s) * loss + s


class LossCombiner(nn.Module):
    """``weighted({task: loss}) -> {task: weighted loss}``; ``penalty(model)`` adds a term.

    Every combiner carries the weight penalties of report 002 §4.2.2:
    ``penalty(model) = l1_lambda · Σ|θ| + l2_lambda · Σ θ²`` over
    :func:`penalised_parameters` (weight matrices and embeddings; no biases, no
    LayerNorm), or None when both are 0 (the plain loss is then unchanged).

    The weighting is written once for one trial and for N: a loss may be one number or
    ``[N]`` (the trials of a fused step), a combiner's values numbers or 0-d tensors (one
    trial) or ``[N]`` tensors (:func:`stack_combiners`).
    """

    def __init__(self, cfg: TrainConfig | None = None):
        super().__init__()
        self.l1 = float(cfg.l1_lambda) if cfg is not None else 0.0
        self.l2 = float(cfg.l2_lambda) if cfg is not None else 0.0

    def weighted(self, losses: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return dict(losses)

    def penalised(self, model: nn.Module) -> list[nn.Parameter]:
        """The parameters :meth:`penalty` reaches ([] when both penalties are 0)."""
        return penalised_parameters(model) if self.l1 or self.l2 else []

    def penalty(self, model: nn.Module) -> torch.Tensor | None:
        return weight_penalty(self.penalised(model), self.l1, self.l2)


class SumCombiner(LossCombiner):
    """L = Σ_i L_i."""


class FixedCombiner(LossCombiner):
    """L = Σ_i w_i L_i with the config's ``w_sst``, ``w_qqp``, ``w_sts`` (or ``weights``:
    task -> a number, or an ``[N]`` tensor of each trial's)."""

    def __init__(self, cfg: TrainConfig | None = None,
                 weights: dict[str, float | torch.Tensor] | None = None):
        super().__init__(cfg)
        self.weights = (weights if weights is not None
                        else {"sst": cfg.w_sst, "qqp": cfg.w_qqp, "sts": cfg.w_sts})

    def weighted(self, losses):
        return {t: fixed_weighted(loss, self.weights[t]) for t, loss in losses.items()}


class UncertaintyCombiner(LossCombiner):
    """Homoscedastic uncertainty weighting (Kendall et al. 2018; report 002 §4.2.2):
    L = Σ_i exp(−s_i)·L_i + s_i, one learnable s_i (log variance) per task, initialised at
    0 so the start is exactly the plain sum. ``s`` holds them as ``nn.Parameter`` s; the
    trainer puts them in their own optimizer group without weight decay."""

    def __init__(self, cfg: TrainConfig | None = None, tasks: tuple[str, ...] = TASK_NAMES):
        super().__init__(cfg)
        self.s = nn.ParameterDict({t: nn.Parameter(torch.zeros(())) for t in tasks})

    def weighted(self, losses):
        return {t: uncertainty_weighted(loss, self.s[t]) for t, loss in losses.items()}


#: the combiners that weigh a trial axis as one trial (a subclass may weigh otherwise)
_STACKABLE = (SumCombiner, FixedCombiner, UncertaintyCombiner)


def stack_combiners(combiners: list[LossCombiner], device: torch.device) -> LossCombiner:
    """N trials' combiners as one combiner over the trial axis (their losses ``[N]``), for a
    fused step: ``fixed`` weights as ``[N]`` tensors (``sum`` trials among them at 1);
    ``uncertainty``'s learned s_t stacked into one ``[N]`` parameter a task, each trial's
    own combiner then holding views of its slices (its checkpoint's state).  Its penalty
    settings are the first trial's (the step's structure).  A combiner of another kind is
    refused: it weighs in its own way, which the stacked one would not."""
    kinds = {type(c) for c in combiners}
    if not kinds <= set(_STACKABLE) or (UncertaintyCombiner in kinds and len(kinds) > 1):
        odd = next((k for k in kinds if k not in _STACKABLE), UncertaintyCombiner)
        raise ValueError(f"cannot train fused: loss combiner {odd.__name__} has no trial-axis "
                         "form (mtbert/techniques/losses.py: stack_combiners)")
    first = combiners[0]
    if kinds == {UncertaintyCombiner}:
        stacked = UncertaintyCombiner(tasks=tuple(first.s))
        with torch.no_grad():
            for task, s in stacked.s.items():
                s.data = torch.stack([c.s[task].detach() for c in combiners]).to(device)
        for n, combiner in enumerate(combiners):
            for task, s in combiner.s.items():
                s.data = stacked.s[task].detach()[n]
    elif FixedCombiner in kinds:
        stacked = FixedCombiner(weights={
            t: torch.tensor([float(c.weights[t]) if isinstance(c, FixedCombiner) else 1.0
                             for c in combiners], dtype=torch.float64, device=device)
            for t in TASK_NAMES})
    else:
        stacked = SumCombiner()
    stacked.l1, stacked.l2 = first.l1, first.l2
    return stacked


def build_loss_combiner(cfg: TrainConfig) -> LossCombiner:
    if cfg.loss_weighting == "fixed":
        return FixedCombiner(cfg)
    if cfg.loss_weighting == "uncertainty":
        return UncertaintyCombiner(cfg)
    return SumCombiner(cfg)
