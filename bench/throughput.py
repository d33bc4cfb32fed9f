"""The step bench: what a training step costs by engine (solo trainers, fused trials),
number of trials N and technique, on the real data -- examples/s, useful GFLOP/s and MFU,
ms per step (wall, host, GPU busy), ops per step, executed / real tokens, memory.

Modes (``--mode``; the figures: docs/bench/throughput.md, fused.md, techniques.md):
``trainer`` (default), N solo trainers in fresh processes started together, each step
drawn inside the timed window; ``fused``, N trials fused in one process against the same
N unfused, the steps drawn first, trained ``--warmup`` more times, then once more, timed;
``techniques``, each ``--technique`` alone in a process (memory, ops), then all in one,
in turn on the same batches; ``layer``, one BERT layer fused over N (``vmap``) against N
layers in turn.  MFU = useful FLOPs/s (6·N·T for the dense weights plus attention's
12·L·H·Σ s², real tokens only) over the measured matmul peak (fp32 CPU, bf16 GPU).
"""

from __future__ import annotations

import argparse
import copy
import json
import multiprocessing as mp
import os
import queue
import resource
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch

from bench.common import REPO, add_data_arguments, seconds, synchronize
from mtbert.core.config import TrainConfig, parse_set_args
from mtbert.core.tasks import TASK_NAMES
from mtbert.data import SharedBuckets, load_data, real_rows
from mtbert.step.step_counts import OpCounter, real_lengths, step_tokens

_SMART = dict(smart_lambda_sst=1.0, smart_lambda_qqp=1.0, smart_lambda_sts=1.0)
#: ``--technique``: what each adds to the plain step (SMART: 1 ascent step; smart_l
#: without the Bregman teacher, the smoothness term alone; PCGrad over the 3 tasks)
TECHNIQUES = {"plain": {}, "smart": {**_SMART, "smart_mu": 1.0}, "smart_l": _SMART,
              "pcgrad": {"pcgrad": True}, "both": {**_SMART, "smart_mu": 1.0, "pcgrad": True}}
#: each mode's --trials, --steps and --warmup unless given
DEFAULTS = {"trainer": ("1", 12, 4), "fused": ("1,2,4,8,16,32", 6, 2),
            "techniques": ("1", 10, 0), "layer": ("1,2,4,8,16,32", 6, 2)}
#: what the fork server of the fused rows imports once (no CUDA use there)
PRELOAD = ["torch", "transformers", "mtbert.loop.training_group", "mtbert.loop.trainer"]


# ------------------------------------------------------------------ figures
def matmul_peak(device: torch.device, threads: int, repeats: int = 10) -> float:
    """Best GFLOP/s of a square matmul: fp32 n=2048 on the CPU (``threads`` threads),
    bf16 n=8192 on a GPU."""
    torch.set_num_threads(threads)
    n, dtype = (8192, torch.bfloat16) if device.type == "cuda" else (2048, torch.float32)
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    torch.mm(a, b)  # the first call picks the kernel
    return max(2 * n ** 3 / seconds(device, lambda: torch.mm(a, b)) for _ in range(repeats)) / 1e9


def useful_flops(encoder, lengths: np.ndarray) -> float:
    cfg = encoder.config
    n_dense = sum(p.numel() for name, p in encoder.named_parameters() if "embeddings" not in name)
    attention = 12 * cfg.num_hidden_layers * cfg.hidden_size * float(
        (lengths.astype(np.float64) ** 2).sum())
    return 6 * n_dense * float(lengths.sum()) + attention


def peak_memory_mb(device: torch.device) -> float:
    """The process's peak: allocated CUDA memory on a GPU, resident set on a CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2 ** 20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _status_mb(key: str) -> float:
    line = next(x for x in Path("/proc/self/status").read_text().splitlines()
                if x.startswith(key + ":"))
    return int(line.split()[1]) / 1024


def step_memory_mb(device: torch.device, run) -> float | None:
    """What ``run()`` adds: its peak over the memory before it (CUDA: allocated; CPU: the
    resident set, its high-water mark reset first; None where Linux does not let it)."""
    if device.type == "cuda":
        synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        run()
        synchronize(device)
        return (torch.cuda.max_memory_allocated(device) - before) / 2 ** 20
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return None
    before = _status_mb("VmRSS")
    run()
    return _status_mb("VmHWM") - before


def gpu_busy_ms(device: torch.device, run) -> float | None:
    """Milliseconds of GPU kernels that ``run()`` launches (torch.profiler); None on a CPU
    or where the profiler fails."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            run()
            synchronize(device)
        return sum(e.self_device_time_total for e in prof.key_averages()) / 1000
    except RuntimeError as exc:  # no CUPTI: the row keeps its other figures
        print(f"[bench] no GPU-busy time: {str(exc).splitlines()[0]}", flush=True)
        return None


