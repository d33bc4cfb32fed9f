"""Data: read and validate the CS 224N files, carve the validation split, cache token
ids in Parquet, and build length-bucketed, dynamically padded batches.

Flow: file -> :func:`read_task_file` (validated rows) -> :func:`tokenize_cached`
(Parquet cache keyed by tokenizer, max length and file checksum) -> :class:`Split`
(token ids as ragged arrays) -> :class:`TaskBatcher` (index batches) ->
:func:`collate` (padded tensors).
"""

from __future__ import annotations

import csv
import hashlib
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from mtbert.atomic import atomic_write, check_creatable
from mtbert.config import TrainConfig, cache_dir_source, default_cache_dir
from mtbert.errors import DataError
from mtbert.pretrained import load_tokenizer
from mtbert.tasks import TASK_NAMES, TASKS, TaskSpec

log = logging.getLogger(__name__)

#: part of every token-cache key: "2" since the reader takes one row per line (2026-11),
#: so a file whose rows the old reader merged is not served its old, shorter token table
CACHE_VERSION = "2"


# --------------------------------------------------------------------------- reading
@dataclass
class RawTable:
    """Validated rows of one file; ``lines[i]`` is the line row ``i`` was read from and
    ``skipped`` the lines of the bad rows skipped under ``bad_row_tolerance``."""
    path: str
    checksum: str
    ids: list[str]
    texts: list[list[str]]           # one list per text column
    labels: np.ndarray | None        # None for test-student files
    lines: list[int] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)


