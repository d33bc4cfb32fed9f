"""Training throughput, model-FLOPs utilisation (MFU) and validation rows/s of MiniLM.

Two measurements (``--mode``):

* ``trainer`` (default): the real trainer loop (``Trainer.next_batches`` +
  ``train_batches``: collate, device copy, the optimizer step of the configured
  schedule) in ``--concurrent N`` processes on one device, each with its own Trainer,
  started together. Per process, fixed costs apart from the steady state: start-up
  (process start -> Trainer ready: imports, data from the token cache, model load),
  warm-up (the first ``--warmup`` schedule steps: allocator, kernel selection,
  torch.compile's graphs), then ``--steps`` steady steps (examples/s, useful GFLOP/s,
  MFU), then the validation split scored twice (the first pass compiles/warms the eval
  shapes; the second is the steady validation rows/s). Steady windows are aligned by a
  barrier; "together" = all processes' steady examples over the union of their windows.
* ``tasks``: the optimizer step alone per task at a fixed batch size, with length
  bucketing on and off, and (CPU only) transformers' ``Trainer`` on the same model,
  data, loss and threads as the reference (docs/bench/throughput.md).

  python -m bench.throughput [--device cpu|cuda] [--concurrent N] [--steps 12] [--threads 2]
         [--batch-size 32] [--pad-lengths auto|batch|buckets] [--compile none|default|reduce-overhead]
  python -m bench.throughput --mode tasks --steps 12 --threads 2 [--skip-hf]

MFU = useful model FLOPs per second / the measured matmul peak of the device (fp32 on
the CPU on the same threads; bf16 on a GPU, where the trainer runs under bf16 autocast).
Useful FLOPs count real (non-pad) tokens only: 6·N·T for the encoder's dense weights
(N = non-embedding parameters, T = tokens; forward 2NT + backward 4NT) plus attention
12·L·H·Σ s_i² (QKᵀ and AV, forward + backward) — padding work does not count.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from bench.common import add_data_arguments, synchronize
from mtbert.core.config import TrainConfig, parse_set_args
from mtbert.data import (ROW_WEIGHTS, TaskBatcher, collate, encoding_for, load_data,
                         real_rows)
from mtbert.techniques.losses import task_loss
from mtbert.core.tasks import TASK_NAMES
from mtbert.step.trainer import Trainer



def matmul_peak(device: torch.device, threads: int, repeats: int = 10) -> float:
    """Best GFLOP/s of a square matmul: fp32 n=2048 on the CPU (``threads`` threads),
    bf16 n=8192 on a GPU."""
    torch.set_num_threads(threads)
    n, dtype = (8192, torch.bfloat16) if device.type == "cuda" else (2048, torch.float32)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    torch.mm(a, b)
    synchronize(device)
    best = 0.0
    for _ in range(repeats):
        t = time.perf_counter()
        torch.mm(a, b)
        synchronize(device)
        best = max(best, 2 * n ** 3 / (time.perf_counter() - t))
    return best / 1e9


def useful_flops(encoder, lengths: np.ndarray) -> float:
    cfg = encoder.config
    n_dense = sum(p.numel() for name, p in encoder.named_parameters() if "embeddings" not in name)
    tokens = float(lengths.sum())
    attention = 12 * cfg.num_hidden_layers * cfg.hidden_size * float((lengths.astype(np.float64) ** 2).sum())
    return 6 * n_dense * tokens + attention


def batch_lengths(batch: dict[str, torch.Tensor]) -> np.ndarray:
    """Real tokens per sequence of a host batch (a fixed-size batch's filler rows aside)."""
    masks = [v for k, v in batch.items() if k.startswith("attention_mask")]
    real = batch.get(ROW_WEIGHTS)
    keep = np.ones(len(masks[0]), dtype=bool) if real is None else real.numpy() > 0
    return np.concatenate([m.sum(1).numpy()[keep] for m in masks])


# ------------------------------------------------------------------ mode: trainer
def trainer_worker(rank: int, spawned_at: float, settings: dict, barrier, results) -> None:
    """One trainer process: start-up, warm-up, steady steps, validation (see module doc)."""
    torch.set_num_threads(settings["threads"])
    cfg = TrainConfig.from_dict(settings["config"])
    data = load_data(cfg)
    out = Path(tempfile.mkdtemp(prefix=f"mtbert-throughput-{rank}-"))
    trainer = Trainer(cfg, data, out, checkpoints=False)
    device = trainer.device
    startup_s = time.time() - spawned_at
    plan = [g for epoch in range(1, cfg.epochs + 1) for g in trainer.epoch_plan(epoch)]
    warmup, steps = settings["warmup"], settings["steps"]
    plan = (plan * (1 + (warmup + steps) // max(len(plan), 1)))[: warmup + steps]

    syncs = []

    def run(groups, count_syncs: bool = False) -> tuple[int, float, float, float]:
        import warnings
        examples, flops = 0, 0.0
        synchronize(device)
        started = time.time()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if count_syncs and device.type == "cuda":  # each host sync of the steps warns
                torch.cuda.set_sync_debug_mode("warn")
            for group in groups:
                batches = trainer.next_batches(group)
                for batch in batches.values():
                    examples += real_rows(batch)
                    flops += useful_flops(trainer.model.encoder, batch_lengths(batch))
                trainer.train_batches(batches)
            if device.type == "cuda":
                torch.cuda.set_sync_debug_mode("default")
        syncs.extend(str(w.message).splitlines()[0] for w in caught
                     if "synchroniz" in str(w.message))
        synchronize(device)
        trainer.check_losses()  # the NaN check the trainer makes at its log points
        return examples, flops, started, time.time()

    _, _, w0, w1 = run(plan[:warmup])
    graphs = trainer.step_graphs
    before = dict(graphs.stats.as_metrics()) if graphs is not None else {}
    barrier.wait()
    examples, flops, s0, s1 = run(plan[warmup:], count_syncs=True)
    after = graphs.stats.as_metrics() if graphs is not None else {}
    barrier.wait()
    rows = sum(len(data.split(t, "val")) for t in TASK_NAMES)
    timings = []
    for _ in range(2):  # first pass: eval shapes warm up / compile; second: steady
        synchronize(device)
        t = time.perf_counter()
        trainer.evaluate("val")
        synchronize(device)
        timings.append(time.perf_counter() - t)
    results.put({"rank": rank, "startup_s": startup_s, "warmup_s": w1 - w0, "warmup_steps": warmup,
                 "examples": examples, "flops": flops, "steady_start": s0, "steady_end": s1,
                 "val_rows": rows, "eval_first_s": timings[0], "eval_s": timings[1],
                 "device": str(device), "static_max_length": trainer.static_max_length,
                 "step_mode": "graphs" if graphs is not None else "eager",
                 "graphs_after_warmup": before, "graphs_after_steady": after,
                 "host_syncs": len(syncs) if device.type == "cuda" else None,
                 "sync_examples": sorted(set(syncs))[:3]})


def bench_trainer(args, peak: float) -> list[dict]:
    n = args.concurrent
    threads = max(1, args.threads // n)  # the host's threads, shared by the processes
    config = dict(model=args.model, data_dir=args.data_dir, batch_size=args.batch_size,
                  device=args.device, threads=threads, progress=False, eval_dev=False,
                  pad_lengths=args.pad_lengths, compile=args.compile, step_mode=args.step_mode,
                  eval_batch_size=args.eval_batch_size, max_eval_per_task=args.eval_rows,
                  **parse_set_args(args.set))
    TrainConfig.from_dict(config)  # bad values fail here, before any process starts
    settings = {"config": config, "threads": threads, "warmup": args.warmup, "steps": args.steps}
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(n), ctx.Queue()
    procs = [ctx.Process(target=trainer_worker, args=(r, time.time(), settings, barrier, results))
             for r in range(n)]
    for proc in procs:
        proc.start()
    rows = [results.get() for _ in procs]
    for proc in procs:
        proc.join()
    rows.sort(key=lambda r: r["rank"])
    print(f"{n} trainer process(es) on {rows[0]['device']}, {threads} thread(s) each, batch "
          f"{args.batch_size}, pad_lengths={args.pad_lengths} (static max length "
          f"{rows[0]['static_max_length'] or 'off'}), compile={args.compile}, "
          f"step={rows[0]['step_mode']}, {args.warmup} warm-up + {args.steps} steady schedule "
          f"steps{', ' + ' '.join(args.set) if args.set else ''}")
    print(f"{'proc':>4} {'start-up s':>10} {'warm-up s':>9} {'ex/s':>8} {'GFLOP/s':>8} {'MFU':>6} "
          f"{'eval 1st s':>10} {'val rows/s':>10}")
    for r in rows:
        span = r["steady_end"] - r["steady_start"]
        r["ex_per_s"] = r["examples"] / span
        r["gflops"] = r["flops"] / span / 1e9
        r["val_rows_per_s"] = r["val_rows"] / r["eval_s"]
        print(f"{r['rank']:>4} {r['startup_s']:10.1f} {r['warmup_s']:9.1f} {r['ex_per_s']:8.1f} "
              f"{r['gflops']:8.1f} {r['gflops'] / peak:6.1%} {r['eval_first_s']:10.2f} "
              f"{r['val_rows_per_s']:10.1f}")
    window = max(r["steady_end"] for r in rows) - min(r["steady_start"] for r in rows)
    total = sum(r["examples"] for r in rows) / window
    gflops = sum(r["flops"] for r in rows) / window / 1e9
    for r in rows:
        if r["step_mode"] == "graphs":
            w, s = r["graphs_after_warmup"], r["graphs_after_steady"]
            print(f"  proc {r['rank']} graphs: {s['graphs/shapes']} (task, shape)s met, "
                  f"{s['graphs/captured']} graphs captured in {s['graphs/capture_s']:.1f} s "
                  f"({w['graphs/captured']} by the end of the warm-up); steady steps "
                  f"{s['graphs/replayed_steps'] - w['graphs/replayed_steps']} replayed, "
                  f"{s['graphs/eager_steps'] - w['graphs/eager_steps']} eager")
    if rows[0]["host_syncs"] is not None:
        print(f"host synchronisations in the steady steps (torch.cuda sync debug mode): "
              f"{[r['host_syncs'] for r in rows]} {rows[0]['sync_examples']}")
    print(f"together: {total:.1f} ex/s, {gflops:.1f} useful GFLOP/s, MFU {gflops / peak:.1%} "
          f"(steady windows, union {window:.1f} s)")
    return rows


# ------------------------------------------------------------------ mode: tasks
def bench_mtbert(trainer: Trainer, task: str, bucketing: bool, steps: int, warmup: int = 2):
    split = trainer.train_splits[task]
    enc = trainer.encodings[task]
    batcher = TaskBatcher(split, trainer.cfg.batch_size, enc, seed=0, bucketing=bucketing,
                          bucket_batches=trainer.cfg.bucket_batches)
    rows = trainer.cfg.batch_size if trainer.static_max_length else 0
    batches = [collate(split, batcher.next_batch(), enc, trainer.data.pad_id,
                       trainer.static_max_length, rows) for _ in range(warmup + steps)]
    for b in batches[:warmup]:
        trainer.train_batches({task: b})
    synchronize(trainer.device)
    t = time.perf_counter()
    for b in batches[warmup:]:
        trainer.train_batches({task: b})
    synchronize(trainer.device)
    seconds = time.perf_counter() - t
    trainer.check_losses()
    examples = sum(real_rows(b) for b in batches[warmup:])
    flops = sum(useful_flops(trainer.model.encoder, batch_lengths(b)) for b in batches[warmup:])
    return examples / seconds, flops / seconds


class _TaskModule(torch.nn.Module):
    """One task of the multitask model behind the (kwargs -> {'loss'}) interface Trainer wants."""

    def __init__(self, model, task: str, cfg: TrainConfig):
        super().__init__()
        self.model, self.task, self.cfg = model, task, cfg

    def forward(self, labels=None, **batch):
        out = self.model(self.task, batch)
        return {"loss": task_loss(self.task, out, labels, self.cfg)}


def bench_hf_trainer(model, cfg: TrainConfig, data, task: str, group_by_length: bool,
                     steps: int, threads: int, warmup: int = 2):
    from transformers import Trainer as HFTrainer, TrainerCallback, TrainingArguments

    split = data.split(task, "train")
    enc = encoding_for(task, cfg.pair_encoding)
    rows = []
    for i in range(len(split)):
        ids = split.tokens.pair[i] if enc == "cross" else split.tokens.a[i]
        row = {"input_ids": ids.tolist(), "labels": split.labels[i].item()}
        if enc == "cross":
            row["token_type_ids"] = split.tokens.pair_types[i].tolist()
        rows.append(row)

    def collator(features):
        width = max(len(f["input_ids"]) for f in features)
        ids = torch.full((len(features), width), data.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        types = torch.zeros_like(ids)
        for i, f in enumerate(features):
            n = len(f["input_ids"])
            ids[i, :n] = torch.tensor(f["input_ids"])
            mask[i, :n] = 1
            if "token_type_ids" in f:
                types[i, :n] = torch.tensor(f["token_type_ids"])
        batch = {"input_ids": ids, "attention_mask": mask,
                 "labels": torch.tensor([f["labels"] for f in features])}
        if enc == "cross":
            batch["token_type_ids"] = types
        return batch

    timing = {"examples": 0, "flops": 0.0, "seconds": 0.0, "step": 0}

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            timing["t"] = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            timing["step"] += 1
            if timing["step"] > warmup:
                timing["seconds"] += time.perf_counter() - timing["t"]

    # count the examples/FLOPs of the batches the Trainer's own sampler produced
    class CountingCollator:
        def __call__(self, features):
            batch = collator(features)
            timing.setdefault("batches", []).append(batch_lengths(batch))
            return batch

    # transformers 5 names the sampler choice train_sampling_strategy; 4.x had group_by_length
    fields = TrainingArguments.__dataclass_fields__
    sampler = ({"train_sampling_strategy": "group_by_length" if group_by_length else "random"}
               if "train_sampling_strategy" in fields else {"group_by_length": group_by_length})
    args = TrainingArguments(
        output_dir=str(Path(os.environ.get("TMPDIR", "/tmp")) / "mtbert-hf-bench"),
        per_device_train_batch_size=32, max_steps=warmup + steps, learning_rate=cfg.lr,
        weight_decay=cfg.weight_decay, report_to=[], save_strategy="no", logging_strategy="no",
        dataloader_num_workers=0, use_cpu=True, seed=0, disable_tqdm=True,
        remove_unused_columns=False, **sampler)
    dataset = _ListDataset(rows)
    trainer = HFTrainer(model=_TaskModule(model, task, cfg), args=args, train_dataset=dataset,
                        data_collator=CountingCollator(), callbacks=[StepTimer()])
    torch.set_num_threads(threads)
    trainer.train()
    lengths = timing["batches"][warmup:warmup + steps]
    examples = sum(len(x) for x in lengths)
    flops = sum(useful_flops(model.encoder, x) for x in lengths)
    return examples / timing["seconds"], flops / timing["seconds"]


class _ListDataset(torch.utils.data.Dataset):
    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def bench_tasks(args, peak: float) -> None:
    device = torch.device(args.device)
    cfg = TrainConfig(model=args.model, data_dir=args.data_dir, batch_size=args.batch_size,
                      threads=args.threads, progress=False, eval_dev=False, dropout=0.1,
                      device=args.device, pad_lengths=args.pad_lengths, compile=args.compile)
    data = load_data(cfg)
    print(f"{'task':5} {'runner':28} {'ex/s':>7} {'GFLOP/s':>8} {'MFU':>6}")
    results = {}
    skip_hf = args.skip_hf or device.type != "cpu"
    for task in TASK_NAMES:
        torch.manual_seed(0)
        trainer = Trainer(cfg, data, Path(tempfile.gettempdir()) / "mtbert-bench", checkpoints=False)
        for bucketing in (True, False):
            label = f"mtbert {'bucketed' if bucketing else 'unbucketed'}"
            rate, flops = bench_mtbert(trainer, task, bucketing, args.steps)
            results[(task, label)] = rate
            print(f"{task:5} {label:28} {rate:7.1f} {flops / 1e9:8.1f} {flops / 1e9 / peak:6.1%}",
                  flush=True)
        if skip_hf:
            continue
        for group in (False, True):
            label = f"HF Trainer {'group_by_length' if group else 'default'}"
            rate, flops = bench_hf_trainer(trainer.model, cfg, data, task, group, args.steps,
                                           args.threads)
            results[(task, label)] = rate
            print(f"{task:5} {label:28} {rate:7.1f} {flops / 1e9:8.1f} {flops / 1e9 / peak:6.1%}",
                  flush=True)
    if not skip_hf:
        print("\nspeed-up of mtbert bucketed over:")
        for task in TASK_NAMES:
            ours = results[(task, "mtbert bucketed")]
            print(f"  {task}: HF default {ours / results[(task, 'HF Trainer default')]:.2f}x, "
                  f"HF group_by_length {ours / results[(task, 'HF Trainer group_by_length')]:.2f}x")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_data_arguments(p)
    p.add_argument("--mode", choices=("trainer", "tasks"), default="trainer")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--concurrent", type=int, default=1, help="trainer processes on the device")
    p.add_argument("--steps", type=int, default=12, help="timed (steady) steps")
    p.add_argument("--warmup", type=int, default=4,
                   help="trainer mode: warm-up schedule steps (with --compile: enough to meet "
                        "every (task, padded length) shape, or steady steps compile too)")
    p.add_argument("--threads", type=int, default=2,
                   help="host CPU threads, split among the --concurrent processes")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--eval-batch-size", type=int, default=0,
                   help="validation rows per batch (0 = auto: 128 on a CPU, 1,024 on a GPU)")
    p.add_argument("--eval-rows", type=int, default=0,
                   help="validation rows per task to score (0 = the whole split)")
    p.add_argument("--pad-lengths", choices=("auto", "batch", "buckets"), default="auto")
    p.add_argument("--compile", choices=("none", "default", "reduce-overhead"), default="none")
    p.add_argument("--step-mode", choices=("auto", "graphs", "eager"), default="auto",
                   help="trainer mode: captured CUDA graphs of the step or eager steps (auto: "
                        "graphs on CUDA)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="trainer mode: another TrainConfig field, e.g. smart_lambda_sst=1 "
                        "(repeatable)")
    p.add_argument("--skip-hf", action="store_true", help="skip the transformers Trainer reference")
    p.add_argument("--json", help="also write the trainer-mode rows to this file")
    args = p.parse_args()
    if not Path(args.data_dir, "ids-sst-train.csv").is_file():
        print(f"error: data not found in {args.data_dir} (expected ../shared/data)", file=sys.stderr)
        sys.exit(2)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but no CUDA GPU is available", file=sys.stderr)
        sys.exit(2)
    if args.concurrent < 1 or args.steps < 1 or args.warmup < 0:
        print("error: --concurrent and --steps must be >= 1, --warmup >= 0", file=sys.stderr)
        sys.exit(2)
    device = torch.device(args.device)
    peak = matmul_peak(device, args.threads)
    precision = "bf16" if device.type == "cuda" else "fp32"
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{args.threads} threads"
    print(f"torch {torch.__version__}, {name}, {precision} matmul peak {peak:.1f} GFLOP/s")
    from mtbert.core.errors import MtbertError
    try:
        if args.mode == "tasks":
            bench_tasks(args, peak)
            return
        rows = bench_trainer(args, peak)
    except MtbertError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    if args.json:
        Path(args.json).write_text(json.dumps({"peak_gflops": peak, "args": vars(args),
                                               "processes": rows}, indent=1))


if __name__ == "__main__":
    main()
