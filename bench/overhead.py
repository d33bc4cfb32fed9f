"""What a search costs (docs/bench/overhead.md says how each figure is taken): where a
search's time goes, per trial (launch, startup, train, eval, ckpt, rest), per checkpoint
and on the machine, measured on one real search (the driver in-process, a local Ray,
MLflow in SQLite under ``--out``); or (``--summary``) what a finished search trained per
second, its MFU and how busy each GPU was (nvidia-smi's CSV: a sample is busy when any
kernel ran).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from bench.common import RESULTS, CpuMeter, add_data_arguments

#: Ray's own processes (by name or command line)
RAY_SYSTEM = ("raylet", "gcs_server", "dashboard", "log_monitor", "monitor.py",
              "runtime_env", "ray::IDLE", "default_worker", "ray::")


def trial_results(exp_dir: Path) -> dict[str, list[dict]]:
    """Every trial folder's ``result.json`` (one JSON object per report)."""
    out = {}
    for path in sorted(exp_dir.glob("*/result.json")):
        rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()
                if line.strip()]
        if rows:
            out[path.parent.name] = rows
    return out


def actor_tasks() -> dict[int, dict[str, float]]:
    """Per trial-actor worker pid: when the driver submitted the actor's creation, and
    when the actor's last task ended (Unix seconds), from Ray's task table."""
    import ray
    from ray.util.state import list_tasks
    # this script's own Ray (another search may run a second one on the same machine)
    tasks = list_tasks(address=ray.get_runtime_context().gcs_address, detail=True,
                       limit=10_000, raise_on_missing_output=False)
    by_actor: dict[str, dict] = {}
    for t in tasks:
        t = t if isinstance(t, dict) else t.__dict__
        if not t.get("actor_id") or "ImplicitFunc" not in (t.get("func_or_class_name") or ""):
            continue
        a = by_actor.setdefault(t["actor_id"], {"pid": None, "requested": None, "ready": None,
                                                "end": None})
        if t.get("type") == "ACTOR_CREATION_TASK":
            a["pid"] = t.get("worker_pid")
            a["requested"] = (t.get("creation_time_ms") or 0) / 1e3
            a["ready"] = (t.get("end_time_ms") or 0) / 1e3 or None
        end = (t.get("end_time_ms") or 0) / 1e3
        if end and (a["end"] is None or end > a["end"]):
            a["end"] = end
    return {a["pid"]: a for a in by_actor.values() if a["pid"]}


def trial_table(results: dict[str, list[dict]], actors: dict[int, dict]) -> list[dict]:
    rows = []
    for name, reports in results.items():
        last = reports[-1]
        actor = actors.get(int(last.get("pid", -1)))
        if actor is None or actor["requested"] is None:
            continue
        entered = last["time/entered_at"]
        end = max(actor["end"] or 0.0, float(last.get("timestamp", 0)))
        wall = end - actor["requested"]
        parts = {"launch": entered - actor["requested"], "startup": last["time/startup_s"],
                 "train": last["time/train_s"], "eval": last["time/eval_s"],
                 "ckpt": last["time/checkpoint_s"]}
        parts["rest"] = wall - sum(parts.values())
        checkpoints = sum(1 for r in reports if r.get("checkpoint_dir_name"))
        rows.append({"trial": name, "examples": last.get("examples_seen"),
                     "reports": len(reports), "checkpoints": checkpoints,
                     "checkpoint_bytes": last.get("checkpoint_bytes"),
                     "checkpoint_write_s": last.get("time/checkpoint_write_s"),
                     "report_s": last.get("time/report_s"),
                     "wall_s": wall, **{f"{k}_s": v for k, v in parts.items()},
                     "setup_s": last["time/setup_s"], "cpu_s": last.get("time/cpu_s"),
                     "pid": int(last["pid"]), "requested_at": actor["requested"],
                     "ended_at": end,
                     "share": (parts["train"] + parts["eval"]) / wall if wall > 0 else None})
    return rows


GPU_TARGET_EXAMPLES_PER_S = 5000


