"""The MLflow outbox of a search: its MLflow writes as operations in an ordered journal on
the local disk, sent by one background thread, so that an MLflow server that is slow or
away never holds up Tune's loop nor ends the search.

The folder (``<experiment>/mlflow_outbox/``):

* ``journal.jsonl``: one operation a line, ``{"seq": n, "kind": ..., ...}``, appended
  when the search queues it (a line cut short by a killed process is dropped on reading);
* ``sent.json``: ``{"through": n}``, written atomically after each operation MLflow took:
  the operations up to ``n`` are in MLflow;
* ``files/<seq>/``: the copy of an artifact file, taken when it is queued (the search logs
  files from temporary folders that are gone before a deferred send), removed once sent;
* ``lock``: held (``flock``) by the one process that sends this outbox.

One :class:`Outbox` per folder and process (:func:`outbox_for`); its sender thread sends
the operations in order, each through the ``send`` function it was given.  An error
``transient`` calls transient (the server unreachable, or a 5xx) keeps the operation at the
head of the queue: the sender pauses (0.5 s, doubling, at most :data:`MAX_PAUSE_S`), asks
``probe`` whether the server answers again, and tries once more.  Any other error (MLflow
answered 4xx: a bad value) is reported once as a warning and the operation dropped, so it
never blocks the ones behind it.  An operation may be sent twice (a process killed between
its send and ``sent.json``): ``send`` must make each idempotent.  Once all are sent the
journal is emptied.
"""

from __future__ import annotations

import collections
import errno
import json
import os
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

from mtbert.core.atomic import atomic_write_text
from mtbert.core.errors import ConfigError, MtbertError, first_line

OUTBOX_DIR = "mlflow_outbox"
JOURNAL, SENT, FILES, LOCK = "journal.jsonl", "sent.json", "files", "lock"
#: how long the end of a search waits for MLflow to take a write before it leaves the rest
#: unsent (seconds; the environment variable overrides it), and the longest pause between
#: two tries while MLflow is away
FLUSH_ENV, DEFAULT_FLUSH_S, MAX_PAUSE_S = "MTBERT_MLFLOW_FLUSH_S", 180.0, 5.0

#: outbox folder -> its Outbox, one per process: every tracker of a search (the driver's,
#: and the callback's that Tune unpickles on ``Tuner.restore``) queues into the same one
_OUTBOXES: dict[str, "Outbox"] = {}
_REGISTRY_LOCK = threading.Lock()


class OutboxBusy(MtbertError):
    """Another process sends this outbox (the search's driver, or another send)."""


def flush_seconds() -> float:
    """How long the end of a search waits for its MLflow writes (``MTBERT_MLFLOW_FLUSH_S``,
    default :data:`DEFAULT_FLUSH_S`); ConfigError for a value that is not a number >= 0."""
    text = os.environ.get(FLUSH_ENV)
    if text is None or not text.strip():
        return DEFAULT_FLUSH_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):
        raise ConfigError(f"{FLUSH_ENV}={text!r}: the seconds the end of a search waits for "
                          "its MLflow writes: a number >= 0")
    return value


def outbox_for(folder: str | Path, send: Callable[[dict], None],
               transient: Callable[[BaseException], bool],
               probe: Callable[[], bool] | None = None,
               describe: Callable[[dict], str] = lambda op: op.get("kind", "?")) -> "Outbox":
    """This process's outbox of ``folder`` (made, its journal read, its sender started on
    the operations left unsent, the first time)."""
    key = str(Path(folder).resolve())
    with _REGISTRY_LOCK:
        box = _OUTBOXES.get(key)
        if box is None or box.closed:
            box = _OUTBOXES[key] = Outbox(Path(key), send, transient, probe, describe)
        return box


def release(folder: str | Path) -> None:
    """This process stops sending ``folder``'s outbox (what is unsent stays in its journal,
    for the next process: ``--send-mlflow``, ``--resume``)."""
    key = str(Path(folder).resolve())
    with _REGISTRY_LOCK:
        box = _OUTBOXES.pop(key, None)
    if box is not None:
        box.close()


