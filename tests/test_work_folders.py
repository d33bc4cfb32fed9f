"""Trial work folders (mtbert/tune/trial/work_folders.py): a folder whose worker process ended
without cleaning up -- what Ray does to a stopped or paused trial's worker -- is removed
by the next sweep on the same host; live owners' folders, other hosts' and other files
are left alone."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from mtbert.tune.trial import work_folders

REPO = Path(__file__).resolve().parents[1]


def _folder_of_a_process_that_ended(tmp_path: Path) -> Path:
    """A work folder made (with a file in it) by a Python process that then exits
    without removing it."""
    code = ("import sys; from mtbert.tune.trial import work_folders; f = work_folders.make(); "
            "(f / 'run').mkdir(); (f / 'run' / 'model.safetensors').write_bytes(b'x' * 1000); "
            "print(f)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                         text=True, timeout=120, env={**os.environ, "TMPDIR": str(tmp_path)},
                         check=True)
    folder = Path(out.stdout.strip())
    assert folder.parent == tmp_path and folder.is_dir()
    return folder


def test_sweep_removes_the_folders_of_ended_processes_only(tmp_path):
    ended = _folder_of_a_process_that_ended(tmp_path)
    mine = work_folders.make()  # this (live) process's, in the real temp folder
    try:
        live = tmp_path / mine.name
        live.mkdir()  # the same name under tmp_path: owned by this live process
        elsewhere = tmp_path / f"{work_folders.PREFIX}otherhost-{os.getpid() + 10**6}-abcd1234"
        elsewhere.mkdir()  # another host's: its PID means nothing here
        unrelated = tmp_path / "mtbert-trial-notes"
        unrelated.mkdir()
        removed = work_folders.sweep(tmp_path)
        assert removed == [ended] and not ended.exists()
        assert live.is_dir() and elsewhere.is_dir() and unrelated.is_dir()
        assert work_folders.sweep(tmp_path) == []
    finally:
        os.rmdir(mine)


def test_sweep_waits_for_an_owner_that_is_ending(tmp_path):
    """The driver's sweep right after a search: a worker still winding down for a moment
    is waited for (up to wait_s), then its folder goes."""
    code = ("import time; from mtbert.tune.trial import work_folders; print(work_folders.make(), "
            "flush=True); time.sleep(1.5)")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "TMPDIR": str(tmp_path)})
    try:
        folder = Path(proc.stdout.readline().strip())
        assert work_folders.sweep(tmp_path) == [] and folder.is_dir()  # owner alive
        assert work_folders.sweep(tmp_path, wait_s=60) == [folder]
        assert not folder.exists()
    finally:
        proc.wait(timeout=60)