def checkpoint_figures(row: dict) -> dict:
    """Per-checkpoint figures of one trial row (None where the trainer did not report
    them: a trainer from before checkpoints were written in the background)."""
    written = row["checkpoints"] or 0
    earlier = max(row["reports"] - 1, 1)  # the reports the last report's figures cover
    per = lambda v, n: None if v is None or not n else v / n  # noqa: E731
    stall = row["ckpt_s"] / earlier
    gpu_train_s = (row["examples"] or 0) / GPU_TARGET_EXAMPLES_PER_S
    return {"checkpoints": written, "mib": per(row["checkpoint_bytes"], written * 2**20),
            "write_s": per(row["checkpoint_write_s"], written),
            "report_s": per(row["report_s"], earlier), "stall_s": stall,
            "stall_share_at_gpu_speed": (stall * written / gpu_train_s if gpu_train_s else None)}


def cpu_breakdown(meter: CpuMeter, cpus: int, trial_pids: set[int], start: float,
                  end: float) -> dict:
    groups = {"trials": 0.0, "driver": 0.0, "ray_system": 0.0, "other": 0.0}
    for key in meter.last:
        group = ("trials" if key[0] in trial_pids else "driver" if key[0] == os.getpid() else
                 "ray_system" if any(k in meter.label[key] for k in RAY_SYSTEM) else "other")
        groups[group] += meter.used(key)
    return {"cpus": cpus, "search_wall_s": end - start, "sampled_wall_s": meter.wall_s,
            "cpu_s": groups, "machine_busy_cpu_s": meter.machine_busy_s,
            # trial CPU over the search phase's capacity; the driver's loading, Ray's
            # start and the finalisation (ensemble) fall outside that window
            "trial_share_of_search_capacity": groups["trials"] / (cpus * (end - start)),
            "trial_share_of_run_capacity": groups["trials"] / (cpus * meter.wall_s)}


# ------------------------------------------------------------------ a finished search
def read_samples(path: Path) -> list[tuple[float, int, float]]:
    """(Unix seconds, GPU, percent) of each row of an nvidia-smi CSV (``2026/11/26
    10:00:05.123, 97 %, 1234 MiB``, UTC; the GPUs of a timestamp in index order); a row
    that does not parse is an error naming its line."""
    samples, seen = [], {}
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        cells = [c.strip() for c in line.split(",")]
        if not line.strip():
            continue
        try:
            at = datetime.strptime(cells[0], "%Y/%m/%d %H:%M:%S.%f").replace(
                tzinfo=timezone.utc).timestamp()
            percent = float(cells[1].removesuffix("%").strip())
        except (ValueError, IndexError):
            raise SystemExit(f"error: {path}, line {number}: expected 'YYYY/MM/DD HH:MM:SS.fff, "
                             f"NN %, ...' (nvidia-smi csv,noheader), got {line!r}") from None
        seen[cells[0]] = seen.get(cells[0], -1) + 1
        samples.append((at, seen[cells[0]], percent))
    return samples


def busy(samples: list[tuple[float, int, float]], start: float, end: float) -> dict:
    """One GPU's samples inside [start, end]: count, mean %, shares at >= 90 % and >= 50 %,
    and the longest run of samples under 50 % (how many, seconds from its first to its
    last, where it starts in the loop)."""
    inside = [(at, percent) for at, _, percent in samples if start <= at <= end]
    if not inside:
        return {"samples": 0}
    longest, run = [], []
    for sample in inside + [None]:
        if sample is not None and sample[1] < 50:
            run.append(sample[0])
            continue
        longest, run = max(longest, run, key=len), []
    values = [percent for _, percent in inside]
    return {"samples": len(values), "mean": sum(values) / len(values),
            "at_90": sum(v >= 90 for v in values) / len(values),
            "at_50": sum(v >= 50 for v in values) / len(values), "idle_samples": len(longest),
            "idle_run_s": longest[-1] - longest[0] if longest else 0.0,
            "idle_run_from_s": longest[0] - start if longest else None}


