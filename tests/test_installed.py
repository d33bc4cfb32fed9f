"""The product as a user installs and runs it, away from the checkout: the console script
run from another folder finds the named search spaces and runs one; a wheel built from the
checkout and installed into a fresh virtual environment carries the spaces; an install
without them says so (exit 2, one line) instead of listing nothing."""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
SPACES = sorted(p.stem for p in (REPO / "search_spaces").glob("*.yaml"))
ENV = {**os.environ, "PYTHONWARNINGS": "ignore", "HF_HUB_OFFLINE": "1"}


def _script(name: str) -> Path:
    script = Path(sys.executable).parent / name
    if not script.is_file():
        pytest.skip(f"{name} is not installed beside {sys.executable} (pip install -e .)")
    return script


def _listed(stdout: str) -> list[str]:
    return sorted(line.split()[0] for line in stdout.splitlines() if line.strip())


def test_the_console_script_lists_the_spaces_from_another_folder(tmp_path):
    out = subprocess.run([str(_script("mtbert-tune")), "--list-spaces"], cwd=tmp_path,
                         capture_output=True, text=True, env=ENV, timeout=180)
    assert out.returncode == 0, out.stderr
    assert _listed(out.stdout) == SPACES and "smart" in SPACES
    assert not any(tmp_path.iterdir())  # nothing written where it ran


def test_the_console_script_runs_a_named_space_from_another_folder(tmp_path, tiny_model_dir,
                                                                     tiny_data_dir):
    """``mtbert-tune --space smoke`` from a folder with no search_spaces/ in it: the space
    is the package's, the search runs to its summary, its results where it was told."""
    where = tmp_path / "elsewhere"
    where.mkdir()
    out = subprocess.run(
        [str(_script("mtbert-tune")), "--space", "smoke", "--budget", "smoke",
         "--model", tiny_model_dir, "--data-dir", tiny_data_dir, "--num-samples", "1",
         "--max-concurrent", "1", "--ensemble-top-k", "1", "--experiment", "away",
         "--storage-path", "results", "--mlflow-uri", f"sqlite:///{tmp_path / 'mlflow.db'}"],
        cwd=where, capture_output=True, text=True, env=ENV, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    summary = json.loads((where / "results" / "away" / "summary.json").read_text())
    assert summary["space"]["name"] == "smoke"
    assert summary["counts"]["trials"] == 1 and summary["counts"]["completed"] == 1
    assert 0.0 < summary["best_trial"]["val"]["val/overall"] <= 1.0


@pytest.fixture(scope="module")
def wheel_venv(tmp_path_factory):
    """A wheel built from the checkout (pip, setuptools as pyproject.toml asks) installed
    without its dependencies into a fresh venv; the dependencies come from this venv's
    site-packages through a path file, which adds the folder but runs none of its own path
    files, so the checkout's editable install is not seen there."""
    root = tmp_path_factory.mktemp("wheel")
    src = root / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    for folder in ("mtbert", "search_spaces"):
        shutil.copytree(REPO / folder, src / folder, symlinks=True,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                            "--no-build-isolation", "-q", "-w", str(root / "dist"), str(src)],
                           capture_output=True, text=True, env=ENV, timeout=300)
    assert built.returncode == 0, built.stdout + built.stderr
    wheel, = (root / "dist").glob("mtbert_tune-*.whl")
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()"
                              "['purelib'])"], capture_output=True, text=True, check=True)
    fresh_site = Path(purelib.stdout.strip())
    installed = subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps",
                                "--no-index", str(wheel)], capture_output=True, text=True,
                               env=ENV, timeout=300)
    assert installed.returncode == 0, installed.stdout + installed.stderr
    (fresh_site / "zz_test_dependencies.pth").write_text(
        "\n".join(site.getsitepackages()) + "\n", encoding="utf-8")
    return {"wheel": wheel, "venv": venv, "site": fresh_site}


def test_a_wheel_installed_in_a_fresh_venv_lists_the_spaces(wheel_venv, tmp_path):
    import zipfile

    with zipfile.ZipFile(wheel_venv["wheel"]) as whl:
        carried = sorted(Path(n).stem for n in whl.namelist()
                         if n.startswith("mtbert/search_spaces/") and n.endswith(".yaml"))
        smart = yaml.safe_load(whl.read("mtbert/search_spaces/smart.yaml"))
    assert carried == SPACES
    assert smart == yaml.safe_load((REPO / "search_spaces" / "smart.yaml").read_text())
    python = wheel_venv["venv"] / "bin" / "python"
    where = subprocess.run([str(python), "-c", "import mtbert; print(mtbert.__file__)"],
                           cwd=tmp_path, capture_output=True, text=True, env=ENV, check=True)
    assert Path(where.stdout.strip()).is_relative_to(wheel_venv["site"])  # not the checkout
    out = subprocess.run([str(wheel_venv["venv"] / "bin" / "mtbert-tune"), "--list-spaces"],
                         cwd=tmp_path, capture_output=True, text=True, env=ENV, timeout=180)
    assert out.returncode == 0, out.stderr
    assert _listed(out.stdout) == SPACES


def test_an_install_without_its_spaces_says_so_and_exits_2(wheel_venv, tmp_path):
    """The spaces' folder gone from the installed package: --list-spaces is an error (one
    line, exit 2), not an empty list; --space names what is missing."""
    spaces = wheel_venv["site"] / "mtbert" / "search_spaces"
    hidden = wheel_venv["site"] / "spaces-away"
    spaces.rename(hidden)
    try:
        script = str(wheel_venv["venv"] / "bin" / "mtbert-tune")
        out = subprocess.run([script, "--list-spaces"], cwd=tmp_path, capture_output=True,
                             text=True, env=ENV, timeout=180)
        assert out.returncode == 2 and out.stdout == ""
        assert out.stderr.strip().splitlines() == [
            f"error: --list-spaces: no search space found (no *.yaml in {spaces}; the package "
            "was installed without its spaces)"]
        out = subprocess.run([script, "--space", "smart", "--storage-path", "out"],
                             cwd=tmp_path, capture_output=True, text=True, env=ENV, timeout=180)
        assert out.returncode == 2
        assert out.stderr.strip().splitlines() == [
            f"error: --space smart: unknown search space (no {spaces / 'smart.yaml'}); "
            "known spaces: none"]
        assert not (tmp_path / "out").exists()
    finally:
        hidden.rename(spaces)
