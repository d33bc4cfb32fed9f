"""The Ray cluster a search runs on: start a local one or join one, and size the search to it.

A local Ray's dashboard listens on 127.0.0.1 only (reach it from another machine with
an SSH port-forward).  ``--address`` is probed before anything starts
(:func:`check_ray_address`: ``ray.init`` would retry for minutes), and the trials'
resources are checked against what the cluster has (:func:`trials_at_once`).
"""

from __future__ import annotations

import contextlib
import os
import socket
from typing import Iterator

from mtbert.errors import ConfigError


def quiet_environment() -> None:
    """Settings inherited by the local Ray workers: no tokenizer threads, no progress bars,
    no warning each time a checkpoint forces an experiment-state snapshot."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TUNE_WARN_EXCESSIVE_EXPERIMENT_CHECKPOINT_SYNC_THRESHOLD_S", "0")
    # snapshot Tune's experiment state every second (Ray's "auto" waits >= 10 s): what
    # --resume restores after a driver crash is then at most a second or so old, so it
    # rarely names a trial's checkpoint that num_to_keep has deleted since (such a trial
    # cannot be restored) or misses a trial that ended or started meanwhile
    os.environ.setdefault("TUNE_GLOBAL_CHECKPOINT_S", "1")


def start_local_ray(**kwargs):
    """A one-machine Ray whose dashboard listens on 127.0.0.1 only."""
    import ray
    return ray.init(include_dashboard=True, dashboard_host="127.0.0.1", log_to_driver=True,
                    **kwargs)


@contextlib.contextmanager
def ray_session(address: str | None) -> Iterator[None]:
    """Ray for the search: the session already open in this process, the cluster at
    ``address``, or a new local one -- shut down at the end if this call started it."""
    import ray
    started = not ray.is_initialized()
    if started:
        if address:
            ray.init(address=address, log_to_driver=True)
        else:
            start_local_ray()
    try:
        yield
    finally:
        if started:
            ray.shutdown()


def dashboard_url() -> str | None:
    try:
        from ray._private.worker import get_dashboard_url
        url = get_dashboard_url()
    except Exception:  # noqa: BLE001 -- the URL is informative only
        return None
    if not url:
        return None
    return url if url.startswith("http") else f"http://{url}"


def trials_at_once(cpus_per_trial: float, gpus_per_trial: float, max_concurrent: int | None,
                   address: str | None) -> int:
    """How many trials run at once on the connected cluster; raises ConfigError when a
    trial needs more than the cluster has (except on an autoscaling cluster where
    ``--max-concurrent`` says how many to wait for)."""
    import ray
    resources = ray.cluster_resources()
    cpus, gpus = resources.get("CPU", 0.0), resources.get("GPU", 0.0)
    if cpus_per_trial > cpus:
        raise ConfigError(f"--cpus-per-trial {cpus_per_trial:g}: the Ray cluster has "
                          f"{cpus:g} CPUs")
    if gpus_per_trial > 0 and gpus_per_trial > gpus:
        if not (address and max_concurrent):
            raise ConfigError(f"--gpus-per-trial {gpus_per_trial:g}: the Ray cluster has "
                              f"{gpus:g} GPUs (on an autoscaling cluster whose GPU workers "
                              "start at 0, also give --max-concurrent N: trials then wait for "
                              "the autoscaler)")
        print(f"[tune] the Ray cluster has {gpus:g} GPUs now: the {max_concurrent} "
              "trials at once wait for the autoscaler to add GPU nodes", flush=True)
    if max_concurrent:
        return max_concurrent
    n = max(1, int(cpus // cpus_per_trial))
    if gpus_per_trial > 0:
        n = min(n, max(1, int(gpus // gpus_per_trial)))
    return n


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
