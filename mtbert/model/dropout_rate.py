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
1 − p and scaled by 1/(1 − p), so E[out] = x; the keep mask is ``u ≥ p`` for u uniform
on [0, 1) drawn in float32 from the trial's generator (:mod:`mtbert.core.trial_streams`;
graph-safe on CUDA: each replay draws fresh numbers).  The numbers drawn differ from
``nn.Dropout``'s, so a run uses one or the other throughout: the trainer swaps these in on
CUDA, in eager and graphed steps alike.  On the CPU (``number``: a trial's rate, known when
the module is built; a fused skeleton's trials at theirs) the module is ``nn.Dropout``'s
CPU kernel written out with the trial's generator
(``bernoulli_(1 − p)``, ``div_(1 − p)``: the same numbers), which draws its mask faster than
the rate tensor's uniform numbers and comparison (on one CPU thread 0.25 of MiniLM's 2.3 s
fused step of two trials went to those).

Random streams: the masks come from the generators in ``DropoutRate.generators`` (a
trial's, filled once it is built; empty: torch's global generator, as pre-training draws).
Over N stacked trials (:func:`mtbert.core.trial_streams.trial_draw`): with one generator
(a group's) a mask is one draw for all, each trial at its own rate; with N, each trial's
slice is drawn from its own as it alone draws its mask, a trial at rate 0 drawing nothing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mtbert.core.trial_streams import trial_draw


class DropoutRate:
    """The rate p and the scale 1/(1 − p) as float32 tensors on one device: 0-d for one
    trial's rate, ``[N]`` for a list of N trials' rates."""

    def __init__(self, p: float | list[float], device: torch.device):
        self.p = torch.tensor(p, dtype=torch.float32, device=device)
        self.scale = torch.tensor(_scale(p), dtype=torch.float32, device=device)
        self.value = p
        #: the trials' generators the masks are drawn from (one, or N by slot)
        self.generators: list[torch.Generator] = []

    def fill(self, p: float) -> None:
        """A new rate for one trial, in place (no host synchronisation)."""
        self.p.fill_(float(p))
        self.scale.fill_(1.0 / (1.0 - float(p)))
        self.value = float(p)


def _scale(p: float | list[float]) -> float | list[float]:
    return [1.0 / (1.0 - float(q)) for q in p] if isinstance(p, list) else 1.0 / (1.0 - float(p))


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
        generators = self.held.generators
        if not generators:  # no trial stream (pre-training): the global generator
            if self.number is not None:
                return F.dropout(x, self.number, training=True)
            return (x * ((torch.rand(x.shape, dtype=torch.float32, device=x.device)
                          >= self.rate) * self.scale)).to(x.dtype)
        if self.number is not None or (isinstance(self.held.value, list)
                                       and x.device.type != "cuda"):
            # nn.Dropout's CPU arithmetic: a keep mask of Bernoulli(1 - p) divided by 1 - p
            return x * trial_draw(x, self._keep_mask, generators)
        # the mask times 1/(1 - p) in float32, applied in float32 and rounded once (a bf16
        # scale would be off by up to 0.4 %)
        uniform = trial_draw(x, _uniform, generators, dtype=torch.float32)  # no float copy of x
        return (x * ((uniform >= self.rate) * self.scale)).to(x.dtype)

    def _keep_mask(self, out: torch.Tensor, generator, n: int | None) -> None:
        """Trial ``n``'s mask, Bernoulli(1 − p) / (1 − p) (ones at p = 0: nothing drawn);
        ``n`` None: every trial's at once (``[N, ...]``, each at its own p)."""
        p = self.number if self.number is not None else self.held.value
        if isinstance(p, list) and n is None and len(set(p)) > 1:
            keep = torch.tensor([1 - q for q in p], dtype=out.dtype, device=out.device
                                ).view((-1,) + (1,) * (out.dim() - 1))
            out.copy_(torch.bernoulli(keep.expand(out.shape), generator=generator)).div_(keep)
            return
        p = p[n or 0] if isinstance(p, list) else p
        if p == 0:
            out.fill_(1)
        else:
            out.bernoulli_(1 - p, generator=generator).div_(1 - p)

    def extra_repr(self) -> str:
        return f"p=tensor ({self.held.value})"


def _uniform(out: torch.Tensor, generator, n: int) -> None:
    out.uniform_(0, 1, generator=generator)


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
    rate = DropoutRate(p, device)
    for parent, name in governed_dropouts(model, p):
        setattr(parent, name, RateDropout(rate, number=float(p) if number else None))
    return rate
