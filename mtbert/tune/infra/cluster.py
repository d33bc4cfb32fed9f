"""The Ray cluster a search runs on: start a local one or join one, and size the search to it.

A local Ray's dashboard listens on 127.0.0.1 only (reach it from another machine with
an SSH port-forward).  ``--address`` is probed before anything starts
(:func:`check_ray_address`: ``ray.init`` would retry for minutes), and the trials'
resources are planned against what the cluster has (:func:`plan_resources`): without
``--gpus-per-trial``, trials on a cluster with GPUs share them, several per GPU.
"""

from __future__ import annotations

import contextlib
import math
import os
import socket
from dataclasses import dataclass
from typing import Iterator

from mtbert.core.errors import ConfigError
from mtbert.core.pretrained import resolve_model_path


def quiet_environment() -> None:
    """Settings inherited by the local Ray workers: no tokenizer threads, no progress bars,
    no warning each time a checkpoint forces an experiment-state snapshot."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TUNE_WARN_EXCESSIVE_EXPERIMENT_CHECKPOINT_SYNC_THRESHOLD_S", "0")
    # snapshot Tune's experiment state every second (Ray's "auto" waits >= 10 s): what
    # --resume restores after a driver crash is then at most a second or so old, so it
    # rarely misses a trial that ended or started meanwhile
    os.environ.setdefault("TUNE_GLOBAL_CHECKPOINT_S", "1")


def start_local_ray(dashboard: bool = True, **kwargs):
    """A one-machine Ray whose dashboard listens on 127.0.0.1 only; ``dashboard=False``
    starts none (the benchmarks' ``--no-dashboard``: a Ray without the dashboard's
    packages, ``ray`` without ``[default]``, refuses ``include_dashboard=True``)."""
    import ray
    where = {"dashboard_host": "127.0.0.1"} if dashboard else {}
    return ray.init(include_dashboard=dashboard, log_to_driver=True, **where, **kwargs)


@contextlib.contextmanager
def ray_for_search(address: str | None, worker_env: dict[str, str] | None = None
                   ) -> Iterator[None]:
    """Ray for the search: the Ray already started in this process, the cluster at
    ``address``, or a new local one -- shut down at the end if this call started it.
    ``worker_env``: environment variables of the job's workers (Ray's ``runtime_env``), for
    a Ray this call starts."""
    import ray
    started = not ray.is_initialized()
    if started:
        job = {"runtime_env": {"env_vars": dict(worker_env)}} if worker_env else {}
        if address:
            ray.init(address=address, log_to_driver=True, **job)
        else:
            start_local_ray(**job)
    try:
        yield
    finally:
        if started:
            ray.shutdown()


def dashboard_lines() -> list[str]:
    """Where the dashboard is and how to get in: Ray 2.60 enables token authentication
    by default, and the page then asks for the token once (it sets a cookie)."""
    url = dashboard_url()
    if not url:
        return ["Ray dashboard: not running"]
    lines = [f"Ray dashboard: {url}"]
    if token_auth_enabled():
        lines.append("Ray dashboard token: the page asks for it once (then a cookie keeps "
                     "it); print it with `ray get-auth-token`")
    return lines


def token_auth_enabled() -> bool:
    """Whether the connected Ray asks for its token (``RAY_AUTH_MODE=token``, Ray's default
    since 2.60 once ``~/.ray/auth_token`` exists)."""
    try:
        from ray._private.authentication.authentication_utils import is_token_auth_enabled
        return bool(is_token_auth_enabled())
    except Exception:  # noqa: BLE001 -- an older Ray: no token authentication
        return False


def dashboard_url() -> str | None:
    try:
        from ray._private.worker import get_dashboard_url
        url = get_dashboard_url()
    except Exception:  # noqa: BLE001 -- the URL is informative only
        return None
    if not url:
        return None
    return url if url.startswith("http") else f"http://{url}"


#: at most this many trials share one GPU: the most that still added throughput under CUDA
#: MPS, at no measured cost without it (docs/bench/step_graphs.md, packed trials)
MAX_TRIALS_PER_GPU = 8
#: GPU memory a trial holds per model parameter: fp32 weights, gradients, AdamW's two
#: moments and SMART's teacher copy (4 + 4 + 8 + 4 bytes)
BYTES_PER_PARAMETER = 20
#: and besides: the CUDA context, one batch's activations (32 x 128 tokens, bf16
#: autocast) and the caching allocator's slack
TRIAL_OVERHEAD_BYTES = 2 * 2**30
#: GPU memory by Ray's accelerator type, for GPUs the driver cannot see itself (the
#: smallest variant where a type comes in several); an unknown type counts as 16 GiB
GPU_MEMORY_GIB = {"H200": 141, "H100": 80, "A100": 40, "L40S": 48, "L4": 24, "A10G": 24,
                  "V100": 16, "T4": 16}
UNKNOWN_GPU_GIB = 16


@dataclass(frozen=True)
class ResourcePlan:
    """What each trial gets and how many run at once; ``rule`` says how the GPU share was
    chosen (printed, and recorded in the summary and the MLflow parent run)."""
    cpus_per_trial: float
    gpus_per_trial: float
    trials_at_once: int
    rule: str
    mps: str = ""   # CUDA MPS for the trials sharing a GPU (mps.MpsUse.note)


def trials_per_gpu(gpu_memory_bytes: float, model_parameters: int) -> int:
    """Trials that fit on one GPU: 90 % of its memory over one trial's need, clamped to
    1..``MAX_TRIALS_PER_GPU``."""
    need = model_parameters * BYTES_PER_PARAMETER + TRIAL_OVERHEAD_BYTES
    return max(1, min(MAX_TRIALS_PER_GPU, int(0.9 * gpu_memory_bytes // need)))


def pack_trials(cpus: float, gpus: float, node_gpus: float, cpus_per_trial: float,
                gpus_per_trial: float | None, max_concurrent: int | None,
                gpu_memory_bytes: float, model_parameters: int,
                autoscaling: bool = False) -> ResourcePlan:
    """The arithmetic of :func:`plan_resources`: ``cpus``/``gpus`` of the cluster,
    ``node_gpus`` the most GPUs on one node, ``gpus_per_trial`` None = choose (several
    trials per GPU where the cluster has GPUs, else CPUs).  ``autoscaling``: the cluster
    may add GPU nodes later (``--address`` with ``--max-concurrent``).  Raises ConfigError
    when a trial needs more than a node has."""
    if cpus_per_trial > cpus:
        raise ConfigError(f"--cpus-per-trial {cpus_per_trial:g}: the Ray cluster has "
                          f"{cpus:g} CPUs")
    if gpus_per_trial is None:
        if gpus <= 0:
            gpus_per_trial, rule = 0.0, "auto: no GPU in the Ray cluster, trials train on CPUs"
        else:
            per_gpu = trials_per_gpu(gpu_memory_bytes, model_parameters)
            gpus_per_trial = math.floor(10_000 / per_gpu) / 10_000  # Ray's resource precision
            rule = (f"auto: {per_gpu} trials per GPU ({gpu_memory_bytes / 2**30:.0f} GiB, "
                    f"{model_parameters / 1e6:.1f} M parameters)")
    elif gpus_per_trial == 0:
        rule = "--gpus-per-trial 0: trials train on CPUs"
    else:
        rule = "--gpus-per-trial"
        if gpus_per_trial > node_gpus and not autoscaling:
            raise ConfigError(
                f"--gpus-per-trial {gpus_per_trial:g}: the Ray cluster's nodes have at most "
                f"{node_gpus:g} GPUs ({gpus:g} in all; a trial runs on one node; on an "
                "autoscaling cluster whose GPU workers start at 0, also give --max-concurrent "
                "N: trials then wait for the autoscaler)")
    if max_concurrent:
        n = max_concurrent
    else:
        n = max(1, int(cpus // cpus_per_trial))
        if gpus_per_trial > 0:
            n = min(n, max(1, int(gpus / gpus_per_trial + 1e-9)))
    return ResourcePlan(cpus_per_trial, gpus_per_trial, n, rule)


def plan_resources(cpus_per_trial: float, gpus_per_trial: float | None,
                   max_concurrent: int | None, address: str | None,
                   model: str) -> ResourcePlan:
    """Each trial's CPUs and GPU share and the trials at once, for the connected cluster."""
    import ray
    resources = ray.cluster_resources()
    cpus, gpus = resources.get("CPU", 0.0), resources.get("GPU", 0.0)
    node_gpus = max([n["Resources"].get("GPU", 0.0) for n in ray.nodes() if n.get("Alive")],
                    default=0.0)
    autoscaling = bool(address and max_concurrent)
    choose = gpus_per_trial is None and gpus > 0
    plan = pack_trials(cpus, gpus, node_gpus, cpus_per_trial, gpus_per_trial, max_concurrent,
                       gpu_memory_bytes(resources) if choose else 0.0,
                       model_parameters(model) if choose else 0, autoscaling)
    if autoscaling and plan.gpus_per_trial > node_gpus:
        print(f"[tune] the Ray cluster has {gpus:g} GPUs now: the {max_concurrent} "
              "trials at once wait for the autoscaler to add GPU nodes", flush=True)
    return plan


def gpu_memory_bytes(resources: dict[str, float]) -> float:
    """One GPU's memory: this machine's first GPU, else by the cluster's accelerator type."""
    import torch
    if torch.cuda.is_available():
        return float(torch.cuda.get_device_properties(0).total_memory)
    for key in resources:
        if key.startswith("accelerator_type:"):
            kind = key.split(":", 1)[1].upper()
            for name, gib in GPU_MEMORY_GIB.items():
                if kind.startswith(name):
                    return gib * 2.0**30
    return UNKNOWN_GPU_GIB * 2.0**30


def model_parameters(model: str) -> int:
    """The encoder's parameter count, from its config alone (built on the meta device:
    no weights read, no memory used)."""
    import torch
    from transformers import AutoConfig, AutoModel

    config = AutoConfig.from_pretrained(resolve_model_path(model))
    with torch.device("meta"):
        encoder = AutoModel.from_config(config)
    return sum(p.numel() for p in encoder.parameters())


def check_ray_address(address: str, timeout: float = 3.0) -> str:
    """Fail fast on a Ray cluster that is not there.

    ``auto``: the cluster ``ray start`` left on this machine (or ``$RAY_ADDRESS``);
    ``HOST:PORT`` / ``ray://HOST:PORT``: a TCP connection to it within ``timeout``
    seconds.  Returns ``HOST:PORT``; raises :class:`ConfigError`."""
    text = address.strip()
    if not text:
        raise ConfigError("--address: empty (use auto, HOST:PORT or ray://HOST:PORT)")
    if text == "auto":
        from ray._private.services import canonicalize_bootstrap_address
        try:
            target = canonicalize_bootstrap_address("auto")
        except (ConnectionError, ValueError) as exc:
            raise ConfigError(f"--address auto: no running Ray cluster found on this machine "
                              f"({exc}); start one with `ray start --head` or give "
                              "--address HOST:PORT") from None
        if not target:
            raise ConfigError("--address auto: no running Ray cluster found on this machine")
    else:
        target = text[len("ray://"):] if text.startswith("ray://") else text
    host, sep, port = target.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or "/" in target or not port.isdigit() \
            or not 0 < int(port) < 65536:
        raise ConfigError(f"--address {address}: expected auto, HOST:PORT (the head's GCS "
                          "port, e.g. 10.0.0.5:6379) or ray://HOST:PORT")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            pass
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise ConfigError(f"--address {address}: no Ray cluster reachable at {host}:{port} "
                          f"({reason} within {timeout:g} s); start it (ray start --head "
                          f"--port={port}) or fix the address") from None
    return f"{host}:{port}"
