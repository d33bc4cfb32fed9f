"""Write a file so that readers see the old content or the new, never a partial one.

Every file the project keeps (token caches, predictions, checkpoint metadata, the
pre-training cache, the search tracker's state) goes through :func:`atomic_write`: the
content is written to a unique temporary file in the target's folder (same file system,
so the final ``os.replace`` is atomic), and the temporary file is removed if writing
fails, so an error or a crash never leaves a half-written target nor litter.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Callable

from mtbert.core.errors import ConfigError


def atomic_write(target: str | Path, write: Callable[[str], Any]) -> Path:
    """Call ``write(tmp_path)`` to produce the file, then move it onto ``target``."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def atomic_write_text(target: str | Path, text: str) -> Path:
    return atomic_write(target, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


def atomic_write_json(target: str | Path, value: Any) -> Path:
    return atomic_write_text(target, json.dumps(value, indent=2, default=float))


def check_creatable(folder: str | Path, what: str) -> None:
    """Raise :class:`ConfigError` "``what``: cannot create a folder under P (why)" unless
    ``folder`` is a folder, or can be made, that files can be written in; creates nothing.

    P is the nearest existing ancestor of ``folder`` (or ``folder`` itself): a file in the
    way, or a folder where even a probe folder cannot be made (``os.access`` says yes to
    root on /proc or a read-only mount, so the probe is really made, then removed).
    """
    probe = Path(folder).expanduser().absolute()
    try:
        while not probe.exists() and probe != probe.parent:
            probe = probe.parent
        is_dir = probe.is_dir()
    except OSError as exc:  # e.g. a parent this user may not even look into
        raise ConfigError(f"{what}: cannot create a folder under {probe} "
                          f"({exc.strerror})") from None
    if not is_dir:
        raise ConfigError(f"{what}: cannot create a folder under {probe} (it is a file, "
                          "not a folder)")
    if not _can_mkdir(probe):
        raise ConfigError(f"{what}: cannot create a folder under {probe} (not writable)")


def _can_mkdir(folder: Path) -> bool:
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".mtbert-probe-", dir=folder))
    except OSError:
        return False
    return True
