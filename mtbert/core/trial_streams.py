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
states a CUDA graph can register).  What a trial alone draws in the remembered forward
(:func:`trial_draw` outside ``vmap``: a solo trial's dropout masks) is also kept on a tape,
and a replay takes those tensors again instead of drawing them anew: the same numbers,
without their cost (drawing the masks was a tenth of a SMART step of MiniLM on one CPU
thread, three of its four forwards replays).  A replay that asks for a draw the tape does
not hold in that order (another shape, dtype or device) is an error: it would not be the
forward it replays.

:func:`trial_draw` draws each trial's slice of a tensor with a leading trial axis from that
trial's generator, also inside ``vmap`` (where torch's random ops take no generator): the
slice is drawn as the trial alone draws its tensor.
"""

from __future__ import annotations

import contextlib
import threading
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


class _Tape:
    """The draws :func:`trial_draw` took from ``generator`` since a
    :meth:`StreamReplay.remember` (recording), given back in order by each replay of it
    (``at``: the next one's index)."""

    def __init__(self, generator: torch.Generator):
        self.generator = generator
        self.draws: list[torch.Tensor] | None = []  # None: released
        self.at: int | None = None  # None: recording

    def take(self, like: torch.Tensor, draw, dtype) -> torch.Tensor:
        if self.at is None:
            out = torch.empty_like(like, dtype=dtype)
            draw(out, self.generator, 0)
            self.draws.append(out)
            return out
        want = (like.shape, dtype or like.dtype, like.device)
        if self.at >= len(self.draws) or (self.draws[self.at].shape, self.draws[self.at].dtype,
                                          self.draws[self.at].device) != want:
            raise RuntimeError(f"a replayed forward's draw {self.at} (shape "
                               f"{tuple(like.shape)}) is not the remembered forward's "
                               f"({len(self.draws)} draws)")
        self.at += 1
        return self.draws[self.at - 1]


_active = threading.local()  # .tape: the tape trial_draw records on or replays from


class StreamReplay:
    """Remembers trial generators' states (before a forward) and runs a block on them again
    (a forward that must draw what that one drew), the generators then left where they stood
    before the block.  A trial's own draws in the remembered forward are kept (module doc)
    until :meth:`release` or the next :meth:`remember`."""

    def __init__(self, generators: Sequence[torch.Generator]):
        self.generators = list(generators)

    def remember(self) -> tuple:
        tape = _Tape(self.generators[0]) if len(self.generators) == 1 else None
        _active.tape = tape
        return self._states(), tape

    def _states(self) -> list:
        return [_get(g) for g in self.generators]

    @staticmethod
    def release(remembered: tuple | None) -> None:
        """The remembered forward's tape is dropped (its tensors freed once unused); a
        later replay of it restores the states alone."""
        tape = remembered[1] if remembered is not None else None
        if tape is not None:
            tape.draws = None
            if getattr(_active, "tape", None) is tape:
                _active.tape = None

    @contextlib.contextmanager
    def replay(self, remembered: tuple | None):
        """The block draws from ``remembered`` (None: draws on as it is)."""
        if remembered is None:
            yield
            return
        states, tape = remembered
        after = self._states()
        for g, state in zip(self.generators, states):
            _set(g, state)
        outer = getattr(_active, "tape", None)
        if tape is not None and tape.draws is not None:
            tape.at = 0
            _active.tape = tape
        try:
            yield
        finally:
            _active.tape = None if outer is tape else outer  # recorded: no more draws
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
        if in_dims[0] is None:
            x = x.expand(info.batch_size, *x.shape)
        elif in_dims[0] != 0:
            x = x.movedim(in_dims[0], 0)
        out = torch.empty_like(x, dtype=dtype, memory_format=torch.contiguous_format)
        _draw_trials(out, draw, generators)
        return out, 0


def _draw_trials(out: torch.Tensor, draw, generators: Sequence[torch.Generator]) -> None:
    """``out`` (``[N, ...]``) drawn for N trials: with one stream (a group's) one draw for
    all, else each trial's slice from its own."""
    if len(generators) == 1:
        draw(out, generators[0], None)
    else:
        for n, part in enumerate(out.unbind(0)):
            draw(part, generators[n], n)


@contextlib.contextmanager
def folded_trials(n: int):
    """Inside the block, tensors hold N trials' rows folded into their leading axis
    (:func:`mtbert.model.trial_axis.fold_trials`): :func:`trial_draw` draws them as it draws
    a ``[N, ...]`` tensor inside ``vmap``."""
    outer = getattr(_active, "folded", None)
    _active.folded = n
    try:
        yield
    finally:
        _active.folded = outer


def trial_draw(x: torch.Tensor, draw: Callable[[torch.Tensor, torch.Generator | None,
                                                int | None], None],
               generators: Sequence[torch.Generator], dtype: torch.dtype | None = None
               ) -> torch.Tensor:
    """A tensor shaped like ``x`` (of ``dtype``, default ``x``'s; no gradient) that
    ``draw(out, generator, n)`` fills in place: for
    one trial with ``generators[0]``; inside ``vmap`` over N trials, trial n's slice (its
    shape a trial's alone) with ``generators[n]``, or with one generator all the trials'
    ``[N, ...]`` at once (``n`` None); the same for N trials' rows folded into one axis
    (:func:`folded_trials`)."""
    folded = getattr(_active, "folded", None)
    if folded is not None:  # N trials' rows in one axis (folded_trials)
        out = torch.empty_like(x, dtype=dtype, memory_format=torch.contiguous_format)
        _draw_trials(out.view(folded, -1, *x.shape[1:]), draw, generators)
        return out
    if not is_batchedtensor(x):  # one trial, outside vmap
        tape = getattr(_active, "tape", None)
        if tape is not None and tape.generator is generators[0]:
            return tape.take(x, draw, dtype)
        out = torch.empty_like(x, dtype=dtype)
        draw(out, generators[0], 0)
        return out
    return _TrialDraw.apply(x, draw, list(generators), dtype)  # x: its shape only
