"""The bench/ scripts as modules, for the tests of their bookkeeping (bench/ is not a
package: each script is loaded from its file, with bench/ on the import path as
``python bench/NAME.py`` has it, so that a script's import of a sibling works)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"
if str(BENCH) not in sys.path:
    sys.path.append(str(BENCH))


def load_bench(name: str):
    """bench/NAME.py as the module ``bench_NAME``."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module
