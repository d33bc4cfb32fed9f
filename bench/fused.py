"""Fused trials (mtbert/step/fused_training.py) against the same trials unfused: ex/s, ms/step,
host and GPU time per step, ops per step, executed / real tokens, memory and (CUDA) MFU
for N = 1, 2, 4, ... trials of MiniLM on the real data.

Two measurements (``--mode``):

* ``train`` (default): for each N of ``--trials`` (fused) and ``--unfused-trials``
  (unfused; default the same N),
  - *fused*: one process (``--threads`` threads) trains N configurations differing in seed
    as one :class:`~mtbert.step.fused_training.FusedGroup` (each step is one optimizer step of
    every trial);
  - *unfused*: N processes started together, each one solo :class:`~mtbert.step.trainer.Trainer`
    (``--threads`` / N threads each on a CPU, at least 1, as trials share a machine in a
    search; on a GPU N processes share it); ex/s over the union of their timed windows.
  Each process first draws its ``--steps`` steps as training does (each trial's next
  update and its bookkeeping after the step), trains them ``--warmup`` more times (the
  unfused trainer's CUDA graphs of every batch shape among them are captured by then),
  then once more, timed: nothing is drawn, captured or counted inside the window
  (``graphs_captured_in_window`` says 0).  The draw's host time is reported apart
  (``draw_ms_per_step``).  Host ms / step: the time the host takes to issue a step (no
  synchronize; a step that waits for the GPU inside counts the wait); GPU ms / step: the
  kernels' busy time (torch.profiler, a pass over up to 5 of the steps after the window);
  ops / step: the aten ops one step dispatches (:class:`OpCounter`; a replayed CUDA graph
  is the few ops around its launch); executed / real tokens: the token positions the step
  computes (padding and filler rows, the fused stack's padding across trials) over the
  data rows' attended tokens.  A process that crashes or overruns ``--row-timeout`` ends
  its row with an error (the others run; the exit status is then 1).
  The configurations train plain batch 32 (``--batch-size``) under ``schedule=round_robin``
  (every trial trains the same task in a step; ``--set`` changes any field).  Memory: the
  peak resident set of the process(es) on a CPU (summed over the unfused ones), the peak
  allocated CUDA memory on a GPU; CPU s / 1000 ex: the processes' CPU time (host threads)
  per 1,000 examples, which a machine shared with other work disturbs less than ex/s.
  ``--smart``: #47's SMART workload instead, batch 16 (unless ``--batch-size``), every
  task's λ_t = 1 and μ = 1 (``--set`` overrides), fused
  (:class:`mtbert.techniques.smart.TrialAxisSmart`) and unfused; its MFU counts the plain forward and backward only, not SMART's extra ones.
* ``layer``: one BERT layer of the model alone, forward + backward on ``[N, batch, length]``
  hidden states: the N trials' layers fused (stacked weights, ``vmap``) against the N
  layers called one after another in one process -- what the fused design can reach
  where nothing else (data, optimizer, heads) is in the way.

  python -m bench.fused [--device cpu|cuda] [--trials 1,2,4,8,16,32] [--unfused-trials 1,8]
         [--threads 2] [--steps 6] [--warmup 2] [--batch-size 32] [--smart]
         [--set KEY=VALUE] [--row-timeout 600] [--json OUT]
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
import queue
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bench.common import add_data_arguments, synchronize
from bench.throughput import batch_lengths, matmul_peak, useful_flops
from mtbert.core.config import TrainConfig, parse_set_args
from mtbert.data import SharedBuckets, load_data, real_rows


#: ``--smart``: the SMART terms #47's SMART b16 workload trains with
SMART_WORKLOAD = {"smart_lambda_sst": 1.0, "smart_lambda_qqp": 1.0, "smart_lambda_sts": 1.0,
                  "smart_mu": 1.0}


def peak_memory_mb(device: torch.device) -> float:
    """The process's peak: allocated CUDA memory on a GPU, resident set on a CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2 ** 20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched while active (autograd's backward ops included; a
    replayed CUDA graph is the few ops that launch it): the host's work per step."""

    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _tokens(batch: dict[str, torch.Tensor]) -> int:
    """Token positions a batch computes: every row (filler rows too) x its padded width,
    summed over its sequences (a pair task's two)."""
    return sum(v.numel() for k, v in batch.items() if k.startswith("input_ids"))


