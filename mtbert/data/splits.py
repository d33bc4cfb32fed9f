"""The splits: each task's train / val / dev / test rows, the validation split carved
from train by a seeded shuffle, all of them tokenised (:func:`load_data`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mtbert.core.atomic import check_creatable
from mtbert.core.config import TrainConfig, cache_dir_source, default_cache_dir
from mtbert.data.files import read_task_file
from mtbert.data.tokens import CacheStats, TokenTable, tokenize_cached, tokenizer_fingerprint
from mtbert.core.errors import DataError
from mtbert.core.pretrained import load_tokenizer
from mtbert.core.tasks import TASK_NAMES, TASKS

log = logging.getLogger("mtbert.data")

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
    fingerprint = tokenizer_fingerprint(tokenizer)  # once: the same for every file
    stats = CacheStats()
    splits: dict[str, dict[str, Split]] = {}
    for task in TASK_NAMES:
        spec = TASKS[task]
        splits[task] = {}
        for split_name, filename in spec.files.items():
            labelled = split_name != "test"
            raw = read_task_file(data_dir / filename, spec, labelled, cfg.bad_row_tolerance)
            tokens = tokenize_cached(raw, tokenizer, cfg.max_length, cache_dir, stats,
                                     fingerprint)
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


