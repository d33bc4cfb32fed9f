"""Security defaults: local-only dashboard, safe deserialisation, no shell strings.

* the Ray dashboard the driver starts (``driver.start_local_ray``, what ``run_search``
  calls without ``--address``) listens on 127.0.0.1 only: checked in the kernel's socket
  table (/proc/net/tcp*) and by connecting through a non-loopback address of this
  machine, which must be refused;
* the commands the docs give for servers (``ray start --head``, ``mlflow ui|server``)
  bind to 127.0.0.1 (the compose file's MLflow listens inside its container and is
  published on 127.0.0.1 only: tests/test_cluster_configs.py);
* the code (read as Python syntax trees, not grepped) loads YAML with ``safe_load`` only,
  checkpoints with ``torch.load(..., weights_only=True)`` only, and never builds a shell
  command: no ``shell=True``, ``os.system``, ``os.popen``, ``eval`` or ``exec``.
"""

from __future__ import annotations

import ast
import re
import socket
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SOURCES = sorted([*(REPO / "mtbert").rglob("*.py"), REPO / "tune_driver.py",
                  *(REPO / "bench").glob("*.py"), *(REPO / "tests").glob("*.py")])
DOCS = [REPO / "README.md", REPO / "cluster" / "README.md", REPO / "cluster" / "aws-gpu.yaml",
        REPO / "cluster" / "kuberay-raycluster.yaml", REPO / "mtbert" / "tune" / "__init__.py",
        REPO / "mtbert" / "tune" / "driver.py", REPO / "mtbert" / "tune" / "infra" / "cluster.py",
        REPO / "mtbert" / "tune" / "infra" / "tracking.py", *sorted((REPO / "docs").rglob("*.md"))]


# ---------------------------------------------------------------------- code
def _calls(path: Path):
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            yield node


def _name(func: ast.AST) -> str:
    parts = []
    while isinstance(func, ast.Attribute):
        parts.append(func.attr)
        func = func.value
    if isinstance(func, ast.Name):
        parts.append(func.id)
    return ".".join(reversed(parts))


def _kw(call: ast.Call, name: str):
    for kw in call.keywords:
        if kw.arg == name:
            return kw.value
    return None


def test_code_has_no_unsafe_loads_or_shell_strings():
    problems = []
    yaml_loads = torch_loads = 0
    for path in SOURCES:
        rel = path.relative_to(REPO)
        for call in _calls(path):
            name = _name(call.func)
            where = f"{rel}:{call.lineno}: {name}"
            if name in ("yaml.load", "yaml.load_all", "yaml.full_load", "yaml.unsafe_load",
                        "yaml.full_load_all", "yaml.unsafe_load_all"):
                problems.append(f"{where} (use yaml.safe_load)")
            if name.startswith("yaml.safe_load"):
                yaml_loads += 1
            if name == "torch.load":
                torch_loads += 1
                wo = _kw(call, "weights_only")
                if not (isinstance(wo, ast.Constant) and wo.value is True):
                    problems.append(f"{where} without weights_only=True")
            shell = _kw(call, "shell")
            if shell is not None and not (isinstance(shell, ast.Constant) and shell.value is False):
                problems.append(f"{where} with shell=...")
            if name in ("os.system", "os.popen", "pickle.load", "pickle.loads") or (
                    isinstance(call.func, ast.Name) and name in ("eval", "exec")):
                problems.append(where)
            if name.startswith("subprocess.") and call.args and isinstance(
                    call.args[0], (ast.Constant, ast.JoinedStr, ast.BinOp)):
                problems.append(f"{where} with a command string (pass a list)")
    assert not problems, "\n".join(problems)
    assert yaml_loads >= 3 and torch_loads >= 3  # the checks looked at real code


