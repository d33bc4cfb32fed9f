"""Where a search's time goes: per-trial start-up vs training and evaluation, and the
share of the machine's CPU time spent inside trials.

    python -m bench.overhead [--space smart] [--budget small] [--num-samples N]
                             [--data-dir ../shared/data] [--out bench_results/overhead]

Runs one real search (``tune_driver`` in-process, on a local Ray started here with its
dashboard on 127.0.0.1, MLflow in a SQLite file under ``--out``) while a thread samples
every process's CPU time (psutil, every ``--sample-s``). Afterwards, per trial:

* ``launch``  -- the driver asks Ray for the trial's actor -> the trial function is
  entered (worker process start, actor construction, data fetched from the object
  store by ``tune.with_parameters``); from Ray's task table (``ray.util.state``);
* ``startup`` -- function entry -> Trainer ready (imports, model load, optimizer,
  batchers; ``time/startup_s`` reported by the trainable);
* ``train``, ``eval`` -- time inside training steps / validation scoring (the
  trainer's ``time/train_s``, ``time/eval_s``);
* ``ckpt``    -- what checkpoints and reports cost the training thread (``time/checkpoint_s``:
  the snapshot to host memory and any wait for the previous checkpoint; the checkpoint
  is written and handed to ``tune.report``, where Ray copies it, on a background thread);
* ``rest``    -- the remainder up to the end of the actor's last task (stop, teardown;
  it holds the wait for the last checkpoint, which nothing can overlap).

Per checkpoint (second table): how many each trial wrote, MiB written per checkpoint
(``checkpoint_bytes``), seconds writing one (``time/checkpoint_write_s``, background),
seconds per report (``time/report_s``: Ray's copy to storage and the driver's round trip,
background) and the training thread's stall per report; and that stall as a share of
the trial's training time at the GPU target speed (5,000 examples/s): a
projection from these CPU figures, not a GPU measurement.  Reports count the
checkpoints before them, so the last checkpoint's report and stall are not in these
figures (its write is).

Share = (train + eval) / wall per trial (target >= 90 %), and over all trials. Machine
CPU: the CPU seconds of the trial actors, of Ray's own processes, of the driver and of
anything else, against ``cpus x wall`` of the search phase (first actor requested ->
last actor done); on one machine this is the cluster. Writes ``overhead.json`` and
prints the tables.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

from bench.common import RESULTS, add_data_arguments


RAY_SYSTEM = ("raylet", "gcs_server", "dashboard", "log_monitor", "monitor.py",
              "runtime_env", "ray::IDLE", "default_worker", "ray::")


class CpuSampler(threading.Thread):
    """Last seen CPU seconds (user + system) of every process, every ``period`` s."""

    def __init__(self, period: float):
        super().__init__(daemon=True)
        self.period = period
        self.first: dict[int, float] = {}
        self.last: dict[int, float] = {}
        self.label: dict[int, str] = {}
        self._halt = threading.Event()
        self.started_at = self.stopped_at = 0.0
        self.system_busy = 0.0  # machine-wide non-idle CPU seconds over the sampling

    def _sample(self) -> None:
        import psutil
        for proc in psutil.process_iter(["pid", "name", "cmdline", "cpu_times"]):
            info = proc.info
            times = info.get("cpu_times")
            if times is None:
                continue
            pid, cpu = info["pid"], times.user + times.system
            self.first.setdefault(pid, cpu)
            self.last[pid] = cpu
            if pid not in self.label:
                cmd = " ".join(info.get("cmdline") or [])[:200]
                self.label[pid] = f"{info.get('name') or ''} {cmd}".strip()

    def run(self) -> None:
        import psutil
        self.started_at = time.time()
        start = psutil.cpu_times()
        while not self._halt.is_set():
            self._sample()
            self._halt.wait(self.period)
        self._sample()
        end = psutil.cpu_times()
        self.stopped_at = time.time()
        busy = lambda t: sum(t) - t.idle - getattr(t, "iowait", 0.0)  # noqa: E731
        self.system_busy = busy(end) - busy(start)

    def stop(self) -> None:
        self._halt.set()
        self.join()

    def used(self, pid: int) -> float:
        return self.last.get(pid, 0.0) - self.first.get(pid, 0.0)


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


def print_checkpoint_table(rows: list[dict]) -> None:
    print("\nper checkpoint (MiB written, seconds writing [background], per report "
          "[background: Ray's copy + driver], training-thread stall per report; share = "
          "stall x checkpoints / training time at 5,000 ex/s, projected from these figures):")
    cols = ("checkpoints", "mib", "write_s", "report_s", "stall_s", "stall_share_at_gpu_speed")
    names = ("checkpoints", "MiB", "write s", "report s", "stall s", "stall/gpu-train")
    print(f"{'trial':<28}" + "".join(f"{c:>16}" for c in names))
    fmt = lambda v: f"{'-':>16}" if v is None else f"{v:>16.3f}"  # noqa: E731
    for r in rows:
        f = r["per_checkpoint"]
        print(f"{r['trial'][:27]:<28}{f['checkpoints']:>16}" + "".join(fmt(f[c]) for c in cols[1:]))


def cpu_breakdown(sampler: CpuSampler, trial_pids: set[int], start: float, end: float,
                  cpus: int) -> dict:
    groups = {"trials": 0.0, "driver": 0.0, "ray_system": 0.0, "other": 0.0}
    for pid in sampler.last:
        used = sampler.used(pid)
        if pid in trial_pids:
            groups["trials"] += used
        elif pid == os.getpid():
            groups["driver"] += used
        elif any(k in sampler.label.get(pid, "") for k in RAY_SYSTEM):
            groups["ray_system"] += used
        else:
            groups["other"] += used
    sampled = sampler.stopped_at - sampler.started_at
    return {"cpus": cpus, "search_wall_s": end - start, "sampled_wall_s": sampled,
            "cpu_s": groups, "machine_busy_cpu_s": sampler.system_busy,
            # trial CPU over the search phase's capacity; the driver's loading, Ray's
            # start and the finalisation (ensemble) fall outside that window
            "trial_share_of_search_capacity": groups["trials"] / (cpus * (end - start)),
            "trial_share_of_run_capacity": groups["trials"] / (cpus * sampled)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--space", default="smart")
    p.add_argument("--budget", default="small")
    p.add_argument("--num-samples", type=int)
    add_data_arguments(p)
    p.add_argument("--out", default=str(RESULTS / "overhead"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sample-s", type=float, default=0.5, help="CPU sampling period")
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=[],
                   help="further tune_driver arguments")
    args = p.parse_args(argv)

    import ray

    from mtbert.tune import cli
    from mtbert.tune.infra import cluster

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    experiment = f"overhead-{args.space}-{args.budget}-{time.strftime('%Y%m%d-%H%M%S')}"
    driver_args = ["--space", args.space, "--budget", args.budget, "--model", args.model,
                   "--data-dir", args.data_dir, "--storage-path", str(out / "ray_results"),
                   "--experiment", experiment, "--seed", str(args.seed),
                   "--mlflow-uri", f"sqlite:///{out / 'mlflow.db'}", *args.extra]
    if args.num_samples:
        driver_args += ["--num-samples", str(args.num_samples)]
    cluster.quiet_environment()
    sampler = CpuSampler(args.sample_s)
    sampler.start()
    started = time.time()
    cluster.start_local_ray()
    try:
        cpus = int(ray.cluster_resources().get("CPU", 0))
        rc = cli.main(driver_args)
        actors = actor_tasks() if rc == 0 else {}
    finally:
        sampler.stop()
        ray.shutdown()
    command_wall = time.time() - started
    if rc != 0:
        print(f"error: the search exited {rc}", file=sys.stderr)
        return rc
    exp_dir = out / "ray_results" / experiment
    rows = trial_table(trial_results(exp_dir), actors)
    if not rows:
        print("error: no trial timings found (Ray task table empty?)", file=sys.stderr)
        return 1
    for r in rows:
        r["per_checkpoint"] = checkpoint_figures(r)
    start = min(r["requested_at"] for r in rows)
    end = max(r["ended_at"] for r in rows)
    cpu = cpu_breakdown(sampler, {r["pid"] for r in rows}, start, end, cpus)
    total = {k: sum(r[k] for r in rows) for k in
             ("wall_s", "launch_s", "startup_s", "train_s", "eval_s", "ckpt_s", "rest_s")}
    summary = {
        "command": "python -m bench.overhead " + " ".join(argv or sys.argv[1:]),
        "experiment_dir": str(exp_dir), "command_wall_s": command_wall, "trials": rows,
        "totals": total,
        "share_train_eval": (total["train_s"] + total["eval_s"]) / total["wall_s"],
        "share_per_trial_median": statistics.median(r["share"] for r in rows),
        "share_per_trial_min": min(r["share"] for r in rows), "cpu": cpu}
    (out / "overhead.json").write_text(json.dumps(summary, indent=2), encoding="utf-8")

    print(f"\nper trial (seconds; share = (train + eval) / wall), {len(rows)} trials:")
    cols = ("wall_s", "launch_s", "startup_s", "train_s", "eval_s", "ckpt_s", "rest_s")
    print(f"{'trial':<28}{'examples':>9}" + "".join(f"{c[:-2]:>9}" for c in cols)
          + f"{'share':>8}")
    for r in rows + [{"trial": "all trials", "examples": sum(r["examples"] for r in rows),
                      **total, "share": summary["share_train_eval"]}]:
        print(f"{r['trial'][:27]:<28}{int(r['examples']):>9}"
              + "".join(f"{r[c]:>9.1f}" for c in cols) + f"{100 * r['share']:>7.1f}%")
    print(f"median trial share {100 * summary['share_per_trial_median']:.1f}% "
          f"(min {100 * summary['share_per_trial_min']:.1f}%; target >= 90%)")
    print_checkpoint_table(rows)
    g = cpu["cpu_s"]
    cap = cpus * cpu["search_wall_s"]
    print(f"\nmachine CPU over the search phase ({cpu['search_wall_s']:.0f} s x {cpus} CPUs "
          f"= {cap:.0f} CPU-s): trials {g['trials']:.0f} "
          f"({100 * cpu['trial_share_of_search_capacity']:.1f}%), driver {g['driver']:.0f}, "
          f"Ray processes {g['ray_system']:.0f}, other {g['other']:.0f}; whole command "
          f"{command_wall:.0f} s, trials {100 * cpu['trial_share_of_run_capacity']:.1f}% of "
          f"its {cpus * cpu['sampled_wall_s']:.0f} CPU-s")
    print(f"[bench] wrote {out / 'overhead.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