def search_cost(summary: dict, samples: list | None = None, tp: dict | None = None) -> dict:
    """A finished search's figures (module doc) from its summary.json, the nvidia-smi
    samples beside it and a step bench's JSON."""
    phases = summary.get("phases") or {}
    try:
        out = {"tune_started_at": float(phases["tune_started_at"]),
               "tune_ended_at": float(phases["tune_ended_at"]),
               "first_ready_s": phases.get("first_ready_s")}
    except (KeyError, TypeError, ValueError) as exc:
        raise SystemExit("error: expected a search's summary.json with "
                         f"phases.tune_started_at and tune_ended_at ({exc!r})") from None
    out["tune_s"] = float(phases.get("tune_s") or out["tune_ended_at"] - out["tune_started_at"])
    out["examples"] = sum(max(int(t.get("examples_seen") or 0),
                              int((t.get("best") or {}).get("examples_seen") or 0))
                          for t in summary.get("trials", []))
    out["per_s_tune"] = out["examples"] / out["tune_s"]
    if phases.get("total_s"):
        out["total_s"] = float(phases["total_s"])
        out["per_s_total"] = out["examples"] / out["total_s"]
    if tp is not None:  # its FLOPs per trained example and the GPU's peak
        rows = tp.get("processes") or [p for row in tp.get("rows", []) for engine in
                                       ("unfused", "fused") for p in row.get(engine, {}).get(
                                           "processes", [])]
        if not rows or not tp.get("peak_gflops"):
            raise SystemExit("error: expected python -m bench.throughput's JSON (its "
                             "processes' flops and examples, peak_gflops)")
        per_example = sum(p["flops"] for p in rows) / sum(p["examples"] for p in rows)
        for key in ("tune", "total"):
            if f"per_s_{key}" in out:
                out[f"mfu_{key}"] = out[f"per_s_{key}"] * per_example / tp["peak_gflops"] / 1e9
    if samples is not None:
        out["gpus"] = {gpu: busy([s for s in samples if s[1] == gpu], out["tune_started_at"],
                                 out["tune_ended_at"]) for gpu in sorted({s[1] for s in samples})}
    return out


def print_search_cost(r: dict) -> None:
    ready = r["first_ready_s"]
    print(f"Tune's loop: {r['tune_s']:.0f} s" + (
        f", the first trial ready {ready:.0f} s into it" if ready is not None else ""))
    mfu = lambda key: f", MFU {r[key]:.2%}" if key in r else ""  # noqa: E731
    print(f"examples trained: {r['examples']:,}; over Tune's loop {r['per_s_tune']:,.0f} ex/s"
          f"{mfu('mfu_tune')}" + (f"; over the whole wall ({r['total_s']:.0f} s) "
                                  f"{r['per_s_total']:,.0f} ex/s{mfu('mfu_total')}"
                                  if "total_s" in r else ""))
    for gpu, b in r.get("gpus", {}).items():
        if not b["samples"]:
            print(f"GPU {gpu}: no sample inside Tune's loop (clocks in UTC?)")
            continue
        idle = (f"longest stretch under 50 %: {b['idle_samples']} samples over "
                f"{b['idle_run_s']:.0f} s, from {b['idle_run_from_s']:.0f} s into the loop"
                if b["idle_samples"] else "no sample under 50 %")
        print(f"GPU {gpu}: {b['samples']} samples, mean {b['mean']:.1f} %, {b['at_90']:.0%} of "
              f"them at >= 90 %, {b['at_50']:.0%} at >= 50 %; {idle}")


