"""Each trial's random stream: a ``torch.Generator`` of its own, on its device, and the
dropout masks it keys.

A trial draws every random number of its steps from its own generator, passed as
``generator=`` to each draw -- SMART's initial noise, PCGrad's task orders, and once per
step the seed of its dropout masks --; nothing in a step reads or sets torch's global
generator.  The stream starts where the global one stands right after the trial's
construction (its seed, initial weights, any pre-training drawn from the global one).
Its state is in the trial's checkpoints.

Dropout masks (:class:`MaskStream`).  Torch's random ops take one generator each, so N
trials stacked on a trial axis would need a draw per trial at every dropout site: ops
that grow with N.  Instead an element's mask is a hash of the trial's step seed, the
draw's place and the element's coordinates, ``keep = h((s_n ⊕ c) + Σ_j i_j·K_j) ≥ t(p)``
(mod 2³²): ``s_n`` the trial's seed (one 31-bit draw from its generator when its step
begins, :meth:`MaskStream.draw`), ``c`` a code of the draw's place (the task whose forward
draws it and the draw's rank in that forward), ``i_j`` the element's coordinate on axis j
of the trial's own tensor and ``K_j`` a large odd number per axis, ``h`` Wellons'
lowbias32 (xor-shift-multiply: a bijection of 32-bit integers with full avalanche) and
``t(p)`` the threshold that keeps a share 1 − p of the 2³² hash values.  So

* a trial's masks are the same alone and in any group (given the same batches), in ops
  that do not grow with N: one hash over ``[N, ...]`` with each trial's seed broadcast;
* the coordinates enter, never the offset: a batch padded to a group's shapes (more rows,
  longer rows) keeps its elements' masks;
* a forward that must draw what an earlier one drew (SMART's perturbed, ascent and
  teacher forwards replay the clean forward's masks) sets the place back
  (:meth:`MaskStream.replay`; the remembered forward's masks are kept and given back, not
  hashed again): host integers, the same in a CUDA-graph capture (the codes are constants
  of the graph, the seeds a device tensor drawn anew each step);
* a trial's masks for a task do not depend on the other tasks its step trains, nor on
  their order (the code names the task).

On one CPU thread a mask and its multiply take about what ``bernoulli_``'s did: 4.7 against
4.9 ms for MiniLM's attention probabilities (16 rows × 12 heads × 64²), 3.1 against 5.0
for its hidden states (32 × 64 × 384) (CHANGELOG, 2026-12-08).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Mapping

import torch
from torch._C._functorch import is_batchedtensor

from mtbert.core.tasks import TASK_NAMES

#: a draw's code: the task's place in TASK_NAMES and the draw's rank in that task's forward,
#: spread by a multiplier so that nearby places differ in many bits
_SITES_PER_TASK = 1 << 12
_SPREAD = 0x9E3779B1
#: K_j of an element's coordinates (module doc), the last axis first: large odd numbers
_AXIS_MULTIPLIERS = (0x85EBCA6B, 0xC2B2AE35, 0x27D4EB2F, 0x165667B1, 0x9E3779B9)


def trial_generator(device: torch.device) -> torch.Generator:
    """A new stream on ``device`` starting where torch's global generator stands now."""
    device = torch.device(device)
    generator = torch.Generator(device)
    if device.type == "cuda":
        generator.set_state(torch.cuda.get_rng_state(device))
    else:
        generator.set_state(torch.get_rng_state())
    return generator


def keep_threshold(p: float) -> int:
    """t(p): the int32 that a hash value (uniform over int32) reaches with probability
    1 − p (``h ≥ t`` keeps; p = 0 keeps all)."""
    return int(round(float(p) * 2**32)) - 2**31


def mix32_(h: torch.Tensor) -> torch.Tensor:
    """lowbias32 (C. Wellons, "Prospecting for hash functions", 2018) in place on int32:
    x ^= x >> 16; x *= 0x7feb352d; x ^= x >> 15; x *= 0x846ca68b; x ^= x >> 16, the
    shifts logical (a mask after torch's arithmetic shift), the products modulo 2³²."""
    h.bitwise_xor_(h.bitwise_right_shift(16).bitwise_and_(0xFFFF))
    h.mul_(0x7FEB352D)
    h.bitwise_xor_(h.bitwise_right_shift(15).bitwise_and_(0x1FFFF))
    h.mul_(0x846CA68B - 2**32)
    h.bitwise_xor_(h.bitwise_right_shift(16).bitwise_and_(0xFFFF))
    return h


