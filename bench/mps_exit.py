"""Does a CUDA MPS client that leaves fault the clients still replaying CUDA graphs?
``python -m bench.mps_exit --device cuda``.

In the full search on one H200 (docs/bench/step_graphs.md, 2026-11-27) the trials still
training died together 0.17 s after another trial's worker process exited cleanly: the
MPS server's log says one of them "encountered a fatal GPU error" and it tore down every
client on the GPU.  This separates the exit from the rest of a search (Ray, the trainer,
reused workers): under an MPS daemon of its own (``mtbert.tune.infra.mps``, its logs kept),
``--survivors`` processes each replay one captured training step (a transformer layer's
forward, backward and a capturable AdamW step under bf16 autocast) for as long as the run
lasts, while ``--leavers`` processes, one after another, capture the same step, replay it
``--replays`` times and leave as ``--mode`` says:

* ``clean``   -- synchronise, then exit with the graph and its memory still held by a
  module-level reference, so that they go in the interpreter's and the CUDA context's
  teardown (what a trial's worker does since the worker-exit fix: its kept step,
  ``mtbert.run.graph_reuse``, and the parked thread's trainer are never freed before);
* ``release`` -- synchronise, reset the graph, free the cached memory, then exit;
* ``kill``    -- SIGKILL while replaying (the fault known from 2026-11-27: the control).

Printed: the leavers that left, each survivor's replays and error (if it died), and the
fatal GPU errors in the MPS server's log.  ``--no-mps`` runs the same without a daemon.

    python -m bench.mps_exit --device cuda --mode clean --survivors 3 --leavers 8
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import REPO

MODES = ("clean", "release", "kill")
#: a leaver's graph in ``clean`` mode: held to the process's end, as a worker's kept step
KEPT: list = []
#: the MPS server's line for a client's fatal GPU error (its server.log)
FATAL = re.compile(r"^\[(?P<at>[\d-]+ [\d:.]+) Server +\d+\] Client \{PID: (?P<pid>\d+), "
                   r"Context: \d+\} encountered a fatal GPU error")


def fatal_gpu_errors(server_log: str) -> list[tuple[str, int]]:
    """(time, client PID) of each fatal GPU error an MPS server's log records."""
    return [(m["at"], int(m["pid"])) for m in map(FATAL.match, server_log.splitlines()) if m]


def captured_step():
    """One training step of a transformer layer captured as a CUDA graph (after warm-up
    on a side stream, as torch.cuda.graphs' documentation has it), and what it uses."""
    import torch
    model = torch.nn.TransformerEncoderLayer(384, 6, 1536, batch_first=True).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, capturable=True)
    batch = torch.randn(32, 64, 384, device="cuda")

    def step():
        optimizer.zero_grad(set_to_none=False)  # captured too: a replay's own gradients
        with torch.autocast("cuda", torch.bfloat16, cache_enabled=False):
            loss = model(batch).float().square().mean()
        loss.backward()
        optimizer.step()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph, (model, optimizer, batch)  # the tensors the graph reads and writes


class StandInStep:
    """``--stand-in``: a "graph" replayed on the CPU, so that this script's processes, their
    hand-shakes and its table can be checked where no GPU is (tests/test_bench_accounting)."""

    def __init__(self):
        import torch
        self.state = torch.ones(64, 64)

    def replay(self) -> None:
        self.state.mul_(1.0)

    def reset(self) -> None:
        self.state = None


def run_role(role: str, mode: str, replays: int, stop_file: Path, stand_in: bool) -> int:
    """A child process: ``survivor`` replays until ``stop_file`` appears; ``leaver``
    replays ``replays`` times and leaves as ``mode`` says.  Prints one JSON line."""
    import torch
    graph, uses = (StandInStep(), ()) if stand_in else captured_step()
    synchronize = (lambda: None) if stand_in else torch.cuda.synchronize
    synchronize()
    print("READY", flush=True)
    done, error = 0, None
    try:
        while (role == "survivor" and not stop_file.exists()) or (
                role == "leaver" and (mode == "kill" or done < replays)):
            graph.replay()
            done += 1
            if done % 50 == 0:
                synchronize()
        synchronize()
    except RuntimeError as exc:  # the fault reaches a survivor as a CUDA error (or SIGSEGV)
        error = str(exc).splitlines()[0]
    if role == "leaver" and mode == "release":
        graph.reset()
        del graph, uses
        synchronize()
        torch.cuda.empty_cache()  # a no-op where CUDA was never used
    else:
        KEPT.append((graph, uses))
    print("RESULT " + json.dumps({"role": role, "replays": done, "error": error}), flush=True)
    return 1 if error else 0