# ------------------------------------------------------------------ one process of a row
def worker(rank: int, settings: dict, barrier, results) -> None:
    """One process of a row (module doc): its trials as one TrainingGroup, or one solo trainer
    each (several: the techniques, trained in turn on the same batches)."""
    from mtbert.loop.training_group import TrainingGroup, group_step
    from mtbert.loop.trainer import Trainer

    torch.set_num_threads(settings["threads"])
    configs = [TrainConfig.from_dict(c) for c in settings["configs"]]
    data = load_data(configs[0])
    scratch = tempfile.TemporaryDirectory(prefix=f"mtbert-bench-{rank}-")  # removed at the end
    outs = [Path(scratch.name) / str(i) for i in range(len(configs))]
    for out in outs:
        out.mkdir()
    if settings["fused"]:
        group = TrainingGroup(configs, data, outs, checkpoints=False)
        trials = list(group.trials.values())
        engines = [(trials, group_step(trials))]
    else:
        trials = [Trainer(c, data, o, checkpoints=False) for c, o in zip(configs, outs)]
        engines = [([t], t.engine) for t in trials]
    startup_s = time.time() - settings["spawned_at"]
    device, live, steps = trials[0].device, settings["live"], settings["steps"]
    graphs = getattr(trials[0], "step_graphs", None)
    drawers = trials if settings["fused"] else trials[:1]

    def draw() -> dict:
        shared = SharedBuckets()  # as TrainingGroup draws: each task's rows from one bucket
        drawn = {t: t.next_update(shared) for t in drawers}
        if None in drawn.values():
            raise SystemExit("error: a trial trained to its end (give it more: --set epochs=...)")
        return {t: drawn.get(t, drawn[drawers[0]]) for t in trials}

    def train(step: dict, which=engines, stepped: bool = False) -> None:
        for members, engine in which:
            losses = engine.step({m: step[m] for m in members})
            for m in members:
                (m.stepped if stepped and m in drawers else m.count_update)(losses[m])

    recorded, draw_s, warm_started = [], 0.0, time.time()
    for i in range(settings["warmup"] + (0 if live else steps)):
        if live:
            train(draw(), stepped=True)
        elif i < steps:  # the timed steps drawn first, as training draws them
            started = time.perf_counter()
            recorded.append(draw())
            draw_s += time.perf_counter() - started
            train(recorded[-1], stepped=True)
        else:  # then trained `warmup` more times: every shape's graphs captured by then
            for step in recorded:
                train(step)
    synchronize(device)
    warmup_s = time.time() - warm_started
    before = graphs.stats.as_metrics() if graphs is not None else {}
    barrier.wait(timeout=settings["barrier_s"])
    times, host_s = {name: [] for name in settings["names"]}, 0.0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if live and device.type == "cuda":  # each host sync of the steps warns
            torch.cuda.set_sync_debug_mode("warn")
        started, cpu_started = time.time(), time.process_time()
        for i in range(steps):
            issued = time.perf_counter()
            if live:
                recorded.append(draw())
                draw_s += time.perf_counter() - issued
            if not settings["rotate"]:
                train(recorded[i], stepped=live)
            for j in range(len(engines)) if settings["rotate"] else ():
                k = (i + j) % len(engines)  # the order rotates from round to round
                times[settings["names"][k]].append(
                    seconds(device, lambda: train(recorded[i], [engines[k]])))
            host_s += time.perf_counter() - issued
        synchronize(device)
        ended, cpu_s = time.time(), time.process_time() - cpu_started
        if device.type == "cuda":
            torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message).splitlines()[0] for w in caught if "synchroniz" in str(w.message)]
    after = graphs.stats.as_metrics() if graphs is not None else {}
    barrier.wait(timeout=settings["barrier_s"])
    # the first pass: the evaluation's shapes warm up
    evals = [seconds(device, lambda: trials[0].evaluate("val"))
             for _ in range(2 if settings["eval"] else 0)]
    profiled = recorded[:5]
    gpu_ms = gpu_busy_ms(device, lambda: [train(s) for s in profiled])
    with OpCounter() as counter:
        train(recorded[0])
    step_mb = step_memory_mb(device, lambda: train(recorded[0]))
    for t in trials:
        t.check_losses()
    host = [b for step in recorded for t in drawers for b in step[t].values()]
    tokens = [step_tokens({t: s[t] for t in drawers}, settings["fused"]) for s in recorded]
    figures = {
        "rank": rank, "examples": sum(real_rows(b) for b in host), "start": started,
        "end": ended, "cpu_s": cpu_s, "steps": steps, "startup_s": startup_s,
        "warmup_s": warmup_s, "host_ms_per_step": 1000 * host_s / steps,
        "flops": sum(useful_flops(trials[0].model.encoder, real_lengths(b)) for b in host),
        "gpu_ms_per_step": None if gpu_ms is None else gpu_ms / len(profiled),
        "draw_ms_per_step": 1000 * draw_s / steps, "ops_per_step": counter.ops,
        "executed_tokens": sum(e for e, _ in tokens), "real_tokens": sum(r for _, r in tokens),
        "graphs_captured": before.get("graphs/captured", 0),
        "graphs_captured_in_window": after.get("graphs/captured", 0)
        - before.get("graphs/captured", 0), "graphs_after_warmup": before,
        "graphs_after_steady": after, "memory_mb": peak_memory_mb(device), "step_mb": step_mb,
        "device": str(device), "static_max_length": trials[0].static_max_length,
        "step_mode": "fused" if settings["fused"] else "graphs" if graphs is not None else "eager",
        "host_syncs": len(syncs) if live and device.type == "cuda" else None,
        "sync_examples": sorted(set(syncs))[:3], "times": times}
    if evals:
        figures.update(val_rows=sum(len(data.split(t, "val")) for t in TASK_NAMES),
                       eval_first_s=evals[0], eval_s=evals[1])
    if settings["capture"]:  # last: a failed capture may leave the CUDA context unusable
        (members, engine), = engines
        first = {m: recorded[0][m] for m in members}
        figures["capture"] = capture_step(device, engine, first, steps, sum(
            real_rows(b) for t in drawers for b in recorded[0][t].values()))
    scratch.cleanup()
    results.put(figures)


