"""Fused trials (mtbert/fused_training.py) against the same trials unfused: ex/s, ms/step,
memory and (CUDA) MFU for N = 1, 2, 4, ... trials of MiniLM on the real data.

Two measurements (``--mode``):

* ``train`` (default): for each N of ``--trials``,
  - *fused*: one process (``--threads`` threads) trains N configurations differing in seed
    as one :class:`~mtbert.fused_training.FusedGroup`: ``--warmup`` fused steps, then
    ``--steps`` timed ones (each is one optimizer step of every trial);
  - *unfused*: N processes started together, each one solo :class:`~mtbert.trainer.Trainer`
    (``--threads`` / N threads each on a CPU, at least 1, as trials share a machine in a
    search; on a GPU N processes share it), the same warm-up and timed optimizer steps;
    ex/s over the union of their timed windows.
  The configurations train plain batch 32 (``--batch-size``) under ``schedule=round_robin``
  (every trial trains the same task in a step; ``--set`` changes any field).  Memory: the
  peak resident set of the process(es) on a CPU (summed over the unfused ones), the peak
  allocated CUDA memory on a GPU; CPU s / 1000 ex: the processes' CPU time (host threads)
  per 1,000 examples, which a machine shared with other work disturbs less than ex/s.
  ``--smart``: #47's SMART workload instead, batch 16 (unless ``--batch-size``), every
  task's λ_t = 1 and μ = 1 (``--set`` overrides), fused (:mod:`mtbert.fused_smart`) and
  unfused; its MFU counts the plain forward and backward only, not SMART's extra ones.
* ``layer``: one BERT layer of the model alone, forward + backward on ``[N, batch, length]``
  hidden states: the N trials' layers fused (stacked weights, ``vmap``) against the N
  layers called one after another in one process -- what the fused design can reach
  where nothing else (data, optimizer, heads) is in the way.

  python -m bench.fused [--device cpu|cuda] [--trials 1,2,4,8,16,32] [--threads 2]
         [--steps 6] [--warmup 2] [--batch-size 32] [--smart] [--set KEY=VALUE] [--json OUT]
  python -m bench.fused --mode layer [--device cuda] [--trials 1,2,4,8,16,32] [--length 64]

MFU (CUDA): useful model FLOPs per second (6·N·T for the encoder's dense weights plus
attention, real tokens only; ``bench.throughput.useful_flops``) / the measured bf16
matmul peak.
"""

from __future__ import annotations

import argparse
import copy
import json
import multiprocessing as mp
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.common import add_data_arguments, synchronize
from bench.throughput import batch_lengths, matmul_peak, useful_flops
from mtbert.config import TrainConfig, parse_set_args
from mtbert.data import load_data, real_rows


#: ``--smart``: the SMART terms #47's SMART b16 workload trains with
SMART_WORKLOAD = {"smart_lambda_sst": 1.0, "smart_lambda_qqp": 1.0, "smart_lambda_sts": 1.0,
                  "smart_mu": 1.0}