class MaskStream:
    """The dropout masks of one trial (N = 1) or N stacked ones (module doc): each trial's
    seed for the step (``seeds``, ``[N]`` int32 on the device), the place of the next draw
    (host integers: the task, the draw's rank in its forward), and the masks of a forward
    a later one replays (:meth:`remember`), kept until the next is remembered or the next
    step begins: a replay takes them instead of hashing again."""

    def __init__(self, n: int, device: torch.device):
        self.seeds = torch.zeros(n, dtype=torch.int32, device=device)
        self._slots = self.seeds.unbind(0)  # views, made once: a seed drawn in place
        self.task, self.site = 0, 0
        #: code -> mask, of the remembered forward (None: none remembered this step)
        self._tape: dict[int, torch.Tensor] | None = None
        self._replaying = False
        self._coords: dict[tuple, torch.Tensor] = {}  # (size, axis, dims) -> its coordinates

    def draw(self, generators: Mapping[int, torch.Generator]) -> None:
        """The step begins: each slot ``n`` given draws its seed from ``generators[n]``
        (its trial's stream; the slots not given keep theirs: trials not stepping); the
        place goes back to the first task's first draw."""
        self._tape = None
        self.task, self.site = 0, 0
        for n, generator in generators.items():
            self._slots[n].random_(0, 2**31, generator=generator)

    def start(self, task: str) -> None:
        """``task``'s forward of the step begins: its draws take its codes from the first."""
        self.task, self.site = TASK_NAMES.index(task), 0

    def next_code(self) -> int:
        """The code of the next draw (module doc), as an int32; the place moves on."""
        place = self.task * _SITES_PER_TASK + self.site
        self.site += 1
        return (place * _SPREAD + 1) % 2**32 - 2**31

    def remember(self) -> tuple[int, int]:
        """The place of the next draw, for :meth:`replay`; the masks drawn from here on are
        kept for it."""
        self._tape = {}
        return self.task, self.site

    @contextlib.contextmanager
    def replay(self, remembered: tuple[int, int] | None):
        """The block draws the masks drawn from ``remembered`` on (None: draws on as it
        is); after it the place is back where it stood."""
        if remembered is None:
            yield
            return
        after = self.task, self.site
        self.task, self.site = remembered
        self._replaying = True
        try:
            yield
        finally:
            self.task, self.site = after
            self._replaying = False

    def keep(self, shape: torch.Size, device: torch.device, threshold: int | torch.Tensor,
             trials: bool) -> torch.Tensor:
        """The keep mask (bool) of the next draw: of one trial's tensor of ``shape``
        (``trials`` False), or of ``[N, *shape]``, trial n's slice with its seed and, for
        an ``[N]`` ``threshold``, its own rate.  An element's hash takes its coordinates,
        not its offset: padding a tensor (more rows, longer rows) leaves the masks of the
        elements it had as they were."""
        code = self.next_code()
        kept = self._tape.get(code) if self._tape is not None and self._replaying else None
        lead = (self.seeds.shape[0],) if trials else ()
        if kept is not None and kept.shape == lead + tuple(shape):
            return kept
        dims = len(shape)
        h = self.seeds.bitwise_xor(code).view((-1,) + (1,) * dims)
        for axis, size in enumerate(shape):  # (s ⊕ c) + Σ_j i_j·K_j mod 2³²
            h = h + self._coordinates(size, axis, dims, device)
        mix32_(h)
        if isinstance(threshold, torch.Tensor) and threshold.dim() == 1:
            threshold = threshold.view((-1,) + (1,) * dims)
        mask = h.ge(threshold)
        mask = mask if trials else mask.view(shape)
        if self._tape is not None and not self._replaying:
            self._tape[code] = mask
        return mask

    def _coordinates(self, size: int, axis: int, dims: int, device) -> torch.Tensor:
        """i·K mod 2³² for i = 0 … size − 1 along ``axis`` of ``[1, *shape]`` (int32, made
        once; K the axis's multiplier, counted from the last axis)."""
        key = (size, axis, dims, device)
        if key not in self._coords:
            k = _AXIS_MULTIPLIERS[(dims - 1 - axis) % len(_AXIS_MULTIPLIERS)]
            steps = torch.arange(size, dtype=torch.int64) * k % 2**32 - 2**31  # as int32
            self._coords[key] = steps.to(torch.int32).to(device).view(
                (1,) * (axis + 1) + (size,) + (1,) * (dims - axis - 1))
        return self._coords[key]


_active = threading.local()  # .folded: N while tensors hold N trials' rows in one axis


@contextlib.contextmanager
def folded_trials(n: int):
    """Inside the block, tensors hold N trials' rows folded into their leading axis
    (:func:`mtbert.model.trial_axis.fold_trials`): :func:`keep_mask` draws them as it draws
    a ``[N, ...]`` tensor inside ``vmap``."""
    outer = getattr(_active, "folded", None)
    _active.folded = n
    try:
        yield
    finally:
        _active.folded = outer


class _KeepMask(torch.autograd.Function):
    """The keep mask of a tensor like ``x`` (its shape only); under ``vmap`` all the
    trials' at once, each slice with its trial's seed."""

    @staticmethod
    def forward(x, threshold, stream):
        return stream.keep(x.shape, x.device, threshold, trials=False)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.mark_non_differentiable(output)

    @staticmethod
    def backward(ctx, grad):
        return None, None, None

    @staticmethod
    def vmap(info, in_dims, x, threshold, stream):
        shape = x.shape if in_dims[0] is None else (
            x.shape[:in_dims[0]] + x.shape[in_dims[0] + 1:])
        return stream.keep(shape, x.device, threshold, trials=True), 0


def keep_mask(x: torch.Tensor, threshold: int | torch.Tensor, stream: MaskStream
              ) -> torch.Tensor:
    """The dropout keep mask (bool, no gradient) for ``x``, its next draw of ``stream``:
    one trial's; inside ``vmap`` over N trials each trial's slice (its shape a trial's
    alone) with its own seed and ``threshold`` (an int, or ``[N]`` int32: each trial's
    :func:`keep_threshold`); the same for N trials' rows folded into one axis
    (:func:`folded_trials`)."""
    folded = getattr(_active, "folded", None)
    if folded is not None:  # N trials' rows in one axis (folded_trials)
        one = torch.Size((x.shape[0] // folded, *x.shape[1:]))
        return stream.keep(one, x.device, threshold, trials=True).view(x.shape)
    if not is_batchedtensor(x):  # one trial, outside vmap
        return stream.keep(x.shape, x.device, threshold, trials=False)
    return _KeepMask.apply(x, threshold, stream)  # x: its shape only