def test_docs_bind_servers_to_localhost():
    """Every ``mlflow ui|server`` command the docs and messages give has ``--host 127.0.0.1``
    (within the command, which may go on over a few lines); nothing binds the Ray
    dashboard to all interfaces (a bare ``ray start --head`` keeps Ray's default,
    localhost; the cluster configs set 127.0.0.1 explicitly: test_cluster_configs.py)."""
    problems = []
    for path in DOCS:
        text = path.read_text(encoding="utf-8")
        for m in re.finditer(r"mlflow (?:ui|server)\b", text):
            window = text[m.start():m.start() + 200].split("\n\n", 1)[0]
            if "--host 127.0.0.1" not in window:
                problems.append(f"{path.name}: {window[:100]!r}")
        for bad in ("dashboard-host=0.0.0.0", "dashboard-host=::", 'dashboard_host="0.0.0.0"',
                    "dashboard-host: \"0.0.0.0\""):
            if bad in text:
                problems.append(f"{path.name}: {bad}")
    assert not problems, "\n".join(problems)


# ---------------------------------------------------------------------- dashboard
def _listening(port: int) -> list[str]:
    """Local addresses of the LISTEN sockets on ``port`` (IPv4 and IPv6)."""
    out = []
    for table, size in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            addr, hexport = fields[1].split(":")
            if int(hexport, 16) != port or fields[3] != "0A":  # 0A = LISTEN
                continue
            if size == 8:
                out.append(socket.inet_ntop(socket.AF_INET, bytes.fromhex(addr)[::-1]))
            else:
                raw = b"".join(bytes.fromhex(addr[i:i + 8])[::-1] for i in range(0, 32, 8))
                out.append(socket.inet_ntop(socket.AF_INET6, raw))
    return out


def _non_loopback_ipv4() -> list[str]:
    """This machine's IPv4 addresses other than loopback (/proc/net/fib_trie ``host
    LOCAL`` entries, and the source address of the default route)."""
    addrs = set()
    try:
        lines = Path("/proc/net/fib_trie").read_text().splitlines()
        for prev, line in zip(lines, lines[1:]):
            if "/32 host LOCAL" in line:
                addrs.add(prev.strip().lstrip("|-+ ").strip())
    except OSError:
        pass
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))  # UDP: no packet is sent
            addrs.add(s.getsockname()[0])
    except OSError:
        pass
    return sorted(a for a in addrs if a and not a.startswith("127."))


@pytest.fixture(scope="module")
def local_ray():
    import ray

    from mtbert.tune.infra.cluster import dashboard_url, start_local_ray
    if ray.is_initialized():
        pytest.skip("a Ray session is already open in this process")
    start_local_ray(num_cpus=1)
    try:
        yield dashboard_url()
    finally:
        ray.shutdown()


def test_dashboard_the_driver_starts_listens_on_loopback_only(local_ray):
    assert local_ray, "the driver's local Ray has no dashboard"
    m = re.match(r"http://([\d.]+):(\d+)$", local_ray)
    assert m and m.group(1) == "127.0.0.1", local_ray
    port = int(m.group(2))
    bound = _listening(port)
    assert bound and set(bound) <= {"127.0.0.1", "::1"}, bound
    with socket.create_connection(("127.0.0.1", port), timeout=3):
        pass  # reachable locally
    others = _non_loopback_ipv4()
    if not others:
        pytest.skip("this machine has no non-loopback IPv4 address to try")
    for ip in others:
        with pytest.raises(OSError):
            with socket.create_connection((ip, port), timeout=3):
                pass


def test_driver_says_how_to_get_into_the_dashboard(local_ray):
    """The hint about `ray get-auth-token` is printed exactly when the dashboard asks for
    a token (it answers 401 without one); the token itself is never printed."""
    import urllib.error
    import urllib.request

    from mtbert.tune.infra.cluster import dashboard_lines
    lines = dashboard_lines()
    assert lines[0] == f"Ray dashboard: {local_ray}"
    try:
        with urllib.request.urlopen(f"{local_ray}/api/version", timeout=10) as resp:
            needs_token = resp.status == 401
    except urllib.error.HTTPError as exc:
        needs_token = exc.code == 401
    hinted = any("ray get-auth-token" in ln for ln in lines[1:])
    assert hinted == needs_token, (lines, needs_token)
    token_file = Path.home() / ".ray" / "auth_token"
    if token_file.is_file():
        token = token_file.read_text().strip()
        assert token and not any(token in ln for ln in lines)