def discard(folder: str | Path) -> None:
    """A new search at ``folder``'s place: an outbox left there by an earlier one is
    closed and its files removed."""
    key = str(Path(folder).resolve())
    with _REGISTRY_LOCK:
        box = _OUTBOXES.pop(key, None)
    if box is not None:
        box.close()
    shutil.rmtree(key, ignore_errors=True)


class Outbox:
    """The journal of one folder and its sender thread (see the module's docstring)."""

    def __init__(self, folder: Path, send: Callable[[dict], None],
                 transient: Callable[[BaseException], bool],
                 probe: Callable[[], bool] | None, describe: Callable[[dict], str]):
        self.folder, self._send, self._transient = folder, send, transient
        self._probe, self._describe = probe, describe
        self.quiet = False  # no lines when MLflow goes away and comes back
        self.closed = False
        self._cond = threading.Condition()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._warned: set[str] = set()
        self._progress = 0.0  # when the last operation was sent
        folder.mkdir(parents=True, exist_ok=True)
        self._lock_file = _hold_lock(folder / LOCK)
        self._through, self._pending = self._read()
        #: the operations unsent when this process opened the journal (what a killed
        #: process queued: a tracker reads its evaluations from here, :meth:`put`'s ``then``)
        self.found = tuple(self._pending)
        last = self._pending[-1]["seq"] if self._pending else self._through
        self._next = last + 1
        if self._pending:
            self._start()

    # ------------------------------------------------------------------ the journal
    def _read(self) -> tuple[int, collections.deque]:
        sent = self.folder / SENT
        through = int(json.loads(sent.read_text(encoding="utf-8"))["through"]) \
            if sent.is_file() else 0
        journal = self.folder / JOURNAL
        pending: collections.deque = collections.deque()
        if not journal.is_file():
            return through, pending
        data = journal.read_bytes()
        if data and not data.endswith(b"\n"):  # cut short by a killed process
            data = data[:data.rfind(b"\n") + 1]
            with open(journal, "r+b") as fh:
                fh.truncate(len(data))
        for number, line in enumerate(data.decode("utf-8", "replace").splitlines(), 1):
            try:
                op = json.loads(line)
                seq = int(op["seq"])
            except (ValueError, TypeError, KeyError):  # (damaged by hand: not sent)
                print(f"warning: {journal}, line {number}: not an MLflow write; left out",
                      file=sys.stderr, flush=True)
                continue
            if seq > through:
                pending.append(op)
        return through, pending

    def put(self, op: dict[str, Any], then: Callable[[], None] | None = None) -> int:
        """Queue ``op`` (its ``file``, a path, copied into the outbox first); its number.
        ``then`` runs once ``op`` is in the journal and before the sender may take it: what
        the caller records of it (a process killed before ``then`` leaves ``op`` in the
        journal, unsent; one killed after leaves both)."""
        with self._cond:
            op = {"seq": self._next, **op}
            if op.get("file"):
                source = Path(op["file"])
                copy = self.folder / FILES / str(op["seq"]) / source.name
                copy.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(source, copy)
                op["file"] = copy.relative_to(self.folder).as_posix()
            with open(self.folder / JOURNAL, "a", encoding="utf-8") as fh:
                fh.write(json.dumps(op) + "\n")
            if then is not None:
                then()
            self._next += 1
            self._pending.append(op)
            self._start()
            return op["seq"]

    def path_of(self, op: dict[str, Any]) -> Path:
        """Where the copy of ``op``'s file is."""
        return self.folder / op["file"]

    def unsent(self) -> list[dict[str, Any]]:
        with self._cond:
            return list(self._pending)

    def _sent(self, op: dict[str, Any]) -> None:
        with self._cond:  # (closed: another process may send the journal now, op again)
            if self.closed or not self._pending or self._pending[0] is not op:
                return
            self._pending.popleft()
            self._through, self._progress = op["seq"], time.time()
            atomic_write_text(self.folder / SENT, json.dumps({"through": self._through}))
            if op.get("file"):
                shutil.rmtree(self.path_of(op).parent, ignore_errors=True)
            if not self._pending:  # all in MLflow: the journal starts again empty
                atomic_write_text(self.folder / JOURNAL, "")
                shutil.rmtree(self.folder / FILES, ignore_errors=True)
            self._cond.notify_all()

    # ------------------------------------------------------------------ the sender
    def _start(self) -> None:
        """(Under the lock.)  A sender thread while operations wait."""
        if self._thread is None and self._pending and not self.closed:
            self._thread = threading.Thread(target=self._run, name="mlflow-outbox",
                                            daemon=True)
            self._thread.start()

    def _run(self) -> None:
        away_since = None
        while True:
            with self._cond:
                if not self._pending or self.closed:
                    self._thread = None
                    self._cond.notify_all()
                    return
                op = self._pending[0]
            try:
                self._send(op)
            except Exception as exc:  # noqa: BLE001 (each is transient or dropped)
                if self._transient(exc):
                    if away_since is None:
                        away_since = time.time()
                        self._say(f"warning: MLflow did not take a write ({first_line(exc)}); "
                                  f"the writes wait in {self.folder} and are sent in order "
                                  "once it answers", stderr=True)
                    self._wait_for_mlflow()
                    continue
                self._drop(op, exc)
            if away_since is not None:
                self._say(f"[tune] MLflow answers again after {time.time() - away_since:.0f} s: "
                          "the writes that waited are being sent")
                away_since = None
            self._sent(op)

    def _wait_for_mlflow(self) -> None:
        """Pause (0.5 s, doubling, at most MAX_PAUSE_S; a flush cuts it short) until the
        probe says MLflow answers (no probe: one pause)."""
        pause = 0.5
        while not self.closed:
            self._wake.wait(pause)
            self._wake.clear()
            if self._probe is None or self._probe():
                return
            pause = min(MAX_PAUSE_S, pause * 2)

    def _drop(self, op: dict[str, Any], exc: BaseException) -> None:
        """A write MLflow refused (not one it may take later): one warning, then dropped."""
        what = f"{self._describe(op)}: {first_line(exc)}"
        if what not in self._warned:
            self._warned.add(what)
            print(f"warning: MLflow refused a write, dropped ({what})", file=sys.stderr,
                  flush=True)

    def _say(self, line: str, stderr: bool = False) -> None:
        if not self.quiet:
            print(line, file=sys.stderr if stderr else sys.stdout, flush=True)

    def flush(self, timeout: float) -> bool:
        """Wait for every queued operation to be sent, giving up once none has been for
        ``timeout`` seconds (a server away; a slow one that takes them goes on); whether
        all were."""
        with self._cond:
            self._start()
            since = time.time()
        self._wake.set()  # a pause between tries ends now
        with self._cond:
            while self._pending:
                left = max(since, self._progress) + timeout - time.time()
                if left <= 0 or self.closed:
                    return False
                self._cond.wait(min(left, 1.0))
            return True

    def close(self) -> None:
        """Stop sending; the journal stays as it is."""
        with self._cond:
            self.closed = True
            self._cond.notify_all()
        self._wake.set()
        if self._lock_file is not None:
            self._lock_file.close()


def _hold_lock(path: Path):
    """The open lock file, held by this process; OutboxBusy where another holds it."""
    try:
        import fcntl
    except ImportError:  # no flock here: one sender is the user's to keep
        return None
    fh = open(path, "a")  # noqa: SIM115 (held for the process's life)
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
            return fh  # a file system without flock: one sender is the user's to keep
        fh.close()
        raise OutboxBusy(f"{path.parent} is being sent to MLflow by another process (the "
                         "search's driver, or another --send-mlflow): wait for it to end") \
            from None
    return fh
