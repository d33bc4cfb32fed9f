"""The real CLIs run as processes, without each paying their imports (seconds of Ray,
MLflow, Optuna, torch and transformers): one server process imports the modules a CLI
imports, then forks one child per command, and the child runs the command as Python
would run it (``tune_driver.py`` as ``__main__``, or ``-m mtbert.train``), with its own
argv, working folder, environment (PYTHONWARNINGS applied), stdin (/dev/null), stdout and
stderr (files), and ends as Python ends: the exit code of its SystemExit, or the traceback
of an uncaught exception and 1, then the atexit functions -- all but the interpreter's
teardown of the imported modules (~1 s a command: it writes to every page the fork
shares).  What the imports print goes to the server's own files, and :class:`ForkedCli`
fails where they print anything, so a command's stderr is all a fresh process would print
but for messages of that teardown.

The bad-input tables (tests/test_bad_input.py, tests/test_bad_input_train.py,
test_trainer.py's) run their cases through it: a case's CLI and its checks are unchanged,
only the imports are shared.  A fresh process of each CLI still runs elsewhere
(test_tune_driver.py::test_cli_process_exit_codes, test_trainer.py::
test_cli_writes_the_contracted_files, test_cli_startup.py).
``python tests/forked_cli.py FOLDER MODULE...`` is the server (ForkedCli starts it)."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import threading
from concurrent.futures import Future
from pathlib import Path


#: what ``python tune_driver.py`` imports before it reads its input (mtbert.tune.cli, then
#: the driver: Ray, MLflow, Optuna, torch) and the transformers classes its checks load
DRIVER_IMPORTS = ["mtbert.tune.cli", "mtbert.tune.driver", "transformers.models.bert",
                  "transformers:CONFIG_MAPPING,MODEL_MAPPING,AutoConfig,AutoTokenizer,AutoModel"]
#: what ``python -m mtbert.train`` imports (deferred, after its argument checks; not
#: mtbert.train itself: runpy warns when it runs a module already imported)
TRAIN_IMPORTS = ["mtbert.core.config", "mtbert.core.pretrained", "mtbert.data", "mtbert.loop.trainer",
                 "mtbert.run.training_state", "safetensors.torch", "transformers.models.bert",
                 "transformers:CONFIG_MAPPING,MODEL_MAPPING,AutoConfig,AutoTokenizer,AutoModel"]


class ForkedCli:
    """A server that has imported ``modules`` (each ``package.module``, or
    ``package:name,name`` to load a lazy package's names); :meth:`run` is ``subprocess.run`` for
    ``[sys.executable, SCRIPT | -m MODULE, ...]`` with captured text output."""

    def __init__(self, modules: list[str], folder: Path, env: dict[str, str], cwd: Path):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        # without PYTHONWARNINGS: a warning while importing fails here; a command's own
        # PYTHONWARNINGS applies in its child
        env = {k: v for k, v in env.items() if k != "PYTHONWARNINGS"}
        self._proc = subprocess.Popen([sys.executable, __file__, str(self.folder), *modules],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=cwd,
                                      env=env, text=True, bufsize=1)
        ready = json.loads(self._proc.stdout.readline() or "{}")
        if not ready.get("ready"):
            self.close()
            raise RuntimeError(f"forked_cli server did not start: {ready}; "
                               f"{self._read('server.err')[-3000:]}")
        printed = self._read("server.out") + self._read("server.err")
        assert not printed, f"importing {modules} printed: {printed[-3000:]}"
        self._lock = threading.Lock()
        self._pending: dict[int, Future] = {}
        self._started: dict[int, Future] = {}
        self._next = 0
        self._reader = threading.Thread(target=self._read_replies, daemon=True)
        self._reader.start()

    def _read(self, name: str) -> str:
        path = self.folder / name
        return path.read_text(errors="replace") if path.exists() else ""

    def _read_replies(self) -> None:
        for line in self._proc.stdout:
            reply = json.loads(line)
            with self._lock:
                if "pid" in reply:
                    self._started.pop(reply["id"]).set_result(reply["pid"])
                else:
                    self._pending.pop(reply["id"]).set_result(reply["rc"])
        with self._lock:  # the server ended: nothing more will come
            for future in [*self._started.values(), *self._pending.values()]:
                future.set_exception(RuntimeError("forked_cli server ended"))

    def run(self, cmd: list[str], cwd: Path | str, env: dict[str, str],
            timeout: float) -> subprocess.CompletedProcess:
        """``cmd`` is ``[sys.executable, "tune_driver.py", ...]`` or ``[sys.executable,
        "-m", "mtbert.train", ...]``."""
        assert cmd[0] == sys.executable, cmd
        with self._lock:
            rid, self._next = self._next, self._next + 1
            started, done = Future(), Future()
            self._started[rid], self._pending[rid] = started, done
            out, err = self.folder / f"{rid}.out", self.folder / f"{rid}.err"
            request = {"id": rid, "argv": cmd[1:], "cwd": str(cwd), "env": dict(env),
                       "stdout": str(out), "stderr": str(err)}
            self._proc.stdin.write(json.dumps(request) + "\n")
            self._proc.stdin.flush()
        pid = started.result(timeout=60)
        try:
            rc = done.result(timeout=timeout)
        except TimeoutError:
            os.kill(pid, signal.SIGKILL)
            done.result(timeout=60)
            raise subprocess.TimeoutExpired(cmd, timeout, self._read(out.name),
                                            self._read(err.name))
        return subprocess.CompletedProcess(cmd, rc, self._read(out.name), self._read(err.name))

    def close(self) -> None:
        if self._proc.stdin and not self._proc.stdin.closed:
            self._proc.stdin.close()  # EOF: the server waits for its children and ends
        try:
            self._proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()

    def __enter__(self) -> "ForkedCli":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---------------------------------------------------------------------- the server
def _child(request: dict, replies: int) -> None:
    """In the forked child: become the command's process, then run it as ``__main__``;
    its SystemExit (or uncaught exception) ends this process as it would end Python."""
    import runpy

    os.close(replies)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    os.close(null)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    if os.environ.get("PYTHONWARNINGS"):  # as Python applies it at its start
        import warnings
        warnings._processoptions(os.environ["PYTHONWARNINGS"].split(","))
    argv = request["argv"]
    code = 0
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]  # runpy sets argv[0] to the module's file
            sys.path[0] = os.getcwd()
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exc:  # as Python ends on it
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 -- an uncaught exception: its traceback, exit 1
        sys.excepthook(*sys.exc_info())
        code = 1
    # Python's exit without the interpreter's teardown (freeing every object of the
    # imported modules writes to each page the fork shares: ~1 s a command): the atexit
    # functions (weakref finalizers included), a collection, the streams flushed
    import atexit
    import gc
    atexit._run_exitfuncs()
    gc.collect()  # what the command made and dropped: its finalizers run, as at Python's exit
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code & 0xFF)


def _serve(folder: Path, modules: list[str]) -> None:
    import importlib

    replies = os.dup(1)  # the replies go to the original stdout; prints to files
    for fd, name in ((1, "server.out"), (2, "server.err")):
        target = os.open(folder / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    for entry in modules:  # "package.module" or "package:name,name" (a lazy package's names)
        module, _, names = entry.partition(":")
        imported = importlib.import_module(module)
        for name in filter(None, names.split(",")):
            getattr(imported, name)

    def reply(message: dict) -> None:
        os.write(replies, (json.dumps(message) + "\n").encode())

    import gc
    gc.freeze()  # the imported objects: no collection in a child touches their pages
    reply({"ready": True})
    children: dict[int, int] = {}  # pid -> request id
    buffer = b""
    while True:
        readable, _, _ = select.select([0], [], [], 0.05 if children else None)
        if readable:
            chunk = os.read(0, 65536)
            if not chunk:
                break
            buffer += chunk
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                request = json.loads(line)
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    _child(request, replies)  # never returns
                children[pid] = request["id"]
                reply({"id": request["id"], "pid": pid})
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            reply({"id": children.pop(pid), "rc": os.waitstatus_to_exitcode(status)})
    while children:
        pid, status = os.waitpid(-1, 0)
        reply({"id": children.pop(pid), "rc": os.waitstatus_to_exitcode(status)})


if __name__ == "__main__":
    _serve(Path(sys.argv[1]), sys.argv[2:])
