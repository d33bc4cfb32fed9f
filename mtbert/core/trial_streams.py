"""Each trial's random stream: a ``torch.Generator`` of its own, on its device.

A trial draws every random number of its steps -- dropout masks
(:mod:`mtbert.model.dropout_rate`), SMART's initial noise, PCGrad's task orders -- from its
own generator, passed as ``generator=`` to each draw; nothing in a step reads or sets
torch's global generator.  The stream starts where the global one stands right after the
trial's construction (its seed, initial weights, any pre-training drawn from the global
one), so a solo run draws the numbers it drew when it used the global generator, and a
trial draws the same numbers alone and in any group.  Its state is in the trial's
checkpoints.

:class:`StreamReplay` is the one way a step takes a draw again: SMART's forwards replay the
clean forward's dropout masks by restoring the trial generators' states remembered before
it (``get_state``/``set_state``; on CUDA ``graphsafe_get_state``/``graphsafe_set_state``,
states a CUDA graph can register).

:func:`trial_draw` draws each trial's slice of a tensor with a leading trial axis from that
trial's generator, also inside ``vmap`` (where torch's random ops take no generator): the
slice is drawn as the trial alone draws its tensor.
"""

from __future__ import annotations

import contextlib
import zlib
from typing import Callable, Sequence

import torch
from torch._C._functorch import is_batchedtensor


def trial_generator(device: torch.device) -> torch.Generator:
    """A new stream on ``device`` starting where torch's global generator stands now."""
    device = torch.device(device)
    generator = torch.Generator(device)
    if device.type == "cuda":
        generator.set_state(torch.cuda.get_rng_state(device))
    else:
        generator.set_state(torch.get_rng_state())
    return generator


class StreamReplay:
    """Remembers trial generators' states (before a forward) and runs a block on them again
    (a forward that must draw what that one drew), the generators then left where they stood
    before the block."""

    def __init__(self, generators: Sequence[torch.Generator]):
        self.generators = list(generators)

    def remember(self) -> list:
        return [_get(g) for g in self.generators]

    @contextlib.contextmanager
    def replay(self, remembered: list | None):
        """The block draws from ``remembered`` (None: draws on as it is)."""
        if remembered is None:
            yield
            return
        after = self.remember()
        for g, state in zip(self.generators, remembered):
            _set(g, state)
        try:
            yield
        finally:
            for g, state in zip(self.generators, after):
                _set(g, state)


def group_generator(generators: Sequence[torch.Generator]) -> torch.Generator:
    """A stream for draws a group of trials takes at once (one op for all: the fused step's
    dropout masks), seeded from where the trials' streams stand, which it does not move."""
    state = b"".join(g.get_state().numpy().tobytes() for g in generators)
    group = torch.Generator(generators[0].device)
    group.manual_seed(zlib.crc32(state) * 2654435761 % 2**63)
    return group


def _get(g: torch.Generator):
    return g.graphsafe_get_state() if g.device.type == "cuda" else g.get_state()


def _set(g: torch.Generator, state) -> None:
    if g.device.type == "cuda":
        g.graphsafe_set_state(state)
    else:
        g.set_state(state)


class _TrialDraw(torch.autograd.Function):
    """A tensor like ``x`` drawn by ``draw(out, generator, n)`` (in place); under ``vmap``
    each trial's slice from its own generator, the slices drawn in turn."""

    @staticmethod
    def forward(x, draw, generators, dtype):
        out = torch.empty_like(x, dtype=dtype)
        draw(out, generators[0] if generators else None, 0)
        return out

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.mark_non_differentiable(output)

    @staticmethod
    def backward(ctx, grad):
        return None, None, None, None

    @staticmethod
    def vmap(info, in_dims, x, draw, generators, dtype):
        x = x.movedim(in_dims[0], 0) if in_dims[0] is not None else x.expand(info.batch_size,
                                                                            *x.shape)
        out = torch.empty_like(x, dtype=dtype, memory_format=torch.contiguous_format)
        if len(generators) == 1:  # one stream for the trials (a group's): one draw
            draw(out, generators[0], None)
        else:
            for n, part in enumerate(out.unbind(0)):
                draw(part, generators[n], n)
        return out, 0


def trial_draw(x: torch.Tensor, draw: Callable[[torch.Tensor, torch.Generator | None,
                                                int | None], None],
               generators: Sequence[torch.Generator], dtype: torch.dtype | None = None
               ) -> torch.Tensor:
    """A tensor shaped like ``x`` (of ``dtype``, default ``x``'s; no gradient) that
    ``draw(out, generator, n)`` fills in place: for
    one trial with ``generators[0]``; inside ``vmap`` over N trials, trial n's slice (its
    shape a trial's alone) with ``generators[n]``, or with one generator all the trials'
    ``[N, ...]`` at once (``n`` None)."""
    if not is_batchedtensor(x):  # one trial, outside vmap
        out = torch.empty_like(x, dtype=dtype)
        draw(out, generators[0], 0)
        return out
    return _TrialDraw.apply(x.detach(), draw, list(generators), dtype)
