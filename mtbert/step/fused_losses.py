"""Loss weighting of fused trials: each trial's task losses weighted as its solo
:class:`~mtbert.losses.LossCombiner` weighs them, the weights as ``[N]`` tensors.

* ``sum``: L_t;  ``fixed``: w_t · L_t with the trial's ``w_sst/w_qqp/w_sts``;
* ``uncertainty`` (Kendall et al. 2018): exp(−s_t) · L_t + s_t, the learned log
  variances s_t stacked into one ``[N]`` leaf per task, trained by the fused AdamW in the
  trial's own optimizer group; each trial's combiner holds views of its slices (its
  checkpoint's state).

The kind of weighting is the group's structure; the values are each trial's.
"""

from __future__ import annotations

import torch
from torch import nn

from mtbert.techniques.losses import FixedCombiner, SumCombiner, UncertaintyCombiner
from mtbert.core.tasks import TASK_NAMES

#: the prefix of a loss combiner's parameters among a fused trial's trained tensors
PREFIX = "loss_weighting."


def combiner_parameters(combiner: nn.Module) -> dict[str, nn.Parameter]:
    """A trial's loss-combiner parameters (uncertainty's s_t), named as the fused group
    names them."""
    return {PREFIX + k: p for k, p in combiner.named_parameters()}


class FusedLossWeighting:
    """``weighted(task, losses)``: ``[N]`` weighted losses; ``params``: name -> the stacked
    leaf of a learned weight (none for ``sum`` and ``fixed``)."""

    def __init__(self, combiners: list[nn.Module], device: torch.device):
        self.params = {name: torch.stack([combiner_parameters(c)[name].detach()
                                          for c in combiners]).to(device).requires_grad_(True)
                       for name in combiner_parameters(combiners[0])}
        for n, combiner in enumerate(combiners):
            for name, p in combiner_parameters(combiner).items():
                p.data = self.params[name].detach()[n]
        self.learned = {t: self.params.get(f"{PREFIX}s.{t}") for t in TASK_NAMES}
        self.fixed = {t: torch.tensor([_fixed_weight(c, t) for c in combiners],
                                      dtype=torch.float64, device=device)
                      for t in TASK_NAMES}

    def weighted(self, task: str, losses: torch.Tensor) -> torch.Tensor:
        s = self.learned[task]
        if s is not None:
            return torch.exp(-s) * losses + s  # uncertainty: exp(−s_t)·L_t + s_t
        return self.fixed[task].to(losses.dtype) * losses

    def reached(self, task: str) -> set[str]:
        """The names of the learned weights ``task``'s weighted loss reaches."""
        return {f"{PREFIX}s.{task}"} & self.params.keys()


def _fixed_weight(combiner: nn.Module, task: str) -> float:
    """The fixed weight of ``task`` in one trial's combiner: 1 for ``sum``, ``w_t`` for
    ``fixed``, 1 for ``uncertainty`` (its learned s_t weigh the loss instead); a combiner
    of another kind has no fused form, and is refused rather than summed."""
    if isinstance(combiner, FixedCombiner):
        return float(combiner.weights[task])
    if isinstance(combiner, (SumCombiner, UncertaintyCombiner)):
        return 1.0
    raise ValueError(f"cannot train fused: loss combiner {type(combiner).__name__} has no "
                     "fused form (mtbert/step/fused_losses.py)")
