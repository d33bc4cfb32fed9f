"""Token ids: a file's rows tokenised once and cached in Parquet, keyed by the
tokenizer, the max length and the file's checksum; held as ragged arrays."""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from mtbert.core.atomic import atomic_write
from mtbert.data.files import RawTable

log = logging.getLogger("mtbert.data")

#: part of every token-cache key: "2" since the reader takes one row per line (2026-11),
#: so a file whose rows the old reader merged is not served its old, shorter token table
CACHE_VERSION = "2"

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
                    stats: CacheStats, fingerprint: str | None = None) -> TokenTable:
    """``table``'s tokens, read from the Parquet cache or tokenised and written there.
    ``fingerprint``: the tokenizer's (:func:`tokenizer_fingerprint`), computed once by a
    caller that tokenises several files (it serialises the whole vocabulary: ~0.1 s)."""
    fingerprint = fingerprint or tokenizer_fingerprint(tokenizer)
    key = hashlib.sha256(
        f"{CACHE_VERSION}|{fingerprint}|{max_length}|{table.checksum}".encode()
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


