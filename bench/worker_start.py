"""Where a fresh trial worker's start goes: ``python -m bench.worker_start``.

A search's first trials wait for their Ray workers to start (20 s of idle GPU at the
start of Tune's loop in the full search on one H200, docs/bench/step_graphs.md).  This
starts ``--processes`` Python processes at once, as Tune starts a search's first trials,
and each does what a fresh trial worker does before its first step, in the worker's
order, timing each stage:

* ``python``  -- the interpreter up (process spawned -> the script's first line);
* ``ray``     -- ``import ray`` (a Ray worker's own start-up);
* ``tune``    -- Ray Tune's function trainable (the actor's class);
* ``trainable`` -- ``mtbert.tune.trial.trainable`` (unpickling the trial function);
* ``data``    -- ``mtbert.data`` (unpickling the object store's data: torch);
* ``trainer`` -- ``mtbert.step.trainer`` and ``transformers.modeling_utils`` (the model class);
* ``device``  -- ``--device cuda``: the CUDA context (a first tensor on the GPU);
* ``model``   -- ``--model``: the encoder and heads built from the folder, on the device.

With ``-X importtime`` (Python's own import profiler) each process also reports its
import seconds by top-level package (self time: a package's own module bodies).  Printed:
a row of stage seconds per process (``ready``: spawned -> all stages done) and the
slowest process's import seconds by package.

    python -m bench.worker_start --processes 8 --device cuda --model <model>
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from bench.common import REPO

STAGES = ("python", "ray", "tune", "trainable", "data", "trainer", "device", "model")

#: run in each process (argv: spawn time, device, model folder or ""); prints one JSON line
WORKER = r'''
import json, sys, time
marks = {"python": time.time() - float(sys.argv[1])}
def stage(name, started):
    marks[name] = time.time() - started
t = time.time(); import ray; stage("ray", t)
t = time.time(); import ray.tune.trainable.function_trainable; stage("tune", t)
t = time.time(); import mtbert.tune.trial.trainable; stage("trainable", t)
t = time.time(); import mtbert.data; stage("data", t)
t = time.time(); import mtbert.step.trainer, transformers.modeling_utils; stage("trainer", t)
import torch
device = torch.device(sys.argv[2])
if device.type == "cuda":
    t = time.time(); torch.zeros(1, device=device); torch.cuda.synchronize(); stage("device", t)
if sys.argv[3]:
    from mtbert.core.config import TrainConfig
    from mtbert.model.model import MultitaskModel
    t = time.time()
    MultitaskModel.from_config(TrainConfig(model=sys.argv[3])).to(device)
    if device.type == "cuda":
        torch.cuda.synchronize()
    stage("model", t)
marks["ready"] = time.time() - float(sys.argv[1])
print("WORKER_START " + json.dumps(marks), flush=True)
'''


def import_seconds_by_package(importtime_text: str) -> dict[str, float]:
    """Self seconds per top-level package from ``-X importtime`` output (its lines read
    ``import time: SELF_US | CUMULATIVE_US | NAME``; the header line and other output are
    skipped)."""
    totals: Counter = Counter()
    for line in importtime_text.splitlines():
        if not line.startswith("import time:"):
            continue
        cells = line[len("import time:"):].split("|")
        if len(cells) != 3 or not cells[0].strip().isdigit():
            continue  # the header: "self [us] | cumulative | imported package"
        totals[cells[2].strip().split(".")[0]] += int(cells[0]) / 1e6
    return dict(totals.most_common())


def start_processes(count: int, device: str, model: str) -> list[dict]:
    """``count`` worker-like processes started together; each one's stage seconds, its
    seconds from spawn to ready and its import seconds by package."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
        "TOKENIZERS_PARALLELISM": "false", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    running = []
    with tempfile.TemporaryDirectory(prefix="mtbert-worker-start-") as folder:
        for index in range(count):
            # files, not pipes: -X importtime writes ~300 kB to stderr, and a full pipe
            # would stall a process until this one reads it
            out, err = (open(Path(folder) / f"{index}.{name}", "w+", encoding="utf-8")
                        for name in ("out", "err"))
            running.append((out, err, subprocess.Popen(
                [sys.executable, "-X", "importtime", "-c", WORKER, repr(time.time()), device,
                 model], cwd=REPO, env=env, stdout=out, stderr=err, text=True)))
        for _, _, process in running:  # all of them, so that none outlives a failed one
            process.wait()
        try:
            return [_finished(process.returncode, out, err) for out, err, process in running]
        finally:
            for out, err, _ in running:
                out.close()
                err.close()


def _finished(returncode: int, out, err) -> dict:
    out.seek(0)
    err.seek(0)
    stdout, stderr = out.read(), err.read()
    line = next((x for x in stdout.splitlines() if x.startswith("WORKER_START ")), None)
    if returncode != 0 or line is None:
        raise SystemExit(f"error: a worker-like process failed (exit {returncode}):\n"
                         f"{stderr[-2000:]}")
    stages = json.loads(line.split(" ", 1)[1])
    return {"stages": stages, "ready_s": stages.pop("ready"),
            "packages": import_seconds_by_package(stderr)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, default=1,
                        help="processes started at once (a search's trials at once)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--model", default="", help="build this encoder folder too")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    if args.processes < 1:
        parser.error("--processes must be at least 1")
    results = start_processes(args.processes, args.device, args.model)
    print(f"{args.processes} processes started at once, device {args.device}"
          f"{', model ' + args.model if args.model else ''}: the last ready after "
          f"{max(r['ready_s'] for r in results):.2f} s")
    shown = [s for s in STAGES if any(s in r["stages"] for r in results)]
    print(" ".join(f"{s:>9}" for s in (*shown, "ready")))
    for r in results:
        print(" ".join(f"{r['stages'].get(s, 0.0):9.2f}" for s in shown), f"{r['ready_s']:9.2f}")
    slowest = max(results, key=lambda r: r["ready_s"])
    top = list(slowest["packages"].items())[:10]
    print(f"imports of the slowest process, self seconds by package (all: "
          f"{sum(slowest['packages'].values()):.2f} s): "
          + ", ".join(f"{name} {seconds:.2f}" for name, seconds in top))
    if args.json:
        args.json.write_text(json.dumps({"processes": args.processes, "device": args.device,
                                         "model": args.model, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