def finished_search(args) -> int:
    def read(path: Path, what: str) -> dict:
        try:
            return json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise SystemExit(f"error: {path}: expected {what} ({exc})") from None

    r = search_cost(read(Path(args.summary), "a search's summary.json"),
                    read_samples(Path(args.gpu_util)) if args.gpu_util else None,
                    read(Path(args.throughput), "a step bench's JSON") if args.throughput
                    else None)
    print_search_cost(r)
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=1), encoding="utf-8")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--summary", help="a finished search's summary.json: its figures alone")
    p.add_argument("--gpu-util", help="--summary: nvidia-smi's CSV beside the search")
    p.add_argument("--throughput", help="--summary: python -m bench.throughput --json output "
                   "on the same GPU (gives the MFU)")
    p.add_argument("--json", help="--summary: also write the figures here")
    p.add_argument("--space", default="smart")
    p.add_argument("--budget", default="small")
    p.add_argument("--num-samples", type=int)
    add_data_arguments(p)
    p.add_argument("--out", default=str(RESULTS / "overhead"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--report-only", action="store_true",
                   help="run nothing: the figures again from OUT/overhead.json's run")
    args = p.parse_args(argv)
    if args.summary:
        return finished_search(args)
    out = Path(args.out).resolve()
    if args.report_only:
        return write_report(out, json.loads((out / "overhead.json").read_text(encoding="utf-8")))

    import ray

    from mtbert.tune import cli
    from mtbert.tune.infra import cluster

    out.mkdir(parents=True, exist_ok=True)
    experiment = f"overhead-{args.space}-{args.budget}-{time.strftime('%Y%m%d-%H%M%S')}"
    driver_args = ["--space", args.space, "--budget", args.budget, "--model", args.model,
                   "--data-dir", args.data_dir, "--storage-path", str(out / "ray_results"),
                   "--experiment", experiment, "--seed", str(args.seed),
                   "--mlflow-uri", f"sqlite:///{out / 'mlflow.db'}"]
    if args.num_samples:
        driver_args += ["--num-samples", str(args.num_samples)]
    cluster.quiet_environment()
    meter = CpuMeter()
    started = time.time()
    cluster.start_local_ray()
    try:
        cpus = int(ray.cluster_resources().get("CPU", 0))
        rc = cli.main(driver_args)
        actors = actor_tasks() if rc == 0 else {}
    finally:
        meter.stop()
        ray.shutdown()
    if rc != 0:
        print(f"error: the search exited {rc}", file=sys.stderr)
        return rc
    return write_report(out, {
        "command": "python -m bench.overhead " + " ".join(argv or sys.argv[1:]),
        "experiment_dir": str(out / "ray_results" / experiment),
        "command_wall_s": time.time() - started, "actors": actors}, (meter, cpus))


def write_report(out: Path, run: dict, sampled: tuple[CpuMeter, int] | None = None) -> int:
    """A run's figures (its experiment folder, the trial actors' times Ray gave and, from
    ``sampled`` (the meter, the CPUs), the machine's CPU) into ``OUT/overhead.json``;
    ``--report-only`` computes them again from the ``overhead.json`` kept."""
    actors = {int(pid): a for pid, a in run["actors"].items()}
    rows = trial_table(trial_results(Path(run["experiment_dir"])), actors)
    if not rows:
        print("error: no trial timings found (Ray task table empty?)", file=sys.stderr)
        return 1
    if sampled is not None:
        run["cpu"] = cpu_breakdown(*sampled, {r["pid"] for r in rows},
                                   min(r["requested_at"] for r in rows),
                                   max(r["ended_at"] for r in rows))
    for r in rows:
        r["per_checkpoint"] = checkpoint_figures(r)
    cols = ("wall_s", "launch_s", "startup_s", "train_s", "eval_s", "ckpt_s", "rest_s")
    total = {k: sum(r[k] for r in rows) for k in cols}
    summary = {
        **run, "trials": rows, "totals": total,
        "share_train_eval": (total["train_s"] + total["eval_s"]) / total["wall_s"],
        "share_per_trial_median": statistics.median(r["share"] for r in rows),
        "share_per_trial_min": min(r["share"] for r in rows)}
    (out / "overhead.json").write_text(json.dumps(summary, indent=2), encoding="utf-8")
    cpu = run.get("cpu")
    print(f"{len(rows)} trials: (train + eval) / wall {summary['share_train_eval']:.1%} "
          f"(median trial {summary['share_per_trial_median']:.1%}, min "
          f"{summary['share_per_trial_min']:.1%}; target >= 90%)" + (
              f"; trials' CPU over the search phase {cpu['trial_share_of_search_capacity']:.1%}"
              " of the machine's" if cpu else ""))
    print(f"[bench] wrote {out / 'overhead.json'} (per trial, per checkpoint, the machine's CPU)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
