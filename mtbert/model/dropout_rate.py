"""Dropout whose rate is a device tensor, for captured step graphs.

``nn.Dropout`` hands its rate ``p`` to the kernel as a number: a CUDA graph captured with
it replays that rate for ever.  :class:`RateDropout` reads the rate from a 0-d tensor
(shared by every dropout the ``dropout`` setting governs), so a graph captured in one run
replays another run's rate after :meth:`DropoutRate.fill` -- what lets a reused worker
keep its graphs for the next trial (``mtbert.graph_reuse``).

Inverted dropout as ``nn.Dropout`` computes it: each element kept with probability
1 − p and scaled by 1/(1 − p), so E[out] = x; the keep mask is ``u ≥ p`` for u uniform
on [0, 1) drawn in float32 from torch's default generator (graph-safe on CUDA: each
replay draws fresh numbers).  The numbers drawn differ from ``nn.Dropout``'s, so a run
uses one or the other throughout: the trainer swaps these in on CUDA, in eager and
graphed steps alike.
"""

from __future__ import annotations

import torch
from torch import nn


class DropoutRate:
    """The rate p and the scale 1/(1 − p) as 0-d float32 tensors on one device."""

    def __init__(self, p: float, device: torch.device):
        self.p = torch.tensor(float(p), dtype=torch.float32, device=device)
        self.scale = torch.tensor(1.0 / (1.0 - float(p)), dtype=torch.float32, device=device)
        self.value = float(p)

    def fill(self, p: float) -> None:
        """A new rate, in place (no host synchronisation)."""
        self.p.fill_(float(p))
        self.scale.fill_(1.0 / (1.0 - float(p)))
        self.value = float(p)


class RateDropout(nn.Module):
    """Inverted dropout at the rate ``rate.p`` (a tensor); identity in eval mode.  ``p`` is
    the rate as a number, for code that reads ``module.p`` (it follows :meth:`DropoutRate.fill`)."""

    def __init__(self, rate: DropoutRate):
        super().__init__()
        self.rate = rate

    @property
    def p(self) -> float:
        return self.rate.value

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return x
        # the mask times 1/(1 - p) in float32, applied in float32 and rounded once (a bf16
        # scale would be off by up to 0.4 %)
        mask = (torch.rand(x.shape, dtype=torch.float32, device=x.device) >= self.rate.p
                ) * self.rate.scale
        return (x * mask).to(x.dtype)

    def extra_repr(self) -> str:
        return f"p=tensor ({self.rate.value:g})"


def _attention_owned(parent: nn.Module) -> bool:
    """An attention module's own dropout (BERT's attention reads its ``.p`` as the
    attention-probability dropout; ``dropout`` does not set that one)."""
    return type(parent).__name__.endswith("Attention")


def governed_dropouts(model: nn.Module, p: float) -> list[tuple[nn.Module, str]]:
    """(parent, attribute name) of every dropout the ``dropout`` setting ``p`` governs: the
    ``nn.Dropout`` s at rate ``p`` (the encoder's hidden dropouts and the heads') and any
    :class:`RateDropout`, attention modules' own left out."""
    found = []
    for parent in list(model.modules()):
        if _attention_owned(parent):
            continue
        for name, child in list(parent.named_children()):
            if (type(child) is nn.Dropout and child.p == p) or isinstance(child, RateDropout):
                found.append((parent, name))
    return found


def hold_dropout_in_tensor(model: nn.Module, p: float, device: torch.device) -> DropoutRate:
    """Swap every dropout the ``dropout`` setting governs (:func:`governed_dropouts`) for a
    :class:`RateDropout` sharing one :class:`DropoutRate`; returns it."""
    rate = DropoutRate(p, device)
    for parent, name in governed_dropouts(model, p):
        setattr(parent, name, RateDropout(rate))
    return rate
