"""What each batch shape costs a trainer step: ``python -m bench.step_shapes``.

Runs the real trainer's schedule (``Trainer.next_batches`` + ``train_batches``) step by
step for ``--seconds`` and times every step with its batch shapes (task, rows, padded
length).  A step on a shape not met before pays the shape's one-off costs: cuDNN /
attention plans in eager mode, compilation and graph capture under ``--compile``.  It
prints the steps that met a new shape (and every 50th), then a summary: distinct shapes,
the time spent on first-of-a-shape steps, and the median step and examples/s on shapes
already met.  This is how the H100's ``compile=reduce-overhead`` was found to cost
18-27 s per new shape (docs/bench/throughput.md), and how captured step graphs
(``--step-mode graphs``) are seen to pay a capture once per shape.

    python -m bench.step_shapes --device cuda --compile reduce-overhead --seconds 110
    python -m bench.step_shapes --device cuda --step-mode graphs --seconds 60

``--padding`` prints instead what static lengths cost in padding on the real training
files: padded tokens over real tokens for a few length ladders, per task and pair
encoding, with the trainer's length-bucketed batches (no model, no device).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from bench.common import add_data_arguments, synchronize
from mtbert.core.config import TrainConfig
from mtbert.data import TaskBatcher, encoding_for, load_data, real_rows
from mtbert.core.tasks import TASK_NAMES
from mtbert.step.trainer import Trainer


def batch_shapes(batches: dict[str, dict[str, torch.Tensor]]) -> tuple:
    """(task, (rows, padded length), ...) of one step's batches: every 2-D input's shape."""
    return tuple((task, tuple(sorted({tuple(v.shape) for v in batch.values()
                                       if torch.is_tensor(v) and v.dim() == 2})))
                 for task, batch in sorted(batches.items()))


@dataclass
class StepLog:
    """Step times split by whether the step's shapes were new."""
    seen: set = field(default_factory=set)
    first: list[float] = field(default_factory=list)   # seconds, first step of a shape
    repeat: list[float] = field(default_factory=list)  # seconds, shapes already met
    repeat_examples: int = 0

    def add(self, shapes: tuple, seconds: float, examples: int) -> bool:
        new = shapes not in self.seen
        self.seen.add(shapes)
        if new:
            self.first.append(seconds)
        else:
            self.repeat.append(seconds)
            self.repeat_examples += examples
        return new

    def summary(self) -> dict:
        return {"shapes": len(self.seen), "steps": len(self.first) + len(self.repeat),
                "first_of_shape_s": sum(self.first),
                "first_of_shape_median_ms": 1000 * statistics.median(self.first)
                if self.first else None,
                "repeat_steps": len(self.repeat),
                "repeat_median_ms": 1000 * statistics.median(self.repeat)
                if self.repeat else None,
                "repeat_examples_per_s": self.repeat_examples / sum(self.repeat)
                if self.repeat else None}


def run(args) -> dict:
    torch.set_num_threads(args.threads)
    cfg = TrainConfig.from_dict(dict(
        model=args.model, data_dir=args.data_dir, batch_size=args.batch_size,
        device=args.device, threads=args.threads, progress=False, eval_dev=False,
        pad_lengths=args.pad_lengths, compile=args.compile, step_mode=args.step_mode))
    trainer = Trainer(cfg, load_data(cfg), Path(tempfile.mkdtemp(prefix="mtbert-shapes-")),
                      checkpoints=False)
    device = trainer.device
    plan = [g for epoch in range(1, cfg.epochs + 1) for g in trainer.epoch_plan(epoch)]
    log, started = StepLog(), time.perf_counter()
    for i, group in enumerate(plan):
        batches = trainer.next_batches(group)
        shapes = batch_shapes(batches)
        synchronize(device)
        t = time.perf_counter()
        trainer.train_batches(batches)
        synchronize(device)
        seconds = time.perf_counter() - t
        new = log.add(shapes, seconds, sum(real_rows(b) for b in batches.values()))
        if new or i % 50 == 0:
            print(f"step {i:5d} +{time.perf_counter() - started:7.1f}s "
                  f"{'new' if new else 'met'} {1000 * seconds:9.1f} ms  {shapes}", flush=True)
        if time.perf_counter() - started > args.seconds:
            break
    out = log.summary()
    if trainer.step_graphs is not None:
        out.update(trainer.step_graphs.stats.as_metrics())
        print(f"step graphs: {out['graphs/captured']} captured in {out['graphs/capture_s']:.1f} s; "
              f"{out['graphs/replayed_steps']} steps replayed, {out['graphs/eager_steps']} eager")
    print(f"{args.device}, compile={args.compile}, step={args.step_mode}, "
          f"pad_lengths={args.pad_lengths}: "
          f"{out['steps']} steps, {out['shapes']} shapes; first-of-a-shape steps "
          f"{out['first_of_shape_s']:.1f} s in all (median {out['first_of_shape_median_ms']:.0f} "
          f"ms); steps on shapes met: {out['repeat_steps']}, median "
          f"{out['repeat_median_ms'] or 0:.1f} ms, {out['repeat_examples_per_s'] or 0:.0f} ex/s")
    return out


#: the length ladders ``--padding`` compares (the trainer's is data.STATIC_LENGTHS)
LADDERS = {"longest row": (), "16/32/48/64/96/128": (16, 32, 48, 64, 96, 128),
           "32/64/128": (32, 64, 128), "24/32/48/64/128": (24, 32, 48, 64, 128)}


def padding(args) -> dict:
    """Padded / real tokens of every ladder over one pass of each task's batches."""
    cfg = TrainConfig.from_dict(dict(model=args.model, data_dir=args.data_dir, progress=False))
    data = load_data(cfg)
    out = {}
    print(f"padded tokens / real tokens, batches of {args.batch_size}, length-bucketed")
    print(f"{'task':4} {'encoding':8} " + " ".join(f"{name:>18}" for name in LADDERS))
    for pair_encoding in ("cross", "siamese"):
        for task in TASK_NAMES:
            encoding = encoding_for(task, pair_encoding)
            if task == "sst" and pair_encoding == "siamese":
                continue
            split = data.split(task, "train")
            lengths = split.lengths(encoding)
            batcher = TaskBatcher(split, args.batch_size, encoding, seed=0)
            batches = [batcher.next_batch() for _ in range(batcher.num_batches)]  # one pass
            real = float(lengths.sum())
            ratios = {}
            for name, ladder in LADDERS.items():
                padded = 0
                for batch in batches:
                    longest = int(lengths[batch].max())
                    width = next((n for n in ladder if n >= longest), longest)
                    padded += width * args.batch_size
                ratios[name] = padded / real
            out[f"{task}/{encoding}"] = ratios
            print(f"{task:4} {encoding:8} " + " ".join(f"{r:17.2f}x" for r in ratios.values()))
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_data_arguments(p)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--compile", choices=("none", "default", "reduce-overhead"), default="none")
    p.add_argument("--pad-lengths", choices=("auto", "batch", "buckets"), default="auto")
    p.add_argument("--step-mode", choices=("auto", "graphs", "eager"), default="auto")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seconds", type=float, default=60.0, help="stop after this long")
    p.add_argument("--padding", action="store_true",
                   help="print the padding cost of static length ladders on the data instead")
    args = p.parse_args(argv)
    return padding(args) if args.padding else run(args)


if __name__ == "__main__":
    main()
