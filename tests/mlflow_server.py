"""A real ``mlflow server`` on 127.0.0.1 for the tests that stop and start it: its SQLite
backend store and artifact folder stay across restarts, on the same port."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from ray_cluster import free_port


class MlflowServer:
    """``mlflow server`` in its own process group (the CLI and its uvicorn worker); MLflow's
    job runner off (it starts a dozen processes the tests do not need)."""

    def __init__(self, folder: Path, port: int | None = None):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.db = self.folder / "mlflow.db"
        self.port = port or free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.log = self.folder / "server.log"

    def start(self, timeout: float = 120.0) -> "MlflowServer":
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        with open(self.log, "a") as fh:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "mlflow", "server", "--backend-store-uri",
                 f"sqlite:///{self.db}", "--artifacts-destination",
                 str(self.folder / "artifacts"), "--host", "127.0.0.1", "--port",
                 str(self.port), "--workers", "1"],
                stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.time() + timeout
        while not self.answers():
            if self.proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"mlflow server did not start:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.2)
        return self

    def answers(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as resp:
                return resp.status == 200
        except OSError:
            return False

    def stop(self) -> None:
        """Its whole process group ended (SIGTERM, then SIGKILL after 10 s); the port free."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        except ProcessLookupError:
            pass
        try:  # a worker left behind in the group
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc = None
        deadline = time.time() + 10
        while self.answers() and time.time() < deadline:
            time.sleep(0.1)