def step_tokens(batches: dict, fused: bool, pad_id: int) -> tuple[int, int]:
    """(executed, real) tokens of one step's host batches ``{trial: {task: batch}}``:
    executed as the engine computes them (fused: the trials' batches of a task stacked,
    each padded to the most rows and the longest width among them), real the attended
    tokens of the data rows."""
    from mtbert.step.fused_model import stack_batches

    per_trial = list(batches.values())
    real = sum(int(batch_lengths(b).sum()) for bs in per_trial for b in bs.values())
    if not fused:
        return sum(_tokens(b) for bs in per_trial for b in bs.values()), real
    tasks = {task for bs in per_trial for task in bs}
    return sum(_tokens(stack_batches([bs.get(task) for bs in per_trial], pad_id))
               for task in tasks), real


def gpu_busy_ms(device: torch.device, run) -> float | None:
    """Milliseconds of GPU kernels that ``run()`` launches (torch.profiler's kernel time,
    summed over every op's own kernels); None on a CPU or where the profiler fails."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            run()
            synchronize(device)
        return sum(e.self_device_time_total for e in prof.key_averages()) / 1000
    except RuntimeError as exc:  # no CUPTI: the row keeps its other figures
        print(f"[bench.fused] no GPU-busy time: {str(exc).splitlines()[0]}", flush=True)
        return None


def worker(rank: int, settings: dict, barrier, results) -> None:
    """One process: ``settings["fused"]`` trials as one FusedGroup, or one solo trainer.

    Its ``steps`` timed steps are drawn first, as training draws them (each trial's next
    update, its bookkeeping after the step), then trained ``warmup`` more times (CUDA
    graphs of every batch shape among them are captured by then), then once more timed:
    nothing is drawn, captured or counted inside the window.  After it, outside the
    window: the same steps' GPU busy time (one profiled pass over at most 5 of them) and
    ops (one step under :class:`OpCounter`)."""
    from mtbert.step.fused_training import FusedGroup, group_step
    from mtbert.step.trainer import Trainer

    torch.set_num_threads(settings["threads"])
    configs = [TrainConfig.from_dict(c) for c in settings["configs"]]
    data = load_data(configs[0])
    outs = [Path(tempfile.mkdtemp(prefix=f"mtbert-fused-bench-{rank}-")) for _ in configs]
    warmup, steps = settings["warmup"], settings["steps"]
    if settings["fused"]:
        group = FusedGroup(configs, data, outs, checkpoints=False)
        trainers = list(group.trials.values())
        engine = group_step(trainers, group.streams)
    else:
        trainers = [Trainer(configs[0], data, outs[0], checkpoints=False)]
        engine = trainers[0].engine
    device = trainers[0].device
    graphs = getattr(trainers[0], "step_graphs", None)

    def train(batches: dict) -> None:
        """One optimizer step of every trial on ``batches``, each one's step counted."""
        losses = engine.step(batches)
        for t in trainers:
            t.count_update(losses[t])

    recorded, draw_s = [], 0.0
    for _ in range(steps):
        started = time.perf_counter()
        shared = SharedBuckets()  # as FusedGroup draws: each task's rows from one bucket
        batches = {t: t.next_update(shared) for t in trainers}
        draw_s += time.perf_counter() - started
        if None in batches.values():
            raise SystemExit(f"error: a trial trained to its end within the {steps} steps "
                             "drawn (give it more: --set epochs=...)")
        losses = engine.step(batches)
        for t in trainers:
            t.stepped(losses[t])
        recorded.append(batches)
    for _ in range(warmup):
        for batches in recorded:
            train(batches)
    synchronize(device)
    captured = graphs.stats.captured if graphs is not None else 0
    barrier.wait(timeout=settings.get("barrier_s", 600))
    host_s = 0.0
    started, cpu_started = time.time(), time.process_time()
    for batches in recorded:
        issued = time.perf_counter()
        train(batches)
        host_s += time.perf_counter() - issued
    synchronize(device)
    ended, cpu_s = time.time(), time.process_time() - cpu_started
    in_window = (graphs.stats.captured - captured) if graphs is not None else 0
    profiled = recorded[:5]
    gpu_ms = gpu_busy_ms(device, lambda: [train(b) for b in profiled])
    counter = OpCounter()
    with counter:
        train(recorded[0])
    synchronize(device)
    for t in trainers:
        t.check_losses()
    encoder, pad_id = trainers[0].model.encoder, data.pad_id
    host = [b for step in recorded for tasks in step.values() for b in tasks.values()]
    rows = sum(real_rows(b) for b in host)
    flops = sum(useful_flops(encoder, batch_lengths(b)) for b in host)
    tokens = [step_tokens(bs, settings["fused"], pad_id) for bs in recorded]
    results.put({"rank": rank, "examples": rows, "flops": flops, "start": started,
                 "end": ended, "cpu_s": cpu_s, "steps": steps,
                 "host_ms_per_step": 1000 * host_s / steps,
                 "gpu_ms_per_step": None if gpu_ms is None else gpu_ms / len(profiled),
                 "draw_ms_per_step": 1000 * draw_s / steps,
                 "ops_per_step": counter.ops,
                 "executed_tokens": sum(e for e, _ in tokens),
                 "real_tokens": sum(r for _, r in tokens),
                 "graphs_captured": captured, "graphs_captured_in_window": in_window,
                 "memory_mb": peak_memory_mb(device), "device": str(device),
                 "step_mode": "fused" if settings["fused"] else
                 ("graphs" if graphs is not None else "eager")})


