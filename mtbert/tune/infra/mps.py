"""CUDA MPS for trials that share a GPU (``--mps``).

Trials packed on one GPU are separate processes; without NVIDIA's Multi-Process Service
the GPU time-slices between their contexts, with it their kernels run side by side (one
H200, 8 graphed trials: 10,508 examples/s without, 19,167 with; cluster/README.md).
When the driver starts Ray on this machine, ``--mps auto`` (the default) starts an MPS
control daemon of its own for the search: its pipe and log folders in a new temporary
folder, named to Ray's workers through the job's ``runtime_env`` (so only the search's
trials join it; no GPU setting changes, the compute mode stays as it is), and stops it
once Ray is shut down, keeping its logs (``control.log``, ``server.log``: each client's
connection and exit, and what ended the MPS server if it died) in the experiment's
``mps_log/`` folder (one subfolder per run, named by its UTC start).  A daemon already
named by ``CUDA_MPS_PIPE_DIRECTORY`` is used as it is.  ``auto`` leaves MPS off where it
cannot help or cannot start (no GPU here, one trial per GPU, a cluster's nodes:
``--address``, no ``nvidia-cuda-mps-control``) and says why; ``on`` makes each of those
an error; ``off`` never starts one.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from mtbert.core.errors import ConfigError

CONTROL = "nvidia-cuda-mps-control"
PIPE_ENV, LOG_ENV = "CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY"
#: the experiment's folder of the daemon's logs, one subfolder per run of the search (UTC)
MPS_LOG_FOLDER = "mps_log"
CHOICES = ("auto", "on", "off")
#: seconds the control commands may take (``-d`` forks and returns at once)
CONTROL_TIMEOUT_S = 30.0
#: a CUDA client of the new daemon, run once before the trials: a daemon that starts but
#: cannot serve (a container without the shared IPC namespace, a server that fails)
#: would fail every trial's CUDA start instead
PROBE = [sys.executable, "-c", "import torch; torch.ones(1, device='cuda').add_(1); "
         "torch.cuda.synchronize()"]
PROBE_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class MpsUse:
    """What the search does about MPS: ``worker_env`` for Ray's workers (empty: nothing to
    add) and ``note``, one line for the console and the summary."""
    note: str
    worker_env: dict[str, str] = field(default_factory=dict)


def local_gpu(address: str | None) -> bool:
    """Whether trials started on this machine (no ``--address``) would find a CUDA GPU."""
    if address:
        return False
    import torch
    return torch.cuda.is_available()


def mps_reason_off(choice: str, address: str | None, gpus_per_trial: float | None,
                   have_gpu: bool, control: str | None) -> str | None:
    """Why no daemon is started for this search (None: start one).  ConfigError (naming
    ``--mps``) for ``on`` where one cannot be."""
    if choice == "off":
        return "off: --mps off"
    reasons = [(address is not None, "the trials run on a Ray cluster's nodes (--address): "
                "start MPS on each GPU node, cluster/README.md"),
               (not have_gpu, "no CUDA GPU on this machine"),
               (gpus_per_trial == 0, "the trials train on CPUs (--gpus-per-trial 0)"),
               (control is None, f"{CONTROL} is not on PATH")]
    if choice == "auto":  # asked for, a daemon is started even for whole GPUs
        reasons.append((gpus_per_trial is not None and gpus_per_trial >= 1,
                        "each trial has whole GPUs (--gpus-per-trial)"))
    for applies, why in reasons:
        if applies:
            if choice == "on":
                raise ConfigError(f"--mps on: {why}")
            return f"off: {why}"
    return None


@contextlib.contextmanager
def cuda_mps(choice: str, address: str | None, gpus_per_trial: float | None,
             have_gpu: bool, keep_logs: Path | None = None) -> Iterator[MpsUse]:
    """MPS for one search (see the module's text): yields what Ray's workers need and the
    note; a daemon started here is stopped when the block ends, however it ends, and its
    log files are copied to ``keep_logs`` (a folder made for them)."""
    if os.environ.get(PIPE_ENV) and choice != "off":
        yield MpsUse(f"on: the daemon at {PIPE_ENV}={os.environ[PIPE_ENV]} (not started here)")
        return
    control = shutil.which(CONTROL)
    reason = mps_reason_off(choice, address, gpus_per_trial, have_gpu, control)
    if reason is not None:
        yield MpsUse(reason)
        return
    with tempfile.TemporaryDirectory(prefix="mtbert-mps-", ignore_cleanup_errors=True) as folder:
        env = {PIPE_ENV: os.path.join(folder, "pipe"), LOG_ENV: os.path.join(folder, "log")}
        for path in env.values():
            os.mkdir(path)
        failed = _control(control, ["-d"], env)
        if failed is not None:
            failed = f"{CONTROL} -d failed: {failed}"
        else:
            served = _run(PROBE, env, PROBE_TIMEOUT_S)
            if served is not None:
                _control(control, [], env, stdin="quit\n")
                failed = f"a CUDA process could not run under the new daemon: {served}"
        if failed is not None:
            if choice == "on":
                raise ConfigError(f"--mps on: {failed}")
            yield MpsUse(f"off: {failed}")
            return
        try:
            yield MpsUse(f"on: a daemon of this search's own ({PIPE_ENV}={env[PIPE_ENV]})", env)
        finally:
            _control(control, [], env, stdin="quit\n")
            if keep_logs is not None:
                _keep_logs(Path(env[LOG_ENV]), keep_logs)


def _keep_logs(log_folder: Path, keep: Path) -> None:
    """Copy the daemon's log files to ``keep``; say where (or why not) on the console."""
    files = sorted(p for p in log_folder.iterdir() if p.is_file())
    if not files:
        return
    try:
        keep.mkdir(parents=True, exist_ok=True)
        for path in files:
            shutil.copyfile(path, keep / path.name)
    except OSError as exc:
        print(f"[tune] could not keep the MPS daemon's logs in {keep}: {exc}", flush=True)
        return
    print(f"[tune] the MPS daemon's logs: {keep} ({', '.join(p.name for p in files)})",
          flush=True)


def _control(control: str, args: list[str], env: dict[str, str],
             stdin: str | None = None) -> str | None:
    """Run the control program; None when it succeeded, else what went wrong."""
    return _run([control, *args], env, CONTROL_TIMEOUT_S, stdin)


def _run(command: list[str], env: dict[str, str], timeout_s: float,
         stdin: str | None = None) -> str | None:
    """Run ``command`` with ``env`` added; None when it succeeded, else the last line it
    wrote (or why it could not run)."""
    try:
        done = subprocess.run(command, input=stdin, capture_output=True, text=True,
                              env={**os.environ, **env}, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return str(exc)
    if done.returncode != 0:
        lines = (done.stderr or done.stdout).strip().splitlines()
        return lines[-1] if lines else f"exit status {done.returncode}"
    return None