def peak_memory_mb(device: torch.device) -> float:
    """The process's peak: allocated CUDA memory on a GPU, resident set on a CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2 ** 20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _count(batches: dict, encoder) -> tuple[int, float]:
    rows = sum(real_rows(b) for b in batches.values())
    return rows, sum(useful_flops(encoder, batch_lengths(b)) for b in batches.values())


def worker(rank: int, settings: dict, barrier, results) -> None:
    """One process: ``settings["fused"]`` trials as one FusedGroup, or one solo trainer."""
    from mtbert.fused_training import FusedGroup, FusedStep
    from mtbert.trainer import Trainer

    torch.set_num_threads(settings["threads"])
    configs = [TrainConfig.from_dict(c) for c in settings["configs"]]
    data = load_data(configs[0])
    outs = [Path(tempfile.mkdtemp(prefix=f"mtbert-fused-bench-{rank}-")) for _ in configs]
    warmup, steps = settings["warmup"], settings["steps"]
    if settings["fused"]:
        group = FusedGroup(configs, data, outs, checkpoints=False)
        trainers = list(group.trials.values())
        engine = FusedStep(trainers, group.streams)
    else:
        trainers = [Trainer(configs[0], data, outs[0], checkpoints=False)]
        engine = trainers[0].engine

    def one_step() -> tuple[int, float]:
        """One optimizer step of every trial (its schedule's bookkeeping after it)."""
        batches = {t: t.next_update() for t in trainers}
        losses = engine.step(batches)
        for t in trainers:
            t.stepped(losses[t])
        counts = [_count(b, trainers[0].model.encoder) for b in batches.values()]
        return sum(c[0] for c in counts), sum(c[1] for c in counts)

    device = trainers[0].device
    for _ in range(warmup):
        one_step()
    synchronize(device)
    barrier.wait()
    started, cpu_started = time.time(), time.process_time()
    examples, flops = 0, 0.0
    for _ in range(steps):
        rows, work = one_step()
        examples, flops = examples + rows, flops + work
    synchronize(device)
    ended, cpu_s = time.time(), time.process_time() - cpu_started
    for t in trainers:
        t.check_losses()
    results.put({"rank": rank, "examples": examples, "flops": flops, "start": started,
                 "end": ended, "cpu_s": cpu_s, "steps": steps, "memory_mb": peak_memory_mb(device),
                 "device": str(device), "step_mode": "fused" if settings["fused"] else
                 ("graphs" if trainers[0].step_graphs is not None else "eager")})


def run_processes(settings: list[dict]) -> dict:
    """Start one process per settings, together; their figures over the union window."""
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(len(settings)), ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, s, barrier, results))
             for r, s in enumerate(settings)]
    for proc in procs:
        proc.start()
    rows = [results.get() for _ in procs]
    for proc in procs:
        proc.join()
    window = max(r["end"] for r in rows) - min(r["start"] for r in rows)
    return {"processes": sorted(rows, key=lambda r: r["rank"]), "window_s": window,
            "ex_per_s": sum(r["examples"] for r in rows) / window,
            "gflops": sum(r["flops"] for r in rows) / window / 1e9,
            "ms_per_step": 1000 * window / rows[0]["steps"],
            "memory_mb": sum(r["memory_mb"] for r in rows),
            "cpu_s_per_1000_ex": 1000 * sum(r["cpu_s"] for r in rows)
            / sum(r["examples"] for r in rows),
            "step_mode": rows[0]["step_mode"]}


