"""Batching: a task's rows in seeded, length-bucketed index batches (:class:`TaskBatcher`)
and padded tensors (:func:`collate`; static lengths and fixed row counts where shapes are
costly), and the evaluation batches."""

from __future__ import annotations

import numpy as np
import torch

from mtbert.data.splits import Split
from mtbert.core.tasks import TASKS

def encoding_for(task: str, pair_encoding: str) -> str:
    """'single' for SST; 'cross' or 'siamese' for the pair tasks."""
    return "single" if not TASKS[task].is_pair else pair_encoding


class TaskBatcher:
    """Index batches over one task's training split, epoch after epoch.

    With bucketing, each pass shuffles the rows, cuts them into buckets of
    ``bucket_batches`` batches, sorts each bucket by length, cuts batches and
    shuffles the batch order. Pass ``k`` is a pure function of (seed, task, k), so
    a checkpoint only needs (pass, position) to resume the exact same stream.
    """

    def __init__(self, split: Split, batch_size: int, encoding: str, seed: int,
                 bucketing: bool = True, bucket_batches: int = 50):
        self.split = split
        self.batch_size = batch_size
        self.lengths = split.lengths(encoding)
        self.seed = seed
        self.bucketing = bucketing
        self.bucket_batches = bucket_batches
        self.pass_index = 0
        self.position = 0
        self._batches = self._make_pass(0)

    @property
    def num_batches(self) -> int:
        return -(-len(self.split) // self.batch_size)

    def _make_pass(self, k: int) -> list[np.ndarray]:
        task_key = sum(ord(c) * 31 ** i for i, c in enumerate(self.split.task))
        rng = np.random.default_rng([self.seed, task_key, k])
        order = rng.permutation(len(self.split))
        if not self.bucketing:
            return [order[i:i + self.batch_size] for i in range(0, len(order), self.batch_size)]
        bucket = self.batch_size * self.bucket_batches
        batches = []
        for start in range(0, len(order), bucket):
            chunk = order[start:start + bucket]
            chunk = chunk[np.argsort(self.lengths[chunk], kind="stable")]
            batches.extend(chunk[i:i + self.batch_size] for i in range(0, len(chunk), self.batch_size))
        return [batches[i] for i in rng.permutation(len(batches))]

    def next_batch(self) -> np.ndarray:
        if self.position >= len(self._batches):
            self.pass_index += 1
            self.position = 0
            self._batches = self._make_pass(self.pass_index)
        batch = self._batches[self.position]
        self.position += 1
        return batch

    def state_dict(self) -> dict[str, int]:
        return {"pass_index": self.pass_index, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.pass_index = int(state["pass_index"])
        self.position = int(state["position"])
        self._batches = self._make_pass(self.pass_index)


#: static padded lengths (``pad_lengths=buckets``): a batch is padded up to the first that
#: holds its longest row.  Few lengths = few shapes (each costs a CUDA graph capture, see
#: step_graphs.py).  Measured on the real training files (batches of 32, length-bucketed),
#: padded tokens / real tokens: cross-encoded 1.47-1.64x with 32/64/128 against 1.32-1.36x
#: with the six lengths 16..128 (1.04-1.05x at the batch's longest); siamese 1.97-2.17x
#: against 1.43-1.44x.  A GPU step of 32 rows is bound by kernel launches, not by these
#: tokens, so three shapes per task win (docs/bench/step_graphs.md)
STATIC_LENGTHS = (32, 64, 128, 256, 512)

#: the batch key holding each row's weight in a fixed-size batch: 1 for a real row, 0 for a
#: filler row (``collate(..., rows=n)``); losses, SMART divergences and metrics weigh by it
ROW_WEIGHTS = "row_weights"


def static_length(longest: int, max_length: int) -> int:
    """The padded length of a batch whose longest row has ``longest`` tokens: the first
    of :data:`STATIC_LENGTHS` that holds it, capped at ``max_length`` (rows are truncated
    to ``max_length`` when tokenised, so the cap always holds them)."""
    for length in STATIC_LENGTHS:
        if length >= longest:
            return max(min(length, max_length), longest)
    return max(longest, max_length)


def pad_rows(rows: list[np.ndarray], pad_id: int, width: int = 0, num_rows: int = 0,
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """``[num_rows or len(rows), width]`` ids and mask (``width`` 0: the longest row's).
    Filler rows past ``len(rows)`` hold one attended ``pad_id`` token (so attention and
    mean pooling stay finite)."""
    lengths = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
    width = width or int(lengths.max())
    if num_rows > len(rows):
        lengths = np.concatenate([lengths, np.ones(num_rows - len(rows), dtype=np.int64)])
        rows = [*rows, *([np.full(1, pad_id, dtype=np.int32)] * (num_rows - len(rows)))]
    mask = np.arange(width) < lengths[:, None]
    ids = np.full((len(rows), width), pad_id, dtype=np.int64)
    ids[mask] = np.concatenate(rows)  # row-major: row i's tokens fill its first lengths[i] slots
    return torch.from_numpy(ids), torch.from_numpy(mask.astype(np.int64))


def _width(rows: list[np.ndarray], static_max_length: int) -> int:
    longest = max(len(r) for r in rows)
    return static_length(longest, static_max_length) if static_max_length else longest


def collate(split: Split, indices: np.ndarray, encoding: str, pad_id: int,
            static_max_length: int = 0, rows: int = 0) -> dict[str, torch.Tensor]:
    """Padded tensors for the rows ``indices``: padding to the batch's longest row, or with
    ``static_max_length`` (``pad_lengths=buckets``) up to its :func:`static_length` (both
    siamese sides to one length, so each task meets one shape per static length).

    ``rows``: a fixed batch size; a batch of fewer rows gets filler rows (one attended pad
    token, label 0) and every batch gets ``row_weights`` (:data:`ROW_WEIGHTS`), 0 on the
    fillers, so one shape serves every batch of the task.

    Keys: single -> ``input_ids, attention_mask``; cross -> also ``token_type_ids``;
    siamese -> ``input_ids_a, attention_mask_a, input_ids_b, attention_mask_b``;
    plus ``labels`` when the split is labelled.
    """
    tok = split.tokens
    static = static_max_length
    n = max(rows, len(indices))
    batch: dict[str, torch.Tensor] = {}
    if encoding == "single":
        seqs = [tok.a[i] for i in indices]
        batch["input_ids"], batch["attention_mask"] = pad_rows(seqs, pad_id, _width(seqs, static), n)
    elif encoding == "cross":
        seqs = [tok.pair[i] for i in indices]
        width = _width(seqs, static)
        batch["input_ids"], batch["attention_mask"] = pad_rows(seqs, pad_id, width, n)
        batch["token_type_ids"], _ = pad_rows([tok.pair_types[i] for i in indices], 0, width, n)
    else:
        a, b = [tok.a[i] for i in indices], [tok.b[i] for i in indices]
        width_a, width_b = _width(a, static), _width(b, static)
        if static:
            width_a = width_b = max(width_a, width_b)
        batch["input_ids_a"], batch["attention_mask_a"] = pad_rows(a, pad_id, width_a, n)
        batch["input_ids_b"], batch["attention_mask_b"] = pad_rows(b, pad_id, width_b, n)
    if split.labels is not None:
        labels = np.asarray(split.labels[indices])
        if n > len(indices):
            labels = np.concatenate([labels, np.zeros(n - len(indices), dtype=labels.dtype)])
        batch["labels"] = torch.from_numpy(labels)
    if rows:
        weights = np.zeros(n, dtype=np.float32)
        weights[:len(indices)] = 1.0
        batch[ROW_WEIGHTS] = torch.from_numpy(weights)
    return batch


def real_rows(batch: dict[str, torch.Tensor]) -> int:
    """The rows of a host batch that are data (filler rows of a fixed-size batch aside)."""
    weights = batch.get(ROW_WEIGHTS)
    return len(batch["labels"]) if weights is None else int(weights.sum())


#: padded tokens per evaluation batch on a CPU when ``eval_batch_tokens`` is 0 (auto).
#: A CPU's cost follows the padded tokens; batches of 128 rows in length order pad the
#: long tail: scoring bench/search_efficiency.py's 3 x 300 validation rows took 9.6 s at
#: 128 rows a batch, 6.7 s at 1,024 tokens (MiniLM, one thread; 1,024 to 2,048 alike)
EVAL_TOKENS_CPU = 1024
#: ... and on a GPU, where a batch must be large to fill the chip: 1,024 rows and at most
#: 65,536 padded tokens (MiniLM's activations for that are ~0.2 GB in bf16)
EVAL_ROWS_GPU, EVAL_TOKENS_GPU = 1024, 65536
EVAL_ROWS_CPU = 128


def eval_token_cap(eval_batch_tokens: int, device_type: str) -> int:
    """The padded-token cap of evaluation batches: the configured one, or for 0 (auto)
    :data:`EVAL_TOKENS_CPU` on a CPU and :data:`EVAL_TOKENS_GPU` on an accelerator."""
    if eval_batch_tokens:
        return eval_batch_tokens
    return EVAL_TOKENS_CPU if device_type == "cpu" else EVAL_TOKENS_GPU


def eval_rows(eval_batch_size: int, device_type: str) -> int:
    """Rows per evaluation batch: the configured ``eval_batch_size``, or for 0 (auto)
    :data:`EVAL_ROWS_CPU` on a CPU and :data:`EVAL_ROWS_GPU` on an accelerator."""
    if eval_batch_size:
        return eval_batch_size
    return EVAL_ROWS_CPU if device_type == "cpu" else EVAL_ROWS_GPU


def eval_batches(split: Split, batch_size: int, encoding: str, max_tokens: int = 0):
    """Index batches in length order (least padding); callers restore row order. A batch
    holds at most ``batch_size`` rows and, with ``max_tokens``, at most that many padded
    tokens (rows x its longest row; a longer row is a batch alone). The count is before
    any static-length rounding (``pad_lengths=buckets``), which ``collate`` adds later."""
    lengths = split.lengths(encoding)
    order = np.argsort(lengths, kind="stable")
    start = 0
    while start < len(order):
        stop = min(start + batch_size, len(order))
        if max_tokens:
            # in length order the k-th row is its batch's longest: k rows pad to k x its
            # length, which grows with k, so the rows that fit are a prefix
            fits = np.arange(1, stop - start + 1) * lengths[order[start:stop]] <= max_tokens
            stop = start + max(1, int(fits.sum()))
        yield order[start:stop]
        start = stop