def capture_step(device: torch.device, engine, batches: dict, steps: int, rows: int) -> dict:
    """Whether the stacked step (``engine.step(batches)``) captures as one CUDA graph
    (``torch.cuda.graph``, after three eager steps on a side stream) and, where it does, its
    replays' rate: ``rows`` examples a step.  Where it does not, the first line of the error
    (a host sync, a host-to-device copy or a tensor built from host values in the step)."""
    if device.type != "cuda":
        return {"captured": False, "reason": f"no CUDA graphs on {device.type}"}
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            engine.step(batches)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            engine.step(batches)
    except Exception as exc:  # noqa: BLE001 -- the reason is the figure
        return {"captured": False,
                "reason": f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:300]}"}
    elapsed = seconds(device, lambda: [graph.replay() for _ in range(steps)])
    return {"captured": True, "replay_ms_per_step": 1000 * elapsed / steps,
            "ex_per_s": rows * steps / elapsed}


class WorkerError(RuntimeError):
    """A bench process exited without its figures, or did not send them in time."""


def run_processes(settings: list[dict], timeout_s: float, start: str = "forkserver") -> dict:
    """One process per settings, started together (``spawn``: fresh interpreters;
    ``forkserver``: forked from a server that imported :data:`PRELOAD`); their figures over
    the union of their windows.  A process that exits without its figures or a run past
    ``timeout_s`` ends them all: :class:`WorkerError` says which."""
    ctx = mp.get_context(start)
    barrier, results = ctx.Barrier(len(settings)), ctx.Queue()
    procs = []
    for rank, s in enumerate(settings):
        procs.append(ctx.Process(target=worker, args=(rank, {
            **s, "spawned_at": time.time(), "barrier_s": timeout_s}, barrier, results)))
        procs[-1].start()
    rows, deadline = [], time.monotonic() + timeout_s
    try:
        while len(rows) < len(procs):
            try:
                rows.append(results.get(timeout=0.5))
                continue
            except queue.Empty:
                pass
            gone = [rank for rank, p in enumerate(procs) if p.exitcode is not None]
            if set(gone) - {r["rank"] for r in rows}:
                time.sleep(1.0)  # a result put just before a clean exit may still be in flight
                while not results.empty():
                    rows.append(results.get())
                lost = sorted(set(gone) - {r["rank"] for r in rows})
                if lost:
                    raise WorkerError(", ".join(f"process {r} exited {procs[r].exitcode}"
                                                for r in lost) + " without its figures")
            if time.monotonic() > deadline:
                raise WorkerError(f"{len(procs) - len(rows)} of {len(procs)} processes sent no "
                                  f"figures within {timeout_s:.0f} s")
    finally:
        for proc in procs:
            if proc.is_alive() and len(rows) < len(procs):
                proc.terminate()
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    rows.sort(key=lambda r: r["rank"])
    window = max(r["end"] for r in rows) - min(r["start"] for r in rows)
    examples, gpu = sum(r["examples"] for r in rows), [r["gpu_ms_per_step"] for r in rows]
    total = lambda key: sum(r[key] for r in rows)  # noqa: E731
    return {"processes": rows, "window_s": window, "ex_per_s": examples / window,
            "gflops": total("flops") / window / 1e9,
            "ms_per_step": 1000 * window / rows[0]["steps"],
            **{k: total(k) / len(rows) for k in ("host_ms_per_step", "draw_ms_per_step")},
            "gpu_ms_per_step": None if None in gpu else sum(gpu),
            **{k: total(k) for k in ("ops_per_step", "executed_tokens", "real_tokens",
                                     "graphs_captured_in_window", "memory_mb")},
            "executed_per_real_token": total("executed_tokens") / max(1, total("real_tokens")),
            "step_mb": None if any(r["step_mb"] is None for r in rows) else total("step_mb"),
            "cpu_s_per_1000_ex": 1000 * total("cpu_s") / examples,
            "step_mode": rows[0]["step_mode"],
            **({"capture": rows[0]["capture"]} if "capture" in rows[0] else {})}


