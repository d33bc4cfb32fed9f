"""Trial work folders: where a trial's Trainer writes, named by the process that owns it,
and removed once that process is gone.

A trial trains in a temporary folder (its checkpoint snapshots, a restored checkpoint):
about 0.26 GB for MiniLM, 0.5 GB once a trial resumes.  The trainable removes it when
the trial returns, but Ray ends a stopped or paused trial's worker process without
waiting for the training thread (``__ray_terminate__``), so the trainable's own clean-up
often never runs: the bench's searches left 262 such folders (73 GB) in /tmp over a
day, and a PB2 run failed with "No space left on device".  So each folder's name carries
its host and the PID of the worker that made it (``mtbert-trial-HOST-PID-XXXX``), and
:func:`sweep` removes the folders of this host whose process has ended: every trial does
so as it starts (a node's later trials clean up after its earlier ones) and the driver
once the search is over.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import tempfile
import time
from pathlib import Path

PREFIX = "mtbert-trial-"


def _host() -> str:
    """This machine's name, reduced to what a folder name can hold without a dash."""
    return re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname()) or "host"


def make() -> Path:
    """A new work folder owned by this process."""
    return Path(tempfile.mkdtemp(prefix=f"{PREFIX}{_host()}-{os.getpid()}-"))


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs: it exists and, where /proc tells, is not a zombie
    (ended, waiting for its parent to collect its exit status)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive, not ours to judge
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


def _owner(folder: Path) -> int | None:
    """The PID in a work folder's name if it was made on this host, else None."""
    match = re.fullmatch(rf"{re.escape(PREFIX)}(.+)-(\d+)-[^-]+", folder.name)
    if match is None or match.group(1) != _host():
        return None
    return int(match.group(2))


def sweep(root: str | Path | None = None, wait_s: float = 0.0) -> list[Path]:
    """Remove the work folders under ``root`` (the temp folder) made on this host by
    processes that have ended; with ``wait_s``, first wait up to that long for their
    owners to end (the driver, right after a search, while Ray winds its workers down).
    Returns the folders removed."""
    root = Path(root or tempfile.gettempdir())
    folders = {f: pid for f in root.glob(f"{PREFIX}*")
               if f.is_dir() and (pid := _owner(f)) is not None and pid != os.getpid()}
    deadline = time.monotonic() + wait_s
    while any(_alive(pid) for pid in folders.values()) and time.monotonic() < deadline:
        time.sleep(0.2)
    removed = []
    for folder, pid in folders.items():
        if not _alive(pid):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed
