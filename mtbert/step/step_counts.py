"""What a training step costs, counted rather than timed: the torch ops it dispatches, and
the token positions it computes against the data rows' own (padding and filler rows; in a
fused step, each task's batches stacked and padded to the most rows and the longest width
among the trials).  What ``tests/test_step_ops.py`` and the fused-padding checks count,
and what ``python -m bench.throughput`` reports."""

from __future__ import annotations

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mtbert.data.batching import ROW_WEIGHTS, SharedBuckets, TaskBatcher


class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched while active (autograd's backward ops included; a
    replayed CUDA graph is the few ops that launch it): the host's work per step."""

    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def real_lengths(batch: dict[str, torch.Tensor]) -> np.ndarray:
    """Attended tokens of each data row's sequences in a host batch (filler rows of a
    fixed-size batch aside; a siamese pair's two sides one after the other)."""
    masks = [v for k, v in batch.items() if k.startswith("attention_mask")]
    weights = batch.get(ROW_WEIGHTS)
    keep = np.ones(len(masks[0]), dtype=bool) if weights is None else weights.numpy() > 0
    return np.concatenate([m.sum(1).numpy()[keep] for m in masks])


def padded_tokens(shapes: list[tuple[int, int] | None], stacked: bool) -> int:
    """Token positions of one padded sequence of a task in one step, from each trial's
    ``(rows, width)`` (None: that trial has no batch of the task): each trial's own, or
    ``stacked``: every trial padded to the most rows and the longest width."""
    have = [s for s in shapes if s is not None]
    if not stacked:
        return sum(rows * width for rows, width in have)
    return len(shapes) * max(rows for rows, _ in have) * max(width for _, width in have)


def step_tokens(batches: dict, fused: bool) -> tuple[int, int]:
    """(executed, real) tokens of one step's host batches ``{trial: {task: batch}}``:
    executed as the engine computes them (``fused``: the trials' batches of a task
    stacked), real the data rows' attended tokens."""
    per_trial = list(batches.values())
    real = sum(int(real_lengths(b).sum()) for tasks in per_trial for b in tasks.values())
    executed = 0
    for task in {task for tasks in per_trial for task in tasks}:
        keys = next(tasks[task] for tasks in per_trial if task in tasks)
        executed += sum(padded_tokens([tuple(tasks[task][k].shape) if task in tasks else None
                                       for tasks in per_trial], fused)
                        for k in keys if k.startswith("input_ids"))
    return executed, real


def group_tokens(split, encoding: str, trials: int, batch_size: int, bucket_batches: int,
                 steps: int, own_buckets: bool, offset: int = 0,
                 batcher_class: type = TaskBatcher) -> tuple[int, int]:
    """(executed, real) tokens of ``steps`` fused steps of ``trials`` trials drawing one
    task's batches together as a fused group draws them (each its own seed, every trial
    from the bucket the first is at; ``own_buckets``: each its own bucket sequence), trial
    i after i x ``offset`` draws of its own: token counts only, no batch padded, no model."""
    batchers = [batcher_class(split, batch_size, encoding, seed, True, bucket_batches)
                for seed in range(trials)]
    own_buckets = own_buckets or batcher_class is not TaskBatcher
    for i, batcher in enumerate(batchers):
        for _ in range(i * offset):
            batcher.next_batch()
    tokens = split.tokens
    sides = ([tokens.a.lengths] if encoding == "single" else [tokens.pair.lengths]
             if encoding == "cross" else [tokens.a.lengths, tokens.b.lengths])
    executed = real = 0
    for _ in range(steps):
        shared = None if own_buckets else SharedBuckets()
        rows = [b.next_batch() if shared is None else b.next_batch(shared.take(split.task, b))
                for b in batchers]
        for lengths in sides:
            executed += padded_tokens([(len(r), int(lengths[r].max())) for r in rows], True)
            real += sum(int(lengths[r].sum()) for r in rows)
    return executed, real
