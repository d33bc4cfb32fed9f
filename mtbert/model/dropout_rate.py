"""Dropout at a rate held in device tensors: one trial's, or each of N stacked trials'.

``nn.Dropout`` hands its rate ``p`` to the kernel as a number: a CUDA graph captured with
it replays that rate for ever, and one module cannot drop N stacked trials at their own
rates.  :class:`RateDropout` reads the rate from tensors (buffers of the module, shared by
every dropout the ``dropout`` setting governs): a 0-d rate for one trial, so a graph
captured in one run replays another run's rate after :meth:`DropoutRate.fill` -- what lets
a reused worker keep its graphs for the next trial (``mtbert.run.graph_reuse``) --; an ``[N]``
rate in a fused model's skeleton (:mod:`mtbert.step.fused_model`), where ``vmap`` hands each
trial its own 0-d slice.  Written once for both.

Inverted dropout as ``nn.Dropout`` computes it: each element kept with probability
1 − p and scaled by 1/(1 − p), so E[out] = x; the keep mask is ``u ≥ p`` for u uniform
on [0, 1) drawn in float32 from torch's default generator (graph-safe on CUDA: each
replay draws fresh numbers).  The numbers drawn differ from ``nn.Dropout``'s, so a run
uses one or the other throughout: the trainer swaps these in on CUDA, in eager and
graphed steps alike.  Where every trial drops at one rate known when the module is built
(``number``: a fused group whose trials share it) the module is ``F.dropout`` at that
number, ``nn.Dropout``'s kernel, which draws its mask faster than the rate tensor's uniform
numbers and comparison (on one CPU thread 0.25 of MiniLM's 2.3 s fused step of two trials
went to those).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class DropoutRate:
    """The rate p and the scale 1/(1 − p) as float32 tensors on one device: 0-d for one
    trial's rate, ``[N]`` for a list of N trials' rates."""

    def __init__(self, p: float | list[float], device: torch.device):
        self.p = torch.tensor(p, dtype=torch.float32, device=device)
        self.scale = torch.tensor(_scale(p), dtype=torch.float32, device=device)
        self.value = p

    def fill(self, p: float) -> None:
        """A new rate for one trial, in place (no host synchronisation)."""
        self.p.fill_(float(p))
        self.scale.fill_(1.0 / (1.0 - float(p)))
        self.value = float(p)


def _scale(p: float | list[float]) -> float | list[float]:
    return [1.0 / (1.0 - float(q)) for q in p] if isinstance(p, list) else 1.0 / (1.0 - float(p))


class RateDropout(nn.Module):
    """Inverted dropout at the rate in the buffers ``rate`` and ``scale`` (``rate.p`` and
    ``rate.scale`` of a :class:`DropoutRate`, not saved), or at ``number`` when given;
    identity in eval mode.  ``p`` is the rate as a number, for code that reads
    ``module.p`` (it follows :meth:`DropoutRate.fill`)."""

    def __init__(self, rate: DropoutRate, number: float | None = None):
        super().__init__()
        self.held = rate
        self.number = number
        self.register_buffer("rate", rate.p, persistent=False)
        self.register_buffer("scale", rate.scale, persistent=False)

    @property
    def p(self) -> float:
        return self.held.value

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return x
        if self.number is not None:
            return F.dropout(x, self.number, training=True)
        # the mask times 1/(1 - p) in float32, applied in float32 and rounded once (a bf16
        # scale would be off by up to 0.4 %)
        mask = (torch.rand(x.shape, dtype=torch.float32, device=x.device) >= self.rate
                ) * self.scale
        return (x * mask).to(x.dtype)

    def extra_repr(self) -> str:
        return f"p=tensor ({self.held.value})"


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