def file_checksum(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def read_task_file(path: str | Path, spec: TaskSpec, labelled: bool,
                   bad_row_tolerance: float = 0.0) -> RawTable:
    """Read one tab-separated file, one row per line, and validate every row.

    Raises :class:`DataError` naming the file, the line and what was expected.
    Each line is parsed on its own by the csv module (tab delimiter, doubled-quote
    fields, strict quoting), so a row is always exactly one line: a stray opening
    quote makes its own line a bad row instead of swallowing the lines after it.
    ``bad_row_tolerance`` is the share of data lines (non-blank lines after the header)
    that may be malformed (broken quoting, empty sentence, bad label) and are then
    skipped with a warning naming each line: the real quora-dev.csv has 2 rows of
    20,214 whose broken quoting swallowed the label. A file with more bad rows than
    that fails on its first one. Rows used + rows skipped = the file's data lines.
    """
    path = Path(path)
    raw, text = read_text_file(path, spec)
    lines = [line.removesuffix("\r") for line in text.split("\n")]  # CRLF files too
    header = [h.strip() for h in split_line(lines[0], path, 1)]
    required = ["id", *spec.text_columns] + ([spec.label_column] if labelled else [])
    missing = [c for c in required if c not in header]
    if missing:
        hint = " (is the file tab-separated?)" if len(header) <= 1 else ""
        raise DataError(f"{path}, line 1: missing column {missing[0]!r}; expected tab-separated "
                        f"columns {', '.join(required)}, found {header}{hint}",
                        path=str(path), line=1)
    col = {name: header.index(name) for name in required}

    ids: list[str] = []
    texts: list[list[str]] = [[] for _ in spec.text_columns]
    labels: list[float] = []
    row_lines: list[int] = []
    bad: list[DataError] = []
    data_lines = 0
    for number, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue  # blank line: not a row
        data_lines += 1
        try:
            cells = split_line(line, path, number)
            check_cell_count(cells, header, col, path, number)
            parsed = _parse_row(cells, col, spec, labelled, path, number)
        except DataError as exc:
            bad.append(exc)
            continue
        ids.append(parsed[0])
        for j, sentence in enumerate(parsed[1]):
            texts[j].append(sentence)
        if labelled:
            labels.append(parsed[2])
        row_lines.append(number)
    if bad:
        if len(bad) > int(bad_row_tolerance * data_lines) or not ids:
            more = f" ({len(bad) - 1} more bad rows of {data_lines})" if len(bad) > 1 else ""
            first = bad[0]
            raise DataError(f"{first}{more}", path=first.path, line=first.line)
        for exc in bad:
            log.warning("skipping bad row (within tolerance %.2g): %s", bad_row_tolerance, exc)
    if not ids:
        raise DataError(f"{path}, line 2: no data rows after the header", path=str(path), line=2)
    label_array = None
    if labelled:
        dtype = np.float32 if spec.label_kind == "score" else np.int64
        label_array = np.asarray(labels, dtype=dtype)
    return RawTable(str(path), file_checksum(raw), ids, texts, label_array, row_lines,
                    [exc.line for exc in bad])


def read_text_file(path: Path, spec: TaskSpec) -> tuple[bytes, str]:
    """The bytes and UTF-8 text of one task file; a missing, unreadable, binary, non-UTF-8
    or empty file is a :class:`DataError` naming it (and the line, where there is one)."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise DataError(f"{path}: file not found (expected the {spec.name} file "
                        f"{path.name} of the CS 224N data)", path=str(path)) from None
    except OSError as exc:
        raise DataError(f"{path}: cannot read file ({exc.strerror})", path=str(path)) from None
    if b"\x00" in raw:
        line = raw[: raw.index(b"\x00")].count(b"\n") + 1
        raise DataError(f"{path}, line {line}: binary data (NUL byte); expected a tab-separated "
                        "UTF-8 text file", path=str(path), line=line)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise DataError(f"{path}, line {line}: not valid UTF-8 (byte {raw[exc.start]:#04x}); "
                        "expected a UTF-8 text file", path=str(path), line=line) from None
    if not text.strip():
        raise DataError(f"{path}: file is empty; expected a header line and rows",
                        path=str(path), line=1)
    return raw, text


#: csv's messages in strict mode -> what is wrong with the line, in the user's terms
_CSV_PROBLEMS = {
    "unexpected end of data": "a quoted field opens and does not close on this line "
                              "(a stray quote?)",
    "expected after": "text after the closing quote of a quoted field",
    "new-line character": "a carriage return (\\r) inside an unquoted field",
}


def split_line(line: str, path: Path, number: int) -> list[str]:
    """The cells of one line (tab-separated, doubled-quote fields); a field never spans
    lines, and any quoting error is a :class:`DataError` naming the line."""
    try:
        return next(csv.reader((line,), delimiter="\t", strict=True))
    except csv.Error as exc:
        problem = next((text for key, text in _CSV_PROBLEMS.items() if key in str(exc)),
                       f"malformed CSV ({exc})")
        raise DataError(f"{path}, line {number}: {problem}; expected one tab-separated row "
                        "per line", path=str(path), line=number) from None


def check_cell_count(cells: list[str], header: list[str], col: dict[str, int], path: Path,
                     number: int) -> None:
    """A row has the header's number of cells (empty cells past the end aside): a row or a
    header that gained or lost a tab would otherwise be read with shifted columns."""
    count = len(cells)
    while count > len(header) and not cells[count - 1].strip():
        count -= 1
    if count == len(header):
        return
    missing = [name for name, i in col.items() if i >= count]
    detail = f"; empty or missing {missing[0]!r}" if missing else ""
    raise DataError(f"{path}, line {number}: {count} tab-separated cells, expected "
                    f"{len(header)} as in the header (line 1){detail}", path=str(path), line=number)


def _parse_row(row: list[str], col: dict[str, int], spec: TaskSpec, labelled: bool,
               path: Path, line: int) -> tuple[str, list[str], float | None]:
    def cell(name: str) -> str:
        i = col[name]
        return row[i].strip() if i < len(row) else ""
    row_id = cell("id")
    if not row_id:
        raise DataError(f"{path}, line {line}: empty id; expected a row id", path=str(path), line=line)
    sentences = []
    for name in spec.text_columns:
        if not cell(name):
            raise DataError(f"{path}, line {line}: empty or missing {name!r}; expected a "
                            "non-empty sentence", path=str(path), line=line)
        sentences.append(cell(name))
    label = _parse_label(cell(spec.label_column), spec, path, line) if labelled else None
    return row_id, sentences, label


def _parse_label(value: str, spec: TaskSpec, path: Path, line: int) -> float:
    expected = f"{spec.label_column} must be {spec.describe_label()}"
    try:
        number = float(value.strip())
    except ValueError:
        raise DataError(f"{path}, line {line}: {spec.label_column}={value.strip()!r}; {expected}",
                        path=str(path), line=line) from None
    ok = np.isfinite(number)
    if spec.label_kind == "class":
        ok = ok and number.is_integer() and 0 <= number < spec.num_classes
    elif spec.label_kind == "binary":
        ok = ok and number in (0.0, 1.0)
    else:
        ok = ok and 0.0 <= number <= 5.0
    if not ok:
        raise DataError(f"{path}, line {line}: {spec.label_column}={value.strip()!r}; {expected}",
                        path=str(path), line=line)
    return number


# --------------------------------------------------------------------------- tokens
@dataclass
class Ragged:
    """Variable-length int32 rows stored flat (cheap to pickle and to share via Ray)."""
    values: np.ndarray
    offsets: np.ndarray  # len(rows) + 1

    @classmethod
    def from_lists(cls, rows: list[list[int]]) -> "Ragged":
        lengths = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
        offsets = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        values = np.fromiter((t for r in rows for t in r), dtype=np.int32, count=int(offsets[-1]))
        return cls(values, offsets)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> np.ndarray:
        return self.values[self.offsets[i]:self.offsets[i + 1]]

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def take(self, indices: np.ndarray) -> "Ragged":
        lengths = self.lengths[indices]
        offsets = np.zeros(len(indices) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        rows = [self[i] for i in indices]
        values = np.concatenate(rows) if rows else np.zeros(0, dtype=np.int32)
        return Ragged(values.astype(np.int32, copy=False), offsets)

    def to_arrow(self) -> pa.Array:
        return pa.ListArray.from_arrays(pa.array(self.offsets.astype(np.int32)), pa.array(self.values))

    @classmethod
    def from_arrow(cls, column: pa.ChunkedArray) -> "Ragged":
        array = column.combine_chunks()
        offsets = np.asarray(array.offsets, dtype=np.int64)
        values = np.asarray(array.values, dtype=np.int32)
        return cls(values[offsets[0]:offsets[-1]].copy(), offsets - offsets[0])


@dataclass
class TokenTable:
    """Token ids of every row of one file, in every encoding the model may ask for."""
    a: Ragged                      # first (or only) sentence: [CLS] a [SEP]
    b: Ragged | None = None        # second sentence: [CLS] b [SEP]
    pair: Ragged | None = None     # cross encoding: [CLS] a [SEP] b [SEP]
    pair_types: Ragged | None = None

    def columns(self) -> dict[str, Ragged]:
        return {k: v for k, v in (("a", self.a), ("b", self.b), ("pair", self.pair),
                                  ("pair_types", self.pair_types)) if v is not None}


def tokenizer_fingerprint(tokenizer) -> str:
    try:
        # the serialised state also holds the last call's truncation/padding: drop them
        state = json.loads(tokenizer.backend_tokenizer.to_str())
        state.pop("truncation", None)
        state.pop("padding", None)
        blob = json.dumps(state, sort_keys=True)
    except AttributeError:
        blob = repr(sorted(tokenizer.get_vocab().items()))
    return hashlib.sha256(f"{type(tokenizer).__name__}|{blob}".encode()).hexdigest()


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    files: list[str] = field(default_factory=list)


def tokenize_cached(table: RawTable, tokenizer, max_length: int, cache_dir: Path,
                    stats: CacheStats) -> TokenTable:
    key = hashlib.sha256(
        f"{CACHE_VERSION}|{tokenizer_fingerprint(tokenizer)}|{max_length}|{table.checksum}".encode()
    ).hexdigest()[:24]
    cache_file = cache_dir / "tokens" / f"{Path(table.path).stem}-{key}.parquet"
    if cache_file.is_file():
        try:
            pt = pq.read_table(cache_file)
            if pt.num_rows == len(table.ids):  # else not this table's tokens: rebuild
                stats.hits += 1
                stats.files.append(f"hit {cache_file.name}")
                return TokenTable(**{name: Ragged.from_arrow(pt.column(name))
                                     for name in pt.column_names})
            log.warning("token cache %s has %d rows, the file %d; rebuilding", cache_file,
                        pt.num_rows, len(table.ids))
        except (pa.ArrowException, OSError, KeyError, TypeError):
            log.warning("token cache %s unreadable; rebuilding", cache_file)
    stats.misses += 1
    stats.files.append(f"miss {cache_file.name}")
    tokens = _tokenize(table, tokenizer, max_length)
    _write_parquet_atomic({k: v.to_arrow() for k, v in tokens.columns().items()}, cache_file)
    return tokens


def _tokenize(table: RawTable, tokenizer, max_length: int) -> TokenTable:
    kw = dict(truncation=True, max_length=max_length, return_attention_mask=False)
    a = tokenizer(table.texts[0], **kw)["input_ids"]
    if len(table.texts) == 1:
        return TokenTable(a=Ragged.from_lists(a))
    b = tokenizer(table.texts[1], **kw)["input_ids"]
    pair = tokenizer(table.texts[0], table.texts[1], return_token_type_ids=True, **kw)
    return TokenTable(a=Ragged.from_lists(a), b=Ragged.from_lists(b),
                      pair=Ragged.from_lists(pair["input_ids"]),
                      pair_types=Ragged.from_lists(pair["token_type_ids"]))


def _write_parquet_atomic(columns: dict[str, pa.Array], target: Path) -> None:
    atomic_write(target, lambda tmp: pq.write_table(pa.table(columns), tmp))


# --------------------------------------------------------------------------- splits
@dataclass
class Split:
    """One task's rows of one split (train / val / dev / test)."""
    task: str
    name: str
    ids: list[str]
    labels: np.ndarray | None
    tokens: TokenTable

    def __len__(self) -> int:
        return len(self.ids)

    def subset(self, indices: np.ndarray, name: str | None = None) -> "Split":
        indices = np.asarray(indices, dtype=np.int64)
        cols = {k: v.take(indices) for k, v in self.tokens.columns().items()}
        return Split(self.task, name or self.name, [self.ids[i] for i in indices],
                     None if self.labels is None else self.labels[indices], TokenTable(**cols))

    def lengths(self, encoding: str) -> np.ndarray:
        """Sequence length per row as the model will see it (for bucketing)."""
        if encoding == "single":
            return self.tokens.a.lengths
        if encoding == "cross":
            return self.tokens.pair.lengths
        return np.maximum(self.tokens.a.lengths, self.tokens.b.lengths)


@dataclass
class MultitaskData:
    """All splits of all tasks, tokenised; picklable (Ray passes it by object store)."""
    splits: dict[str, dict[str, Split]]  # task -> split name -> Split
    pad_id: int
    model: str
    max_length: int
    cache: CacheStats

    def split(self, task: str, name: str) -> Split | None:
        return self.splits[task].get(name)

    def train_sizes(self) -> dict[str, int]:
        return {t: len(self.splits[t]["train"]) for t in TASK_NAMES}


def load_data(cfg: TrainConfig, data_dir: str | None = None) -> MultitaskData:
    """Read, validate, tokenise (cached) and split all task files for ``cfg``."""
    data_dir = Path(data_dir or cfg.data_dir)
    if not data_dir.is_dir():
        raise DataError(f"{data_dir}: data folder not found (expected the CS 224N files, "
                        "e.g. ../shared/data)", path=str(data_dir))
    cache_dir = default_cache_dir(cfg.cache_dir)
    check_creatable(cache_dir, cache_dir_source(cfg.cache_dir))  # before any file is read
    tokenizer = load_tokenizer(cfg.model)
    stats = CacheStats()
    splits: dict[str, dict[str, Split]] = {}
    for task in TASK_NAMES:
        spec = TASKS[task]
        splits[task] = {}
        for split_name, filename in spec.files.items():
            labelled = split_name != "test"
            raw = read_task_file(data_dir / filename, spec, labelled, cfg.bad_row_tolerance)
            tokens = tokenize_cached(raw, tokenizer, cfg.max_length, cache_dir, stats)
            full = Split(task, split_name, raw.ids, raw.labels, tokens)
            if split_name == "train":
                train_idx, val_idx = carve_validation(len(full), cfg.val_fraction, cfg.split_seed)
                if cfg.max_train_per_task:
                    train_idx = train_idx[: cfg.max_train_per_task]
                if cfg.max_eval_per_task:
                    val_idx = val_idx[: cfg.max_eval_per_task]
                splits[task]["train"] = full.subset(np.sort(train_idx), "train")
                splits[task]["val"] = full.subset(np.sort(val_idx), "val")
            else:
                if cfg.max_eval_per_task and len(full) > cfg.max_eval_per_task:
                    full = full.subset(np.arange(cfg.max_eval_per_task), split_name)
                splits[task][split_name] = full
    log.info("token cache %s: %d hits, %d misses", cache_dir, stats.hits, stats.misses)
    return MultitaskData(splits, int(tokenizer.pad_token_id or 0), cfg.model, cfg.max_length, stats)


def carve_validation(n: int, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Seeded shuffle of row indices; the first ``round(n * fraction)`` are validation."""
    order = np.random.default_rng(seed).permutation(n)
    n_val = max(1, int(round(n * fraction)))
    return order[n_val:], order[:n_val]


# --------------------------------------------------------------------------- batching
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


def _pad(rows: list[np.ndarray], pad_id: int, width: int = 0, num_rows: int = 0,
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
        batch["input_ids"], batch["attention_mask"] = _pad(seqs, pad_id, _width(seqs, static), n)
    elif encoding == "cross":
        seqs = [tok.pair[i] for i in indices]
        width = _width(seqs, static)
        batch["input_ids"], batch["attention_mask"] = _pad(seqs, pad_id, width, n)
        batch["token_type_ids"], _ = _pad([tok.pair_types[i] for i in indices], 0, width, n)
    else:
        a, b = [tok.a[i] for i in indices], [tok.b[i] for i in indices]
        width_a, width_b = _width(a, static), _width(b, static)
        if static:
            width_a = width_b = max(width_a, width_b)
        batch["input_ids_a"], batch["attention_mask_a"] = _pad(a, pad_id, width_a, n)
        batch["input_ids_b"], batch["attention_mask_b"] = _pad(b, pad_id, width_b, n)
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
