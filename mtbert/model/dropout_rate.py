"""Dropout at a rate held in device tensors: one trial's, or each of N stacked trials'.

``nn.Dropout`` hands its rate ``p`` to the kernel as a number: a CUDA graph captured with
it replays that rate for ever, and one module cannot drop N stacked trials at their own
rates.  :class:`RateDropout` reads the rate from tensors (buffers of the module, shared by
every dropout the ``dropout`` setting governs): a 0-d rate for one trial, so a graph
captured in one run replays another run's rate after :meth:`DropoutRate.fill` -- what lets
a reused worker keep its graphs for the next trial (``mtbert.loop.graph_reuse``) --; an ``[N]``
rate in a fused model's skeleton (:mod:`mtbert.step.fused_model`), where ``vmap`` hands each
trial its own 0-d slice.  Written once for both.

Inverted dropout as ``nn.Dropout`` computes it: each element kept with probability
1 − p and scaled by 1/(1 − p), so E[out] = x.  The keep mask is the trial's
(:class:`mtbert.core.trial_streams.MaskStream`: a hash of its step seed, the draw's place
and the element's coordinates against the threshold of p), the same alone and stacked with
other trials, in the same ops on the CPU and on CUDA, eager or in a captured graph.  On
the CPU (``number``: a trial's rate, known when the module is built) the threshold and
scale are numbers; otherwise they are read from the rate's tensors (``threshold``, ``[N]``
in a fused skeleton: each trial at its own rate).

Without a mask stream (``DropoutRate.masks`` None: a model of no trial, as pre-training's
encoder) the masks are drawn from torch's global generator, as ``nn.Dropout`` draws them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mtbert.core.trial_streams import MaskStream, keep_mask, keep_threshold


class DropoutRate:
    """The rate p (float32) and the scale 1/(1 − p) (float32, or float64 for a float64
    model) as tensors on one device: 0-d for one trial's rate, ``[N]`` for a list of N
    trials' rates."""

    def __init__(self, p: float | list[float], device: torch.device,
                 scale_dtype: torch.dtype = torch.float32):
        self.p = torch.tensor(p, dtype=torch.float32, device=device)
        self.scale = torch.tensor(_scale(p), dtype=scale_dtype, device=device)
        #: the int32 a mask's hash must reach (trial_streams.keep_threshold), per trial
        self.threshold = torch.tensor(_threshold(p), dtype=torch.int32, device=device)
        self.value = p
        #: the masks' stream (the trial's, or the stacked trials'); None: torch's global
        #: generator
        self.masks: MaskStream | None = None

    def fill(self, p: float) -> None:
        """A new rate for one trial, in place (no host synchronisation)."""
        self.p.fill_(float(p))
        self.scale.fill_(1.0 / (1.0 - float(p)))
        self.threshold.fill_(keep_threshold(p))
        self.value = float(p)


def _scale(p: float | list[float]) -> float | list[float]:
    return [1.0 / (1.0 - float(q)) for q in p] if isinstance(p, list) else 1.0 / (1.0 - float(p))


def _threshold(p: float | list[float]) -> int | list[int]:
    return [keep_threshold(q) for q in p] if isinstance(p, list) else keep_threshold(p)


class RateDropout(nn.Dropout):
    """Inverted dropout at the rate in the buffers ``rate`` and ``scale`` (``rate.p`` and
    ``rate.scale`` of a :class:`DropoutRate`, not saved), or at ``number`` when given;
    identity in eval mode.  ``p`` is the rate as a number, for code that reads or sets
    ``module.p`` as an ``nn.Dropout``'s (it follows :meth:`DropoutRate.fill`; setting it
    fills the rate)."""

    def __init__(self, rate: DropoutRate, number: float | None = None):
        nn.Module.__init__(self)  # not nn.Dropout's: its p is the rate's
        self.inplace = False
        self.held = rate
        self.number = number
        self.register_buffer("rate", rate.p, persistent=False)
        self.register_buffer("scale", rate.scale, persistent=False)

    @property
    def p(self) -> float:
        return self.held.value

    @p.setter
    def p(self, value: float) -> None:
        if self.number is not None:
            self.number = float(value)
        self.held.fill(value)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return x
        if self.number == 0:
            return x
        masks = self.held.masks
        if masks is None:  # no trial stream (pre-training): the global generator
            if self.number is not None:
                return F.dropout(x, self.number, training=True)
            return (x * ((torch.rand(x.shape, dtype=torch.float32, device=x.device)
                          >= self.rate) * self.scale)).to(x.dtype)
        if self.number is not None:
            return x * keep_mask(x, keep_threshold(self.number), masks) * (
                1.0 / (1.0 - self.number))
        # the mask times 1/(1 - p) in float32 (float64 for a float64 model), applied so
        # and rounded once (a bf16 scale would be off by up to 0.4 %)
        keep = keep_mask(x, self.held.threshold, masks)
        return (x * (keep * self.scale)).to(x.dtype)

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


def hold_dropout_in_tensor(model: nn.Module, p: float, device: torch.device,
                           number: bool = False) -> DropoutRate:
    """Swap every dropout the ``dropout`` setting governs (:func:`governed_dropouts`) for a
    :class:`RateDropout` sharing one :class:`DropoutRate`; returns it.  ``number``: the
    modules drop at the number ``p`` (``nn.Dropout``'s arithmetic, from the trial's
    generator), not at the rate tensor."""
    rate = DropoutRate(p, device, scale_dtype(model))
    for parent, name in governed_dropouts(model, p):
        setattr(parent, name, RateDropout(rate, number=float(p) if number else None))
    return rate


def scale_dtype(model: nn.Module) -> torch.dtype:
    """The dtype of the dropout scale for ``model``'s activations: float64 for a float64
    model (its 1/(1 − p) exact), float32 otherwise."""
    first = next(model.parameters(), None)
    double = first is not None and first.dtype == torch.float64
    return torch.float64 if double else torch.float32


def mask_stream_of(model: nn.Module) -> MaskStream | None:
    """The mask stream ``model``'s dropouts take their masks from (a trial's model), or
    None (its dropouts draw from torch's global generator)."""
    return next((m.held.masks for m in model.modules()
                 if isinstance(m, RateDropout) and m.held.masks is not None), None)
