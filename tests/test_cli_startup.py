"""``--help`` of both commands and the search's ``--list-spaces`` stay fast: they import
none of the heavy packages (they are imported where a search or a training uses them)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
HEAVY = ("ray", "mlflow", "optuna", "torch", "transformers", "pandas", "scipy", "pyarrow",
         "matplotlib")

PROBE = """
import json, runpy, sys
sys.argv = [{script!r}, {flag!r}]
try:
    runpy.{runner}({target!r}, run_name="__main__")
except SystemExit:
    pass
print(json.dumps(sorted(name for name in {heavy!r} if name in sys.modules)), file=sys.stderr)
"""


@pytest.mark.parametrize("script, runner, target, flag, printed", [
    ("tune_driver.py", "run_path", "tune_driver.py", "--help", "usage:"),
    ("tune_driver.py", "run_path", "tune_driver.py", "--list-spaces", "\nsmart "),
    ("python -m mtbert.train", "run_module", "mtbert.train", "--help", "usage:"),
])
def test_help_and_list_spaces_import_no_heavy_package(script, runner, target, flag, printed):
    code = PROBE.format(script=script, runner=runner, target=target, flag=flag, heavy=HEAVY)
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert printed in out.stdout, out.stdout
    assert json.loads(out.stderr.strip().splitlines()[-1]) == []


@pytest.mark.parametrize("command, same_as", [
    ("mtbert-tune", ["tune_driver.py"]),
    ("mtbert-train", ["-m", "mtbert.train"]),
])
def test_the_installed_commands_are_the_scripts(command, same_as):
    """The console scripts of the install (pyproject.toml) print the ``--help`` of the
    commands they stand for."""
    script = Path(sys.executable).parent / command
    assert script.is_file(), f"{script} is not installed: pip install -e . again"
    installed = subprocess.run([str(script), "--help"], cwd=REPO, capture_output=True,
                               text=True, timeout=60)
    direct = subprocess.run([sys.executable, *same_as, "--help"], cwd=REPO,
                            capture_output=True, text=True, timeout=60)
    assert installed.returncode == direct.returncode == 0, installed.stderr
    assert installed.stdout == direct.stdout
    assert installed.stdout.startswith("usage: ")