class WorkerError(RuntimeError):
    """A bench process exited without its figures, or did not send them in time."""


#: what the processes' fork server imports once (no CUDA use there), so that each row's
#: processes start in a second rather than importing torch and transformers anew
PRELOAD = ["torch", "transformers", "mtbert.step.fused_training", "mtbert.step.trainer"]


def run_processes(settings: list[dict], timeout_s: float = 600.0) -> dict:
    """Start one process per settings, together (forked from a server that imported
    :data:`PRELOAD`); their figures over the union window.  A process that exits without
    its figures (a crash) or a run past ``timeout_s`` ends them all: :class:`WorkerError`
    says which."""
    ctx = mp.get_context("forkserver")
    barrier, results = ctx.Barrier(len(settings)), ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, {**s, "barrier_s": timeout_s}, barrier,
                                              results))
             for r, s in enumerate(settings)]
    for proc in procs:
        proc.start()
    rows, deadline = [], time.monotonic() + timeout_s
    try:
        while len(rows) < len(procs):
            try:
                rows.append(results.get(timeout=0.5))
                continue
            except queue.Empty:
                pass
            sent = {r["rank"] for r in rows}
            gone = [(rank, p.exitcode) for rank, p in enumerate(procs)
                    if p.exitcode is not None and rank not in sent]
            if gone:
                time.sleep(1.0)  # a result put just before a clean exit may still be in flight
                while not results.empty():
                    rows.append(results.get())
                sent = {r["rank"] for r in rows}
                gone = [(rank, code) for rank, code in gone if rank not in sent]
                if gone:
                    raise WorkerError(", ".join(f"process {rank} exited {code}"
                                                for rank, code in gone) + " without its figures")
            if time.monotonic() > deadline:
                raise WorkerError(f"{len(procs) - len(rows)} of {len(procs)} processes sent no "
                                  f"figures within {timeout_s:.0f} s")
    finally:
        for proc in procs:
            if proc.is_alive() and proc.exitcode is None and len(rows) < len(procs):
                proc.terminate()
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    window = max(r["end"] for r in rows) - min(r["start"] for r in rows)
    examples = sum(r["examples"] for r in rows)
    gpu = [r["gpu_ms_per_step"] for r in rows]
    return {"processes": sorted(rows, key=lambda r: r["rank"]), "window_s": window,
            "ex_per_s": examples / window,
            "gflops": sum(r["flops"] for r in rows) / window / 1e9,
            "ms_per_step": 1000 * window / rows[0]["steps"],
            "host_ms_per_step": sum(r["host_ms_per_step"] for r in rows) / len(rows),
            "gpu_ms_per_step": None if None in gpu else sum(gpu),
            "draw_ms_per_step": sum(r["draw_ms_per_step"] for r in rows) / len(rows),
            "ops_per_step": sum(r["ops_per_step"] for r in rows),
            "executed_tokens": sum(r["executed_tokens"] for r in rows),
            "real_tokens": sum(r["real_tokens"] for r in rows),
            "executed_per_real_token": sum(r["executed_tokens"] for r in rows)
            / max(1, sum(r["real_tokens"] for r in rows)),
            "graphs_captured_in_window": sum(r["graphs_captured_in_window"] for r in rows),
            "memory_mb": sum(r["memory_mb"] for r in rows),
            "cpu_s_per_1000_ex": 1000 * sum(r["cpu_s"] for r in rows) / examples,
            "step_mode": rows[0]["step_mode"]}


