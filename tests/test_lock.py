"""requirements-lock.txt and pyproject.toml agree: every dependency pyproject names (the
extras included) is pinned in the lock, at a version pyproject's range allows."""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))

from lock import PROJECT, TORCH_PIN, lock_lines  # noqa: E402  (tools/lock.py)

LOCK_LINE = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s=]+)$")


def read_lock() -> dict[str, Version]:
    pins = {}
    for n, line in enumerate((REPO / "requirements-lock.txt").read_text().splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        match = LOCK_LINE.match(line)
        assert match, f"requirements-lock.txt:{n}: not a `name==version` pin: {line!r}"
        name = canonicalize_name(match[1])
        assert name not in pins, f"requirements-lock.txt:{n}: {name} pinned twice"
        pins[name] = Version(match[2])
    return pins


def pyproject_requirements() -> list[tuple[str, Requirement]]:
    """(where, requirement) for the dependencies and every extra, the project's own
    extras (``mtbert-tune[bohb,pb2]``) expanded."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project.get("optional-dependencies", {})
    out = [("dependencies", Requirement(r)) for r in project["dependencies"]]
    for extra, reqs in extras.items():
        out += [(f"[{extra}]", Requirement(r)) for r in reqs]
    return [(where, r) for where, r in out if canonicalize_name(r.name) != PROJECT]


def test_every_pyproject_dependency_is_pinned_within_its_range():
    pins = read_lock()
    problems = []
    for where, req in pyproject_requirements():
        if req.marker is not None and not req.marker.evaluate():
            continue
        pinned = pins.get(canonicalize_name(req.name))
        if pinned is None:
            problems.append(f"{req} ({where}): not in requirements-lock.txt")
        elif not req.specifier.contains(pinned, prereleases=True):
            problems.append(f"{req} ({where}): the lock pins {pinned}")
    assert not problems, "run python tools/lock.py (docs/testing.md):\n" + "\n".join(problems)


def test_the_lock_pins_the_cpu_torch_and_not_the_project():
    pins = read_lock()
    assert f"torch=={pins['torch']}" == TORCH_PIN
    assert canonicalize_name(PROJECT) not in pins


def test_lock_lines_drop_the_project_editables_and_build_labels():
    frozen = ["# Editable Git install with no remote (mtbert-tune==0.1.0)", "-e /srv/mtbert-tune",
              "torch==2.13.0+cpu", "Zeta_pkg==1.0", "alpha==2.0", "mtbert_tune==0.1.0",
              "beta @ file:///tmp/beta.whl"]
    assert lock_lines(frozen) == ["alpha==2.0", "torch==2.13.0", "Zeta_pkg==1.0"]
