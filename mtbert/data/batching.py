"""Batching: a task's rows in length buckets and seeded index batches (:class:`TaskBatcher`)
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


#: the seed of the length buckets and of their order in each pass -- not a trial's seed:
#: every trial of a task and batch size cuts the same buckets and visits them in the same
#: order, so trials stepped together take each step's rows from one bucket
BUCKET_SEQUENCE_SEED = 7_000_003


def _task_key(task: str) -> int:
    return sum(ord(c) * 31 ** i for i, c in enumerate(task))


def length_buckets(lengths: np.ndarray, rows_per_bucket: int, task: str) -> list[np.ndarray]:
    """The rows in length order (ties in an order seeded by the task alone), cut into
    buckets of ``rows_per_bucket`` rows (the last one the remainder): every bucket but the
    last holds whole batches, so a pass has as many batches as the split needs."""
    tie_break = np.random.default_rng([BUCKET_SEQUENCE_SEED, _task_key(task)]).random(len(lengths))
    order = np.lexsort((tie_break, lengths))
    return [order[i:i + rows_per_bucket] for i in range(0, len(order), rows_per_bucket)]


class TaskBatcher:
    """Index batches over one task's training split, pass after pass.

    The split is cut once into length buckets of ``bucket_batches`` batches each
    (:func:`length_buckets`; without bucketing, one bucket of every row).  A pass visits
    bucket ``b`` as many times as it has batches, in an order shuffled by the pass number
    and the task -- the same for every trial (:meth:`bucket_at`); each visit takes the next
    batch of the bucket's rows in an order shuffled by the trial's own seed, pass after pass
    over the bucket.  So each pass trains every row once, and a batch's rows are of
    similar lengths.

    ``next_batch(bucket)`` takes the batch from another bucket than this batcher's own
    sequence names: in a fused step every trial drawing a task takes the bucket of the
    first one drawing it (:class:`SharedBuckets`), so their rows pad to one bucket's
    longest.  Alone, the
    stream is a pure function of (seed, task, batches drawn); the state is the number
    drawn and each bucket's pass and position, so a checkpoint resumes the same stream.
    """

    def __init__(self, split: Split, batch_size: int, encoding: str, seed: int,
                 bucketing: bool = True, bucket_batches: int = 2):
        self.split = split
        self.batch_size = batch_size
        self.lengths = split.lengths(encoding)
        self.seed = seed
        self.task_key = _task_key(split.task)
        rows = batch_size * bucket_batches if bucketing else max(len(split), 1)
        self.buckets = length_buckets(self.lengths, rows, split.task)
        self.bucket_sizes = np.array([-(-len(b) // batch_size) for b in self.buckets])
        self.draws = 0
        self.passes = np.zeros(len(self.buckets), dtype=np.int64)     # per bucket
        self.positions = np.zeros(len(self.buckets), dtype=np.int64)  # batches into its pass
        self._sequence: tuple[int, np.ndarray] | None = None
        self._orders: dict[int, tuple[int, np.ndarray]] = {}

    @property
    def num_batches(self) -> int:
        """Batches in a pass over the split."""
        return int(self.bucket_sizes.sum())

    def pass_sequence(self, k: int) -> np.ndarray:
        """The buckets pass ``k`` visits, in order: each as many times as it has batches,
        shuffled by the task and ``k`` alone (every trial's alike)."""
        if self._sequence is None or self._sequence[0] != k:
            rng = np.random.default_rng([BUCKET_SEQUENCE_SEED, self.task_key, k])
            visits = np.repeat(np.arange(len(self.buckets)), self.bucket_sizes)
            self._sequence = (k, rng.permutation(visits))
        return self._sequence[1]

    def bucket_at(self, draw: int) -> int:
        """The bucket the ``draw``-th batch of this task takes (every trial's alike)."""
        k, j = divmod(draw, self.num_batches)
        return int(self.pass_sequence(k)[j])

    def upcoming_bucket(self) -> int:
        """The bucket of this batcher's next batch, by its own sequence."""
        return self.bucket_at(self.draws)

    def next_batch(self, bucket: int | None = None) -> np.ndarray:
        """The next batch: from ``bucket``, default :meth:`upcoming_bucket`."""
        b = self.upcoming_bucket() if bucket is None else bucket
        if self.positions[b] >= self.bucket_sizes[b]:  # the bucket's pass is done
            self.passes[b] += 1
            self.positions[b] = 0
        start = int(self.positions[b]) * self.batch_size
        batch = self._bucket_order(b)[start:start + self.batch_size]
        self.positions[b] += 1
        self.draws += 1
        return batch

    def _bucket_order(self, b: int) -> np.ndarray:
        k = int(self.passes[b])
        cached = self._orders.get(b)
        if cached is None or cached[0] != k:
            rng = np.random.default_rng([self.seed, self.task_key, k, b])
            cached = self._orders[b] = (k, self.buckets[b][rng.permutation(len(self.buckets[b]))])
        return cached[1]

    def state_dict(self) -> dict[str, int | list[int]]:
        return {"draws": self.draws, "bucket_passes": self.passes.tolist(),
                "bucket_positions": self.positions.tolist()}

    def load_state_dict(self, state: dict) -> None:
        if "draws" not in state:  # a checkpoint from before length buckets: its pass and
            # position, continued in this order as a batcher alone would be there
            self._restore_alone(int(state["pass_index"]) * self.num_batches
                                + int(state["position"]))
            return
        passes, positions = state["bucket_passes"], state["bucket_positions"]
        if len(passes) != len(self.buckets) or len(positions) != len(self.buckets):
            raise ValueError(f"the checkpoint's batcher state has {len(passes)} length "
                             f"buckets for {self.split.task}, this data and batch size "
                             f"cut {len(self.buckets)}")
        self.draws = int(state["draws"])
        self.passes = np.asarray(passes, dtype=np.int64)
        self.positions = np.asarray(positions, dtype=np.int64)

    def _restore_alone(self, draws: int) -> None:
        """The state of a batcher that drew ``draws`` batches by its own sequence."""
        k, j = divmod(draws, self.num_batches)
        done = np.bincount(self.pass_sequence(k)[:j], minlength=len(self.buckets))
        self.draws, self.passes, self.positions = draws, np.full(len(self.buckets), k), done


class SharedBuckets:
    """One fused step's length bucket of each task: the first trial to draw a task in the
    step (the group asks them in join order) takes its own next bucket, and every later
    one takes that bucket too, so the task's stacked rows pad to one bucket's longest."""

    def __init__(self):
        self.chosen: dict[str, int] = {}

    def take(self, task: str, batcher: TaskBatcher) -> int:
        if task not in self.chosen:
            self.chosen[task] = batcher.upcoming_bucket()
        return self.chosen[task]


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
    ids, mask = _padded_arrays(rows, pad_id, width, num_rows)
    return torch.from_numpy(ids), torch.from_numpy(mask)


def _padded_arrays(rows: list[np.ndarray], pad_id: int, width: int = 0, num_rows: int = 0,
                   ) -> tuple[np.ndarray, np.ndarray]:
    """:func:`pad_rows`' ids and mask as NumPy arrays."""
    lengths = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
    width = width or int(lengths.max())
    if num_rows > len(rows):
        lengths = np.concatenate([lengths, np.ones(num_rows - len(rows), dtype=np.int64)])
        rows = [*rows, *([np.full(1, pad_id, dtype=np.int32)] * (num_rows - len(rows)))]
    mask = np.arange(width) < lengths[:, None]
    ids = np.full((len(rows), width), pad_id, dtype=np.int64)
    ids[mask] = np.concatenate(rows)  # row-major: row i's tokens fill its first lengths[i] slots
    return ids, mask.astype(np.int64)


def _width(rows: list[np.ndarray], static_max_length: int) -> int:
    longest = max(len(r) for r in rows)
    return static_length(longest, static_max_length) if static_max_length else longest


def collate(split: Split, indices: np.ndarray, encoding: str, pad_id: int,
            static_max_length: int = 0, rows: int = 0) -> HostBatch:
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
    arrays: dict[str, np.ndarray] = {}
    if encoding == "single":
        seqs = [tok.a[i] for i in indices]
        arrays["input_ids"], arrays["attention_mask"] = _padded_arrays(
            seqs, pad_id, _width(seqs, static), n)
    elif encoding == "cross":
        seqs = [tok.pair[i] for i in indices]
        width = _width(seqs, static)
        arrays["input_ids"], arrays["attention_mask"] = _padded_arrays(seqs, pad_id, width, n)
        arrays["token_type_ids"], _ = _padded_arrays([tok.pair_types[i] for i in indices], 0,
                                                     width, n)
    else:
        a, b = [tok.a[i] for i in indices], [tok.b[i] for i in indices]
        width_a, width_b = _width(a, static), _width(b, static)
        if static:
            width_a = width_b = max(width_a, width_b)
        arrays["input_ids_a"], arrays["attention_mask_a"] = _padded_arrays(
            a, pad_id, width_a, n)
        arrays["input_ids_b"], arrays["attention_mask_b"] = _padded_arrays(
            b, pad_id, width_b, n)
    if split.labels is not None:
        labels = np.asarray(split.labels[indices])
        if n > len(indices):
            labels = np.concatenate([labels, np.zeros(n - len(indices), dtype=labels.dtype)])
        arrays["labels"] = labels
    if rows:
        weights = np.zeros(n, dtype=np.float32)
        weights[:len(indices)] = 1.0
        arrays[ROW_WEIGHTS] = weights
    return HostBatch.of(arrays)


class HostBatch(dict):
    """A collated batch: name -> CPU tensor, each sharing its memory with the NumPy array in
    ``arrays`` (what the fused step packs N trials' batches from, without a torch op a
    trial: :func:`mtbert.step.fused_model.stack_batches`).  Built as a dict is (a library
    that rebuilds a mapping by its type, as accelerate's ``send_to_device`` does, gets one
    without arrays); :meth:`array` gives a key's array only while it is the tensor's."""

    def __init__(self, *args, arrays: dict[str, np.ndarray] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.arrays = arrays or {}

    @classmethod
    def of(cls, arrays: dict[str, np.ndarray]) -> "HostBatch":
        return cls({k: torch.from_numpy(v) for k, v in arrays.items()}, arrays=arrays)

    def array(self, key: str) -> np.ndarray:
        """``self[key]`` as NumPy: its collated array while the tensor is still that
        array's memory (read without a torch op), else the tensor's ``numpy()``."""
        tensor, held = self[key], self.arrays.get(key)
        if (held is not None and tensor.data_ptr() == held.ctypes.data
                and tuple(tensor.shape) == held.shape and tensor.device.type == "cpu"):
            return held
        return tensor.numpy()


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
