"""The repository speaks of the product: no tracked file (CHANGELOG.md excepted, which
records how the project was built) names how the team ran its checks on borrowed GPU
machines, or a path of the machine where an output was made.  Committed raw outputs show
paths relative to the repository, or as ``<repo>``, ``<data>``, ``<model>``, ``<storage>``."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
EXEMPT = {"CHANGELOG.md", "tests/test_product_text.py"}  # this file names them

#: pattern -> what it names.  The build words are the team's own; the paths are the
#: folders of the machines that ran the checks and wrote the raw outputs.
FORBIDDEN = {
    r"\blent\b": "a borrowed machine",
    r"(?i)device time": "the build's GPU time budget",
    r"(?i)warm machine": "the build's GPU machine",
    r"\bcalls? [12]\b": "the build's calls to its GPU machine",
    r"\$OUT\b": "the build's output folder",
    r"\b64 MiB\b": "the build's transfer limit",
    r"\bcarry=|carry folders?|\bcarried (?:there|data|in fp16)|weights carried": "the build's transfer",
    r"gpu_bundle|gpu_checks|run_on_device|\.gpu/": "the build's GPU scripts and their folder",
    r"(?<![\w<.~-])/(?:work|root)/": "an absolute path of a build machine",
    r"/tmp/(?:gpu_bundle|gpu_out|stack|minilm|ray_results|se)\b": "a build machine's scratch path",
}
PATTERNS = [(re.compile(p), why) for p, why in FORBIDDEN.items()]


def tracked_text_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True)
    files = []
    for name in out.stdout.decode().split("\0"):
        path = REPO / name
        if not name or name in EXEMPT or not path.is_file():
            continue
        data = path.read_bytes()
        if b"\0" in data[:4096]:  # binary: images
            continue
        files.append(path)
    return files


def build_words(text: str) -> list[tuple[int, str, str]]:
    """(line number, the matched text, what it names) of each forbidden match."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for pattern, why in PATTERNS:
            for match in pattern.finditer(line):
                found.append((number, match.group(0), why))
    return found


@pytest.mark.parametrize("line", [
    "the search on a lent GPU", "13 min of device time", "on the same warm machine",
    "call 2 runs the search", "copied to $OUT", "at most 64 MiB",
    "run(command=..., carry=[\".gpu/call1\"])", "python tools/gpu_bundle.py",
    '"data_dir": "/tmp/gpu_bundle/data"', "-e /work/main", '"out": "/root/out/tp.json"',
    "--model /tmp/minilm", "the weights carried in fp16", "--data-dir .gpu/data",
])
def test_each_build_word_is_found(line):
    assert build_words(line), line


@pytest.mark.parametrize("line", [
    "STS r carries signal at the second rung", "--carry-figures docs/search_efficiency.json",
    '"data_dir": "<data>"', "python bench/search_efficiency.py --out <bench_results>/se",
    "#!/usr/bin/env python", "tmp_path / 'work' / 'x'", "~/mtbert-tune on every node",
    "the recall 1 and the precision",
])
def test_product_words_pass(line):
    assert not build_words(line), build_words(line)


def test_no_tracked_file_speaks_of_the_build():
    found = []
    files = tracked_text_files()
    assert len(files) > 100  # the listing worked (a clean clone has every tracked file)
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        for number, matched, why in build_words(text):
            found.append(f"{path.relative_to(REPO)}:{number}: {matched!r} ({why})")
    assert not found, "\n".join(found)


def listed_raw_files(readme: Path) -> list[str]:
    """The files a raw-output README's tables name in their first column (`a.json`,
    `.md`: the same stem with another suffix)."""
    names = []
    for line in readme.read_text(encoding="utf-8").splitlines():
        if not line.startswith("| `"):
            continue
        for name in re.findall(r"`([^`]+)`", line.split("|")[1]):
            if name.startswith(".") and names:
                name = Path(names[-1]).stem + name
            if "." in name and "*" not in name:
                names.append(name)
    return names


def test_every_raw_output_a_docs_readme_lists_is_committed():
    """A figure's raw file named beside its page is there (an ignore rule once hid the
    GPU utilisation CSVs: the READMEs listed files no clone had)."""
    readmes = sorted((REPO / "docs").glob("gpu_*/**/README.md"))
    assert len(readmes) >= 4
    tracked = set(subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True,
                                 text=True, check=True).stdout.split())
    missing = []
    for readme in readmes:
        names = listed_raw_files(readme)
        for name in names:
            rel = (readme.parent / name).relative_to(REPO).as_posix()
            if rel not in tracked:
                missing.append(f"{readme.relative_to(REPO)} lists {name}: not committed")
    assert not missing, "\n".join(missing)
