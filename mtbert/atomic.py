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