# ------------------------------------------------------------------ modes
def base_config(args, technique: str, **defaults) -> dict:
    config = dict(model=args.model, data_dir=args.data_dir, batch_size=args.batch_size,
                  device=args.device, progress=False, eval_dev=False, eval_every=10 ** 9,
                  pad_lengths=args.pad_lengths, compile=args.compile,
                  step_mode=args.step_mode, eval_batch_size=args.eval_batch_size,
                  max_eval_per_task=args.eval_rows, **defaults, **TECHNIQUES[technique])
    config.update(parse_set_args(args.set))
    TrainConfig.from_dict(config)  # bad values fail here, before any process starts
    return config


def process(args, configs: list[dict], threads: int, fused: bool = False, **more) -> dict:
    live = args.mode == "trainer"
    return {"configs": configs, "fused": fused, "threads": threads, "live": live,
            "eval": live, "rotate": False, "names": [], "steps": args.steps,
            "warmup": args.warmup, "capture": fused and args.capture,
            **more}


def print_row(n: int, engine: str, f: dict, peak: float) -> None:
    gpu, step_mb = f["gpu_ms_per_step"], f["step_mb"]
    print(f"{n:>3} {engine:>8} {f['step_mode']:>6} {f['ex_per_s']:9.1f} {f['ms_per_step']:8.1f} "
          f"{f['host_ms_per_step']:8.1f} {'-' if gpu is None else f'{gpu:.1f}':>7} "
          f"{f['ops_per_step']:7d} {f['executed_per_real_token']:9.2f} {f['memory_mb']:9.0f} "
          f"{'-' if step_mb is None else f'{step_mb:.0f}':>7} {f['gflops']:8.1f} "
          f"{f['gflops'] / peak:6.1%}", flush=True)
    for r in f["processes"] if "eval_s" in f["processes"][0] else ():
        span = r["end"] - r["start"]
        print(f"    proc {r['rank']}: start-up {r['startup_s']:.1f} s, warm-up "
              f"{r['warmup_s']:.1f} s, {r['examples'] / span:.1f} ex/s, MFU "
              f"{r['flops'] / span / 1e9 / peak:.1%}; validation {r['val_rows'] / r['eval_s']:.1f} "
              f"rows/s (first pass {r['eval_first_s']:.2f} s)")
        w, s = r["graphs_after_warmup"], r["graphs_after_steady"]
        if s:
            print(f"      graphs: {s['graphs/shapes']} (task, shape)s met, {s['graphs/captured']} "
                  f"captured in {s['graphs/capture_s']:.1f} s ({w['graphs/captured']} by the end "
                  f"of the warm-up); steady steps "
                  f"{s['graphs/replayed_steps'] - w['graphs/replayed_steps']} replayed, "
                  f"{s['graphs/eager_steps'] - w['graphs/eager_steps']} eager")
        if r["host_syncs"] is not None:
            print(f"      host synchronisations in the steady steps: {r['host_syncs']} "
                  f"{r['sync_examples']}")


