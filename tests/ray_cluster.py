"""A real multi-node Ray cluster on this machine for tests: ``ray start`` processes.

Each node is its own ``ray start --block`` process group (head or worker) on 127.0.0.1
with its own short temp dir (Unix socket paths must stay short), its own free ports, no
dashboard and a small object store.  The address file ``ray start`` writes lives in
that temp dir, never /tmp/ray, so a ``ray.init()`` elsewhere on the machine (another
test, another engineer) does not join this cluster.  Shutdown kills exactly the
processes this helper started (their process groups and any process whose command line
names one of its temp dirs) -- never ``ray stop``, which would end every Ray on the
machine.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

RAY = str(Path(sys.executable).with_name("ray"))
#: node-death detection in a few seconds instead of ~30 (GCS health checks of raylets)
FAST_FAILURE_ENV = {"RAY_health_check_initial_delay_ms": "1000",
                    "RAY_health_check_period_ms": "1000",
                    "RAY_health_check_timeout_ms": "1000",
                    "RAY_health_check_failure_threshold": "3"}


def _processes() -> dict[int, tuple[int, str, str]]:
    """pid -> (parent pid, name, command line), from /proc (no psutil needed)."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        ppid = int(stat[stat.rindex(")") + 2:].split()[1])
        out[int(entry.name)] = (ppid, name, cmdline)
    return out