def bench_train(args, peak: float) -> list[dict]:
    smart = SMART_WORKLOAD if args.smart else {}
    base = dict(model=args.model, data_dir=args.data_dir, batch_size=args.batch_size,
                device=args.device, progress=False, eval_dev=False, eval_every=10 ** 9,
                schedule="round_robin", **{**smart, **parse_set_args(args.set)})
    TrainConfig.from_dict(base)  # bad values fail here, before any process starts
    out = []
    print(f"workload: {'SMART' if args.smart else 'plain'}, batch {args.batch_size}")
    print(f"{'N':>3} {'engine':>8} {'step':>6} {'ex/s':>9} {'ms/step':>9} {'memory MB':>10}"
          f"{'CPU s/1000 ex':>14}{' MFU':>7}")
    for n in args.trials:
        configs = [{**base, "seed": seed} for seed in range(n)]
        runs = {
            "fused": [{"fused": True, "configs": configs, "threads": args.threads,
                       "warmup": args.warmup, "steps": args.steps}],
            "unfused": [{"fused": False, "configs": [c], "threads": max(1, args.threads // n),
                         "warmup": args.warmup, "steps": args.steps} for c in configs]}
        row = {"trials": n}
        for engine, settings in runs.items():
            figures = run_processes(settings)
            row[engine] = figures
            mfu = f"{figures['gflops'] / peak:7.1%}" if args.device == "cuda" else ""
            print(f"{n:>3} {engine:>8} {figures['step_mode']:>6} {figures['ex_per_s']:9.1f} "
                  f"{figures['ms_per_step']:9.1f} {figures['memory_mb']:10.0f}"
                  f"{figures['cpu_s_per_1000_ex']:14.1f}{mfu}",
                  flush=True)
        row["fused_over_unfused"] = row["fused"]["ex_per_s"] / row["unfused"]["ex_per_s"]
        print(f"{n:>3} fused / unfused ex/s: {row['fused_over_unfused']:.3f}", flush=True)
        out.append(row)
        args.save(out)
    return out


def bench_layer(args, peak: float) -> list[dict]:
    """One encoder layer, fused over N against N layers one after another (module doc)."""
    from torch.func import functional_call, stack_module_state, vmap

    from mtbert.pretrained import load_encoder

    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    encoder = load_encoder(args.model)
    layer = encoder.encoder.layer[0].to(device).train()
    config = encoder.config
    hidden, batch, length = config.hidden_size, args.batch_size, args.length
    dense = sum(p.numel() for p in layer.parameters() if p.ndim == 2)
    work = 6 * dense * batch * length + 12 * hidden * batch * length ** 2
    autocast = device.type == "cuda"
    out = []
    print(f"one {config.model_type} layer (hidden {hidden}), batch {batch} x length {length}, "
          f"forward + backward; {'bf16 autocast' if autocast else 'fp32'}")
    print(f"{'N':>3} {'fused ms':>9} {'N layers ms':>11} {'speed-up':>8} {'fused TFLOP/s':>13}"
          f"{' MFU':>7}")
    for n in args.trials:
        layers = [copy.deepcopy(layer) for _ in range(n)]
        params, buffers = stack_module_state(layers)
        skeleton = copy.deepcopy(layer).to("meta")
        x = torch.randn(n, batch, length, hidden, device=device, requires_grad=True)
        mask = torch.ones(n, batch, 1, 1, length, dtype=torch.bool, device=device)

        def one(p, b, h, m):
            result = functional_call(skeleton, (p, b), (h, m))
            return result[0] if isinstance(result, tuple) else result

        fused = vmap(one, randomness="different")

        def fused_step():
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                y = fused(params, buffers, x, mask)
            y.float().sum().backward()

        def unfused_step():
            for i, module in enumerate(layers):
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                    result = module(x[i].detach(), mask[i])
                    y = result[0] if isinstance(result, tuple) else result
                y.float().sum().backward()

        timings = {}
        for name, fn in (("fused", fused_step), ("unfused", unfused_step)):
            for _ in range(args.warmup + 1):
                fn()
            synchronize(device)
            started = time.perf_counter()
            for _ in range(args.steps):
                fn()
            synchronize(device)
            timings[name] = (time.perf_counter() - started) / args.steps
        tflops = n * work / timings["fused"] / 1e12
        mfu = f"{tflops * 1e3 / peak:7.1%}" if device.type == "cuda" else ""
        print(f"{n:>3} {timings['fused'] * 1e3:9.2f} {timings['unfused'] * 1e3:11.2f} "
              f"{timings['unfused'] / timings['fused']:8.2f} {tflops:13.3f}{mfu}", flush=True)
        out.append({"trials": n, "fused_ms": timings["fused"] * 1e3,
                    "unfused_ms": timings["unfused"] * 1e3, "fused_tflops": tflops,
                    "memory_mb": peak_memory_mb(device)})
        args.save(out)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_data_arguments(p)
    p.add_argument("--mode", choices=("train", "layer"), default="train")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--trials", default="1,2,4,8,16,32",
                   help="comma-separated trial counts N (default 1,2,4,8,16,32)")
    p.add_argument("--threads", type=int, default=2,
                   help="host CPU threads: the fused process's, split among the unfused ones")
    p.add_argument("--steps", type=int, default=6, help="timed optimizer steps")
    p.add_argument("--warmup", type=int, default=2, help="optimizer steps before the timing")
    p.add_argument("--batch-size", type=int, help="default 32; 16 with --smart")
    p.add_argument("--smart", action="store_true",
                   help="train mode: SMART on (every λ_t = 1, μ = 1), batch 16 by default")
    p.add_argument("--length", type=int, default=64, help="layer mode: sequence length")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="train mode: another TrainConfig field (repeatable)")
    p.add_argument("--json", help="also write the raw figures to this file")
    args = p.parse_args()
    try:
        args.trials = [int(n) for n in args.trials.split(",")]
    except ValueError:
        p.error(f"--trials {args.trials!r}: expected integers separated by commas")
    args.batch_size = args.batch_size or (16 if args.smart else 32)
    if min(args.trials) < 1 or args.steps < 1 or args.warmup < 0:
        p.error("--trials and --steps must be >= 1, --warmup >= 0")
    if args.mode == "train" and not Path(args.data_dir, "ids-sst-train.csv").is_file():
        print(f"error: data not found in {args.data_dir} (expected ../shared/data)",
              file=sys.stderr)
        sys.exit(2)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but no CUDA GPU is available", file=sys.stderr)
        sys.exit(2)
    device = torch.device(args.device)
    peak = matmul_peak(device, args.threads)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else \
        f"CPU, {args.threads} threads"
    print(f"torch {torch.__version__}, {name}, matmul peak {peak:.1f} GFLOP/s "
          f"({'bf16' if device.type == 'cuda' else 'fp32'})")
    json_path = args.json

    def save(rows: list[dict]) -> None:
        """The figures so far to ``--json`` (after every N: a run cut short keeps its rows)."""
        if json_path:
            settings = {k: v for k, v in vars(args).items() if k != "save"}
            Path(json_path).write_text(json.dumps(
                {"peak_gflops": peak, "device": name, "torch": torch.__version__,
                 "args": settings, "rows": rows}, indent=1))

    args.save = save
    bench_train(args, peak) if args.mode == "train" else bench_layer(args, peak)


if __name__ == "__main__":
    main()
