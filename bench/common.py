"""What the bench scripts share: the repository's root, where their results go, the data
folder and model arguments, a device synchronize and timer, the options of the searches'
benches, the machine and commit a figure comes from, and a meter of CPU seconds."""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import threading
import time
from pathlib import Path

#: the repository's root
REPO = Path(__file__).resolve().parents[1]
#: where a bench writes unless told (``--out``): a folder of its own in here
RESULTS = REPO / "bench_results"
#: the CS 224N data folder beside the repository, as TrainConfig's ``data_dir`` has it
DATA_DIR = REPO.parent / "shared" / "data"


def add_data_arguments(parser: argparse.ArgumentParser, *, model: bool = True) -> None:
    """``--data-dir`` (default :data:`DATA_DIR`) and, with ``model``, ``--model`` (default
    the packaged MiniLM)."""
    # deferred: this module imports nothing of mtbert at its top, so that gpu_evidence.py's
    # check can name a package that is missing (mtbert.core.config imports yaml)
    from mtbert.core.config import EMBEDDED_MODEL
    parser.add_argument("--data-dir", default=str(DATA_DIR))
    if model:
        parser.add_argument("--model", default=EMBEDDED_MODEL)


def synchronize(device) -> None:
    """Wait for the kernels queued on a CUDA ``device`` (a clock read after it times
    them); nothing on a CPU."""
    if device.type == "cuda":
        import torch
        torch.cuda.synchronize(device)


def seconds(device, run) -> float:
    """Wall seconds of ``run()``, the device's queued kernels waited for before and after."""
    synchronize(device)
    started = time.perf_counter()
    run()
    synchronize(device)
    return time.perf_counter() - started


def shared_options(p: argparse.ArgumentParser, args, known, unknown_is: str = "unknown"):
    """The options peers.py and search_efficiency.py share: ``args.method_list`` and
    ``args.seed_list`` from ``--methods`` and ``--seeds`` (comma separated); a method not in
    ``known``, none, a seed that is not an integer or a ``--gpus-per-trial`` outside 0-1 is
    the parser's error."""
    args.method_list = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = sorted(set(args.method_list) - set(known))
    if unknown or not args.method_list:
        p.error(f"--methods {args.methods}: {unknown_is} {unknown}; choose from {', '.join(known)}")
    try:
        args.seed_list = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        p.error(f"--seeds {args.seeds}: expected integers separated by commas")
    if not args.seed_list:
        p.error("--seeds: give at least one seed")
    if not 0 <= args.gpus_per_trial <= 1:
        p.error(f"--gpus-per-trial {args.gpus_per_trial}: expected a share of one GPU, 0 to 1")


def commit() -> str | None:
    """The commit of the code measured (None outside a git checkout)."""
    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, text=True,
                              capture_output=True)
    except OSError:
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def this_machine(gpu: bool = False) -> dict:
    """Where a run ran: CPUs, platform (and the GPU's name where trials used one)."""
    facts = {"cpu_count": os.cpu_count(), "platform": platform.platform(),
             "processor": platform.processor() or platform.machine()}
    if gpu:
        import torch
        facts["gpu"] = torch.cuda.get_device_name()
    return facts


class CpuMeter(threading.Thread):
    """CPU seconds (user + system) of process ``pid`` and every descendant it ever had, or
    (no ``pid``) of every process on the machine, sampled every ``period`` s on a thread;
    a process's last figure is kept once it ends, and one that ran before the meter
    started counts from then.  :meth:`stop` also gives the machine's busy CPU seconds and
    share over the same time (everyone's work, for context)."""

    ATTRS = ["pid", "create_time", "name", "cmdline", "cpu_times"]

    def __init__(self, pid: int | None = None, period: float = 0.5):
        import psutil  # deferred: the bench's extra

        super().__init__(daemon=True)
        self.psutil, self.period = psutil, period
        self.root = psutil.Process(pid) if pid else None
        self.first: dict[tuple[int, float], float] = {}  # (pid, create time) -> CPU s
        self.last: dict[tuple[int, float], float] = {}
        self.label: dict[tuple[int, float], str] = {}
        self._halt = threading.Event()
        self._machine = psutil.cpu_times()
        self.started = time.monotonic()
        self.wall_s = self.machine_busy_s = self.machine_busy = 0.0
        if self.root is None:
            self._sample(since_now=True)
        self.start()

    def _processes(self) -> list[dict]:
        if self.root is None:
            return [proc.info for proc in self.psutil.process_iter(self.ATTRS)]
        try:
            procs = [self.root] + self.root.children(recursive=True)
        except self.psutil.Error:  # the root has ended
            return []
        found = []
        for proc in procs:
            try:
                found.append(proc.as_dict(self.ATTRS))
            except self.psutil.Error:  # it ended between the listing and its reading
                continue
        return found

    def _sample(self, since_now: bool = False) -> None:
        for info in self._processes():
            if info.get("cpu_times") is None:
                continue
            key, cpu = (info["pid"], info["create_time"]), sum(info["cpu_times"][:2])
            self.first.setdefault(key, cpu if since_now else 0.0)
            self.last[key] = cpu
            self.label.setdefault(key, f"{info.get('name') or ''} "
                                       f"{' '.join(info.get('cmdline') or [])[:200]}".strip())

    def run(self) -> None:
        while not self._halt.wait(self.period):
            self._sample()

    def stop(self) -> float:
        """Stop sampling (after one last sample); the CPU seconds of the processes."""
        self._halt.set()
        self.join()
        self._sample()
        self.wall_s = time.monotonic() - self.started
        end, start = self.psutil.cpu_times(), self._machine
        busy = lambda t: t.user + t.system + getattr(t, "nice", 0.0)  # noqa: E731
        total = lambda t: busy(t) + t.idle + getattr(t, "iowait", 0.0)  # noqa: E731
        self.machine_busy_s = busy(end) - busy(start)
        self.machine_busy = self.machine_busy_s / max(total(end) - total(start), 1e-9)
        return self.cpu_s

    def used(self, key: tuple[int, float]) -> float:
        return self.last[key] - self.first[key]

    @property
    def cpu_s(self) -> float:
        return sum(map(self.used, self.last))