def spawn(role: str, args, stop_file: Path, env: dict[str, str]) -> subprocess.Popen:
    command = [sys.executable, "-m", "bench.mps_exit", "--role", role, "--mode",
               args.mode, "--replays", str(args.replays), "--stop-file", str(stop_file),
               *(["--stand-in"] if args.stand_in else [])]
    return subprocess.Popen(command, cwd=REPO, env={**os.environ, **env}, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def wait_ready(process: subprocess.Popen, timeout_s: float = 120) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            return False
        if line.startswith("READY"):
            return True
    return False


def finished(process: subprocess.Popen) -> dict:
    """The child's RESULT line (or how it ended without one)."""
    out, _ = process.communicate(timeout=120)
    for line in out.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    return {"replays": None, "error": f"exit status {process.returncode}, no result: "
            + " | ".join(out.strip().splitlines()[-2:])}


def run_trial(args, env: dict[str, str], folder: Path) -> dict:
    """Survivors up, leavers one after another, survivors stopped: what each did."""
    stop_file = folder / "stop"
    survivors = [spawn("survivor", args, stop_file, env) for _ in range(args.survivors)]
    if not all(wait_ready(p) for p in survivors):
        raise SystemExit("error: a survivor did not capture its step")
    left = 0
    for _ in range(args.leavers):
        leaver = spawn("leaver", args, stop_file, env)
        if not wait_ready(leaver):
            break
        if args.mode == "kill":
            time.sleep(1.0)
            leaver.send_signal(signal.SIGKILL)
        leaver.communicate(timeout=120)
        left += 1
        time.sleep(args.pause_s)
        if any(p.poll() is not None for p in survivors):
            break  # a survivor died: what follows would not tell more
    stop_file.write_text("stop")
    return {"leavers_left": left, "survivors": [finished(p) for p in survivors]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", help="cuda (the only device this measures)")
    p.add_argument("--mode", choices=MODES, default="clean", help="how a leaver leaves")
    p.add_argument("--survivors", type=int, default=3, help="clients replaying throughout")
    p.add_argument("--leavers", type=int, default=8, help="clients that come and leave")
    p.add_argument("--replays", type=int, default=300, help="a leaver's replays")
    p.add_argument("--pause-s", type=float, default=1.0, help="seconds after each leaver")
    p.add_argument("--no-mps", action="store_true", help="the same without an MPS daemon")
    p.add_argument("--role", choices=("survivor", "leaver"), help=argparse.SUPPRESS)
    p.add_argument("--stop-file", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--stand-in", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.role:
        return run_role(args.role, args.mode, args.replays, args.stop_file, args.stand_in)
    import torch
    if not args.stand_in and (args.device != "cuda" or not torch.cuda.is_available()):
        print("error: bench/mps_exit.py needs a CUDA GPU (--device cuda)", file=sys.stderr)
        return 2
    from mtbert.tune.infra.mps import cuda_mps
    mps_choice = "off" if args.no_mps or args.stand_in else "on"
    with tempfile.TemporaryDirectory(prefix="mtbert-mps-exit-") as folder:
        logs = Path(folder) / "mps_log"
        with cuda_mps(mps_choice, None, 0.5, True, keep_logs=logs) as mps:
            print(f"MPS {mps.note}; mode {args.mode}", flush=True)
            result = run_trial(args, mps.worker_env, Path(folder))
        server = logs / "server.log"
        fatal = fatal_gpu_errors(server.read_text()) if server.exists() else []
    for index, survivor in enumerate(result["survivors"]):
        print(f"survivor {index}: {survivor['replays']} replays, error: {survivor['error']}")
    failed = sum(1 for s in result["survivors"] if s["error"])
    print(f"mode {args.mode}: {result['leavers_left']} of {args.leavers} leavers left; "
          f"{failed} of {args.survivors} survivors failed; fatal GPU errors in the MPS "
          f"server's log: {len(fatal)} {fatal}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