def bench_train(args, peak: float) -> list[dict]:
    """Fused rows for every N of ``--trials``; unfused rows (N processes) for the N of
    ``--unfused-trials`` (default: the same)."""
    smart = SMART_WORKLOAD if args.smart else {}
    base = dict(model=args.model, data_dir=args.data_dir, batch_size=args.batch_size,
                device=args.device, progress=False, eval_dev=False, eval_every=10 ** 9,
                schedule="round_robin", **{**smart, **parse_set_args(args.set)})
    TrainConfig.from_dict(base)  # bad values fail here, before any process starts
    unfused = args.trials if args.unfused_trials is None else args.unfused_trials
    out, failed = [], []
    print(f"workload: {'SMART' if args.smart else 'plain'}, batch {args.batch_size}; "
          f"{args.steps} timed steps after {args.warmup} warm-up passes over them")
    print(f"{'N':>3} {'engine':>8} {'step':>6} {'ex/s':>9} {'ms/step':>8} {'host ms':>8} "
          f"{'GPU ms':>7} {'ops':>7} {'exec/real':>9} {'memory MB':>10}{' MFU':>7}")
    for n in sorted(set(args.trials) | set(unfused)):
        configs = [{**base, "seed": seed} for seed in range(n)]
        common = {"warmup": args.warmup, "steps": args.steps}
        runs = {}
        if n in args.trials:
            runs["fused"] = [{"fused": True, "configs": configs, "threads": args.threads,
                              **common}]
        if n in unfused:
            runs["unfused"] = [{"fused": False, "configs": [c],
                                "threads": max(1, args.threads // n), **common}
                               for c in configs]
        row = {"trials": n}
        for engine, settings in runs.items():
            try:
                figures = run_processes(settings, args.row_timeout)
            except WorkerError as exc:
                row[engine] = {"error": str(exc)}
                failed.append(f"N={n} {engine}: {exc}")
                print(f"{n:>3} {engine:>8} error: {exc}", flush=True)
                continue
            row[engine] = figures
            mfu = f"{figures['gflops'] / peak:7.1%}" if args.device == "cuda" else ""
            gpu = figures["gpu_ms_per_step"]
            print(f"{n:>3} {engine:>8} {figures['step_mode']:>6} {figures['ex_per_s']:9.1f} "
                  f"{figures['ms_per_step']:8.1f} {figures['host_ms_per_step']:8.1f} "
                  f"{'-' if gpu is None else f'{gpu:.1f}':>7} {figures['ops_per_step']:7d} "
                  f"{figures['executed_per_real_token']:9.2f} {figures['memory_mb']:10.0f}{mfu}",
                  flush=True)
        if "ex_per_s" in row.get("fused", {}) and "ex_per_s" in row.get("unfused", {}):
            row["fused_over_unfused"] = row["fused"]["ex_per_s"] / row["unfused"]["ex_per_s"]
            print(f"{n:>3} fused / unfused ex/s: {row['fused_over_unfused']:.3f}", flush=True)
        out.append(row)
        args.save(out)
    if failed:
        raise SystemExit("error: " + "; ".join(failed))
    return out


def bench_layer(args, peak: float) -> list[dict]:
    """One encoder layer, fused over N against N layers one after another (module doc)."""
    from torch.func import functional_call, stack_module_state, vmap

    from mtbert.core.devices import prefer_stable_attention_kernels
    from mtbert.core.pretrained import load_encoder

    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    if device.type == "cuda":
        prefer_stable_attention_kernels()  # SDPA's kernels as training has them
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
    p.add_argument("--unfused-trials",
                   help="train mode: the N of the unfused rows (default: --trials; '' none)")
    p.add_argument("--row-timeout", type=float, default=600.0,
                   help="train mode: seconds a row's processes may take before they are ended")
    p.add_argument("--threads", type=int, default=2,
                   help="host CPU threads: the fused process's, split among the unfused ones")
    p.add_argument("--steps", type=int, default=6, help="timed optimizer steps")
    p.add_argument("--warmup", type=int, default=2,
                   help="train mode: passes over the timed steps' batches before the timing "
                        "(after the pass that draws them); layer mode: steps before it")
    p.add_argument("--batch-size", type=int, help="default 32; 16 with --smart")
    p.add_argument("--smart", action="store_true",
                   help="train mode: SMART on (every λ_t = 1, μ = 1), batch 16 by default")
    p.add_argument("--length", type=int, default=64, help="layer mode: sequence length")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="train mode: another TrainConfig field (repeatable)")
    p.add_argument("--json", help="also write the raw figures to this file")
    args = p.parse_args()
    mp.set_forkserver_preload(PRELOAD)
    try:
        args.trials = [int(n) for n in args.trials.split(",")]
        if args.unfused_trials is not None:
            args.unfused_trials = [int(n) for n in args.unfused_trials.split(",") if n.strip()]
    except ValueError:
        p.error(f"--trials {args.trials!r} / --unfused-trials {args.unfused_trials!r}: "
                "expected integers separated by commas")
    args.batch_size = args.batch_size or (16 if args.smart else 32)
    if min(args.trials + (args.unfused_trials or [])) < 1 or args.steps < 1 or args.warmup < 0:
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