def descendants(pid: int) -> list[int]:
    procs = _processes()
    children: dict[int, list[int]] = {}
    for p, (ppid, _, _) in procs.items():
        children.setdefault(ppid, []).append(p)
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def process_token() -> str:
    """This process's Ray token (``RAY_AUTH_TOKEN``; made once, 32 random bytes as hex):
    every cluster a test starts from here, and a Ray this process starts later, use it."""
    if not os.environ.get("RAY_AUTH_TOKEN"):
        os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
    return os.environ["RAY_AUTH_TOKEN"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Node:
    name: str
    proc: subprocess.Popen
    temp_dir: Path
    log: Path
    node_id: str | None = None

    def raylet_pid(self) -> int:
        procs = _processes()
        for pid in descendants(self.proc.pid):
            if pid in procs and procs[pid][1] == "raylet":
                return pid
        raise RuntimeError(f"{self.name}: no raylet process")


class LocalRayCluster:
    def __init__(self, log_dir: Path):
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.nodes: list[Node] = []
        self.env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        self.env.update(FAST_FAILURE_ENV, RAY_USAGE_STATS_ENABLED="0",
                        TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
        # Ray 2.60 turns token authentication on for new clusters and reads the token from
        # ~/.ray/auth_token, which a fresh machine lacks: then `ray start --head` refuses to
        # start and this process's GCS client aborts the process (a failed RAY_CHECK, seen as
        # a pytest-xdist worker "crashed").  The nodes, drivers and this process's GCS client
        # share one token of this test process's (RAY_AUTH_TOKEN), whatever ~/.ray holds.
        self.env.setdefault("RAY_AUTH_MODE", "token")
        self.env.setdefault("RAY_AUTH_TOKEN", process_token())
        self._auth_ready = False

    # ------------------------------------------------------------------ nodes
    def _start(self, name: str, args: list[str], num_cpus: int, num_gpus: int = 0) -> Node:
        temp_dir = Path(tempfile.mkdtemp(prefix="rt", dir="/tmp"))
        log = self.log_dir / f"{name}.log"
        before = self.alive_node_ids() if self.nodes else set()
        cmd = [RAY, "start", "--block", "--node-ip-address=127.0.0.1", f"--num-cpus={num_cpus}",
               f"--num-gpus={num_gpus}", f"--temp-dir={temp_dir}", "--object-store-memory=100000000",
               "--disable-usage-stats", *args]
        with open(log, "w") as fh:
            proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=self.env,
                                    start_new_session=True)
        node = Node(name, proc, temp_dir, log)
        self.nodes.append(node)
        deadline = time.time() + 90
        while time.time() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
            try:
                new = self.alive_node_ids() - before
            except Exception:  # noqa: BLE001 -- GCS not up yet
                new = set()
            if new:
                node.node_id = sorted(new)[0]
                return node
            time.sleep(0.5)
        raise RuntimeError(f"{name} did not join within 90 s:\n{log.read_text()[-3000:]}")

    def start_head(self, num_cpus: int = 1, num_gpus: int = 0) -> Node:
        """The head node; ``num_gpus`` GPUs declared (a logical resource: none need exist)."""
        return self._start("head", ["--head", f"--port={self.port}", "--include-dashboard=false",
                                    "--dashboard-host=127.0.0.1",
                                    f"--dashboard-port={free_port()}",
                                    f"--ray-client-server-port={free_port()}"], num_cpus,
                           num_gpus)

    def add_worker(self, num_cpus: int = 1) -> Node:
        n = sum(1 for x in self.nodes if x.name.startswith("worker"))
        return self._start(f"worker{n + 1}", [f"--address={self.address}"], num_cpus)

    def kill_raylet(self, node: Node) -> int:
        """SIGKILL the node's raylet: the node is lost (``ray start --block`` then ends the
        rest of that node's processes, within a second or so)."""
        pid = node.raylet_pid()
        os.kill(pid, signal.SIGKILL)
        return pid

    def kill_node(self, node: Node) -> int:
        """A machine dying: SIGKILL its raylet, then at once every other process of the
        node (its trial workers would otherwise run on for a moment and could report a
        result or two more).  Returns the raylet's pid."""
        others = [node.proc.pid, *descendants(node.proc.pid)]
        pid = self.kill_raylet(node)
        for other in others:
            try:
                os.kill(other, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        return pid

    # ------------------------------------------------------------------ state
    def node_info(self) -> dict[str, int]:
        """Node id (hex) -> state (0 = ALIVE, 1 = DEAD) as the GCS sees it."""
        from ray._raylet import AuthenticationTokenLoader, Config, GcsClient
        if not self._auth_ready:  # Ray may have been imported (config cached) before now
            os.environ["RAY_AUTH_MODE"] = self.env["RAY_AUTH_MODE"]
            os.environ["RAY_AUTH_TOKEN"] = self.env["RAY_AUTH_TOKEN"]
            Config.initialize("")
            AuthenticationTokenLoader.instance().reset_cache()
            self._auth_ready = True
        infos = GcsClient(address=self.address).get_all_node_info(timeout=5)
        return {info.node_id.hex(): int(info.state) for info in infos.values()}

    def alive_node_ids(self) -> set[str]:
        return {nid for nid, state in self.node_info().items() if state == 0}

    def wait_dead(self, node: Node, timeout: float = 60) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if node.node_id not in self.alive_node_ids():
                return
            time.sleep(0.5)
        raise RuntimeError(f"{node.name} still alive after {timeout} s")

    # ------------------------------------------------------------------ teardown
    def _pids(self) -> set[int]:
        pids = set()
        for node in self.nodes:
            if node.proc.poll() is None:
                pids.add(node.proc.pid)
            pids.update(descendants(node.proc.pid))
        marks = [str(n.temp_dir) for n in self.nodes]
        for pid, (_, _, cmdline) in _processes().items():
            if any(m in cmdline for m in marks):
                pids.add(pid)
        pids.discard(os.getpid())
        return pids

    def shutdown(self) -> None:
        pids = self._pids()
        for node in self.nodes:
            try:
                os.killpg(node.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for node in self.nodes:
            try:
                node.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        time.sleep(0.5)
        for pid in self._pids():  # anything a dying raylet spawned meanwhile
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for node in self.nodes:
            shutil.rmtree(node.temp_dir, ignore_errors=True)

    def __enter__(self) -> "LocalRayCluster":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