def bench_rows(args, peak: float) -> list[dict]:
    """``trainer`` and ``fused``: a row per technique and N, each engine's figures."""
    fused = args.trials if args.mode == "fused" else []
    unfused = args.trials if args.unfused_trials is None else args.unfused_trials
    start = "spawn" if args.mode == "trainer" else "forkserver"
    out, failed = [], []
    print(f"batch {args.batch_size}, {args.warmup} warm-up + {args.steps} timed steps, "
          f"pad_lengths={args.pad_lengths}, compile={args.compile}"
          f"{', ' + ' '.join(args.set) if args.set else ''}")
    print(f"{'N':>3} {'engine':>8} {'step':>6} {'ex/s':>9} {'ms/step':>8} {'host ms':>8} "
          f"{'GPU ms':>7} {'ops':>7} {'exec/real':>9} {'memory MB':>9} {'step MB':>7} "
          f"{'GFLOP/s':>8} {'MFU':>6}")
    for technique in args.technique:
        defaults = {"schedule": "round_robin"} if args.mode == "fused" else {}
        base = base_config(args, technique, **defaults)
        for n in sorted(set(fused) | set(unfused)):
            configs = [{**base, "seed": seed} for seed in range(n)]
            runs = {"fused": [process(args, configs, args.threads, fused=True)]} if n in fused \
                else {}
            if n in unfused:
                runs["unfused"] = [process(args, [c], max(1, args.threads // n)) for c in configs]
            row = {"trials": n, "technique": technique}
            for engine, settings in runs.items():
                try:
                    row[engine] = run_processes(settings, args.row_timeout, start)
                except WorkerError as exc:
                    row[engine] = {"error": str(exc)}
                    failed.append(f"N={n} {technique} {engine}: {exc}")
                    print(f"{n:>3} {engine:>8} error: {exc}", flush=True)
                    continue
                print_row(n, engine, row[engine], peak)
            if "ex_per_s" in row.get("fused", {}) and "ex_per_s" in row.get("unfused", {}):
                row["fused_over_unfused"] = row["fused"]["ex_per_s"] / row["unfused"]["ex_per_s"]
                print(f"{n:>3} fused / unfused ex/s: {row['fused_over_unfused']:.3f}", flush=True)
            out.append(row)
            args.save(out)
    if failed:
        raise SystemExit("error: " + "; ".join(failed))
    return out


def bench_techniques(args, peak: float) -> list[dict]:
    """Each technique alone in a process (memory, ops), then all in one, in turn; with
    ``--precision``, each technique in each precision (``plain@bf16``), and the speed-up of
    each over its first precision's."""
    names, configs = [], []
    for technique in args.technique:
        for precision in args.precision or [None]:
            names.append(f"{technique}@{precision}" if precision else technique)
            configs.append(base_config(args, technique, update="summed",
                                       schedule="round_robin",
                                       **({"precision": precision} if precision else {})))
    alone = {name: run_processes([process(args, [c], args.threads, steps=1, warmup=0)],
                                 args.row_timeout) for name, c in zip(names, configs)}
    together = run_processes([process(args, configs, args.threads, rotate=True, names=names)],
                             args.row_timeout)["processes"][0]
    times = {name: np.asarray(together["times"][name]) for name in names}
    first = "plain" if "plain" in names else names[0]
    tokens = together["executed_tokens"] / args.steps
    print(f"batch {args.batch_size} a task, ~{tokens:.0f} tokens a step, {args.threads} "
          f"threads; {args.steps} rounds, each technique in turn on the round's batches")
    header = (f"{'technique':<14} {'mean s/step':>11} {'x ' + first:>13} {'median round x':>15} "
              f"{'memory MB':>10} {'x':>6} {'step MB':>8} {'x':>6} {'ops':>7}"
              + (f" {'speed-up over ' + args.precision[0]:>22}" if args.precision else ""))
    print(header + "\n" + "-" * len(header))
    rows = []
    for name in names:
        a, b = alone[name], alone[first]
        ratio = lambda key: a[key] / b[key] if a[key] and b[key] else float("nan")  # noqa: E731
        rows.append({"technique": name, "mean_s": float(times[name].mean()),
                     "x_first": float(times[name].sum() / times[first].sum()),
                     "median_round_x": float(np.median(times[name] / times[first])),
                     "times": times[name].tolist(), "alone": a})
        r = rows[-1]
        speedup = ""
        if args.precision:  # the same technique in the first precision, over this one
            base = f"{name.split('@')[0]}@{args.precision[0]}"
            r["speedup"] = float(times[base].sum() / times[name].sum())
            speedup = f" {r['speedup']:>22.2f}"
        print(f"{name:<14} {r['mean_s']:>11.2f} {r['x_first']:>13.2f} "
              f"{r['median_round_x']:>15.2f} {a['memory_mb']:>10.0f} {ratio('memory_mb'):>6.2f} "
              f"{a['step_mb'] or float('nan'):>8.0f} {ratio('step_mb'):>6.2f} "
              f"{a['ops_per_step']:>7d}{speedup}", flush=True)
    args.save(rows)
    return rows


def bench_layer(args, peak: float) -> list[dict]:
    """One encoder layer, fused over N against N layers one after another (module doc)."""
    from torch.func import functional_call, stack_module_state, vmap

    from mtbert.core.devices import prefer_stable_attention_kernels
    from mtbert.core.pretrained import load_encoder

    device = torch.device(args.device)
    if device.type == "cuda":
        prefer_stable_attention_kernels()  # SDPA's kernels as training has them
    encoder = load_encoder(args.model)
    layer = encoder.encoder.layer[0].to(device).train()
    hidden, batch, length = encoder.config.hidden_size, args.batch_size, args.length
    dense = sum(p.numel() for p in layer.parameters() if p.ndim == 2)
    work = 6 * dense * batch * length + 12 * hidden * batch * length ** 2
    autocast = device.type == "cuda"
    out = []
    print(f"one {encoder.config.model_type} layer (hidden {hidden}), batch {batch} x length "
          f"{length}, forward + backward; {'bf16 autocast' if autocast else 'fp32'}")
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
            timings[name] = seconds(device, lambda: [fn() for _ in range(args.steps)]) / args.steps
        tflops = n * work / timings["fused"] / 1e12
        print(f"{n:>3} {timings['fused'] * 1e3:9.2f} {timings['unfused'] * 1e3:11.2f} "
              f"{timings['unfused'] / timings['fused']:8.2f} {tflops:13.3f}"
              f"{tflops * 1e3 / peak:7.1%}", flush=True)
        out.append({"trials": n, "fused_ms": timings["fused"] * 1e3,
                    "unfused_ms": timings["unfused"] * 1e3, "fused_tflops": tflops,
                    "memory_mb": peak_memory_mb(device)})
        args.save(out)
    return out


# ------------------------------------------------------------------ command line
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_data_arguments(p)
    p.add_argument("--mode", choices=list(DEFAULTS), default="trainer")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--trials", "--concurrent", help="comma-separated N (default: trainer 1; "
                   "fused and layer 1,2,4,8,16,32)")
    p.add_argument("--unfused-trials", help="fused mode: the N of the unfused rows "
                   "(default: --trials; '' none)")
    p.add_argument("--technique", default="plain", help=f"comma-separated, from "
                   f"{', '.join(TECHNIQUES)} (techniques mode: default all)")
    p.add_argument("--precision", default="", help="techniques mode: comma-separated "
                   "precisions (fp32, bf16, auto), each technique once in each, in turn on "
                   "the same batches (default: the config's)")
    p.add_argument("--steps", type=int, help="timed steps")
    p.add_argument("--warmup", type=int, help="trainer: warm-up steps; fused and techniques: "
                   "passes over the timed steps after the one that draws them; layer: "
                   "steps before the timing")
    p.add_argument("--threads", type=int, default=2,
                   help="host CPU threads: a fused process's, split among unfused ones")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--row-timeout", type=float, default=600.0,
                   help="seconds a row's processes may take before they are ended")
    p.add_argument("--eval-batch-size", type=int, default=0,
                   help="validation rows per batch (0 = auto: 128 on a CPU, 1,024 on a GPU)")
    p.add_argument("--eval-rows", type=int, default=0,
                   help="validation rows per task to score (0 = the whole split)")
    p.add_argument("--pad-lengths", choices=("auto", "batch", "buckets"), default="auto")
    p.add_argument("--compile", choices=("none", "default", "reduce-overhead"), default="none")
    p.add_argument("--step-mode", choices=("auto", "graphs", "eager"), default="auto",
                   help="captured CUDA graphs of the solo step or eager (auto: graphs on CUDA)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="another TrainConfig field, e.g. smart_lambda_sst=1 (repeatable)")
    p.add_argument("--length", type=int, default=64, help="layer: sequence length")
    p.add_argument("--capture", action="store_true", help="fused: also try to capture the "
                   "stacked step in one CUDA graph; its row says whether it captured, and "
                   "its replays' ex/s")
    p.add_argument("--json", help="also write the figures to this file (after every row)")
    args = p.parse_args(argv)
    trials, args.steps, args.warmup = [x if y is None else y for x, y in zip(
        DEFAULTS[args.mode], (args.trials, args.steps, args.warmup))]
    if args.mode == "techniques" and args.technique == "plain":
        args.technique = ",".join(TECHNIQUES)
    try:
        args.trials = [int(n) for n in trials.split(",")]
        if args.unfused_trials is not None:
            args.unfused_trials = [int(n) for n in args.unfused_trials.split(",") if n.strip()]
    except ValueError:
        p.error(f"--trials {trials!r} / --unfused-trials {args.unfused_trials!r}: expected "
                "integers separated by commas")
    args.technique = args.technique.split(",")
    args.precision = [x for x in args.precision.split(",") if x]
    for flag, given, known in (("--precision", args.precision, {"fp32", "bf16", "auto"}),
                               ("--technique", args.technique, set(TECHNIQUES))):
        if set(given) - known:
            p.error(f"{flag}: unknown {sorted(set(given) - known)}")
    if min(args.trials + (args.unfused_trials or [])) < 1 or args.steps < 1 or args.warmup < 0:
        p.error("--trials and --steps must be >= 1, --warmup >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.mode != "layer" and not Path(args.data_dir, "ids-sst-train.csv").is_file():
        print(f"error: data not found in {args.data_dir} (expected ../shared/data)",
              file=sys.stderr)
        return 2
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but no CUDA GPU is available", file=sys.stderr)
        return 2
    mp.set_forkserver_preload(PRELOAD)
    device = torch.device(args.device)
    peak = matmul_peak(device, args.threads)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else \
        f"CPU, {args.threads} threads"
    print(f"torch {torch.__version__}, {name}, matmul peak {peak:.1f} GFLOP/s "
          f"({'bf16' if device.type == 'cuda' else 'fp32'})")

    def save(rows: list[dict]) -> None:
        """The figures so far to ``--json`` (a run cut short keeps its rows)."""
        if args.json:
            settings = {k: v for k, v in vars(args).items() if k != "save"}
            settings["data_dir"] = os.path.relpath(args.data_dir, REPO)
            Path(args.json).write_text(json.dumps(
                {"peak_gflops": peak, "device": name, "torch": torch.__version__,
                 "args": settings, "rows": rows}, indent=1))

    args.save = save
    from mtbert.core.errors import MtbertError
    modes = {"trainer": bench_rows, "fused": bench_rows, "techniques": bench_techniques,
             "layer": bench_layer}
    try:
        modes[args.mode](args, peak)
    except MtbertError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
