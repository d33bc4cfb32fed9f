"""Executed / real tokens of training batches: N trials stepped together, as a fused
group draws them, on the real data.

    python -m bench.padding [--trials 1,8,32] [--batch-size 32] [--bucket-batches 4]
                            [--steps 400] [--encoding cross] [--offset K] [--own-buckets]
                            [--max-train-per-task R] [--batcher-from-commit REV] [--json F]

Each trial (seeds 0..N-1) draws each task's batches with :class:`TaskBatcher` as
training does, every trial from the length bucket the first trial is at
(``FusedGroup``'s rule, :class:`SharedBuckets`); ``--own-buckets`` lets each trial follow its own sequence
instead.  ``--offset K``: trial i has drawn i x K batches before (trials that joined a
group at different times).  A step's executed tokens are those of the stacked ``[N, rows, width]`` batch
(the most rows and the longest row of the N trials' batches; a siamese pair's two sides
each padded apart), its real tokens the rows' own; summed over ``--steps`` steps per task.
Only token counts: no model runs, no batch is padded in memory.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from bench.common import REPO, add_data_arguments
from mtbert.core.config import TrainConfig
from mtbert.data import SharedBuckets, TaskBatcher, encoding_for, load_data
from mtbert.core.tasks import TASK_NAMES
from tools.module_paths import module_folders, rewriter


def side_lengths(split, encoding: str) -> list[np.ndarray]:
    """Each padded sequence's row lengths: one for a single or cross-encoded row, a and b
    for a siamese pair."""
    tokens = split.tokens
    if encoding == "single":
        return [tokens.a.lengths]
    if encoding == "cross":
        return [tokens.pair.lengths]
    return [tokens.a.lengths, tokens.b.lengths]


def batcher_at(commit: str) -> type:
    """``TaskBatcher`` as mtbert/data/batching.py had it at ``commit``."""
    source = subprocess.run(["git", "show", f"{commit}:mtbert/data/batching.py"], cwd=REPO,
                            check=True, capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / f"batching_{commit}.py"
    path.write_text(rewriter(module_folders())(source))  # its imports at today's paths
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.TaskBatcher


def group_tokens(split, encoding: str, trials: int, batch_size: int, bucket_batches: int,
                 steps: int, own_buckets: bool, offset: int = 0,
                 batcher_class: type = TaskBatcher) -> tuple[int, int]:
    """(executed, real) tokens of ``steps`` steps of ``trials`` trials drawing together,
    trial i after i x ``offset`` draws of its own."""
    batchers = [batcher_class(split, batch_size, encoding, seed, True, bucket_batches)
                for seed in range(trials)]
    own_buckets = own_buckets or batcher_class is not TaskBatcher
    for i, batcher in enumerate(batchers):
        for _ in range(i * offset):
            batcher.next_batch()
    sides = side_lengths(split, encoding)
    executed = real = 0
    for _ in range(steps):
        shared = None if own_buckets else SharedBuckets()
        rows = [b.next_batch() if shared is None else b.next_batch(shared.take(split.task, b))
                for b in batchers]
        most_rows = max(len(r) for r in rows)
        for lengths in sides:
            executed += trials * most_rows * max(int(lengths[r].max()) for r in rows)
            real += sum(int(lengths[r].sum()) for r in rows)
    return executed, real


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_data_arguments(parser)
    parser.add_argument("--trials", default="1,8,32")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--bucket-batches", type=int,
                        default=TrainConfig.__dataclass_fields__["bucket_batches"].default)
    parser.add_argument("--steps", type=int, default=400, help="steps per task")
    parser.add_argument("--encoding", choices=("cross", "siamese"), default="cross")
    parser.add_argument("--offset", type=int, default=0)
    parser.add_argument("--own-buckets", action="store_true")
    parser.add_argument("--max-train-per-task", type=int, default=0,
                        help="training rows per task, as a budget caps them (0 = all)")
    parser.add_argument("--batcher-from-commit", metavar="REV")
    parser.add_argument("--json", help="write the figures here too")
    args = parser.parse_args(argv)
    data = load_data(TrainConfig(model=args.model, data_dir=args.data_dir,
                                 max_train_per_task=args.max_train_per_task))
    batcher_class = batcher_at(args.batcher_from_commit) if args.batcher_from_commit \
        else TaskBatcher
    rows = []
    print(f"{'trials':>6} {'task':>5} {'executed / real tokens':>24}")
    for n in (int(x) for x in args.trials.split(",")):
        executed_all = real_all = 0
        for task in TASK_NAMES:
            encoding = encoding_for(task, args.encoding)
            executed, real = group_tokens(data.split(task, "train"), encoding, n,
                                          args.batch_size, args.bucket_batches, args.steps,
                                          args.own_buckets, args.offset, batcher_class)
            executed_all, real_all = executed_all + executed, real_all + real
            rows.append({"trials": n, "task": task, "executed_tokens": executed,
                         "real_tokens": real, "executed_per_real": executed / real})
            print(f"{n:>6} {task:>5} {executed / real:>24.3f}")
        rows.append({"trials": n, "task": "all", "executed_tokens": executed_all,
                     "real_tokens": real_all, "executed_per_real": executed_all / real_all})
        print(f"{n:>6} {'all':>5} {executed_all / real_all:>24.3f}")
    if args.json:
        with open(args.json, "w") as f:
            arguments = {**vars(args), "data_dir": os.path.relpath(args.data_dir, REPO)}
            json.dump({"arguments": arguments, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
