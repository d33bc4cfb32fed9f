"""The integration table of tests/conftest.py names modules and tests that exist: a renamed
test would otherwise move to the unit tier unnoticed (docs/testing.md)."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import INTEGRATION_MODULES, INTEGRATION_TESTS

TESTS = Path(__file__).resolve().parent


def test_every_module_and_test_the_table_names_exists():
    missing = [m for m in INTEGRATION_MODULES if not (TESTS / f"{m}.py").is_file()]
    for entry in INTEGRATION_TESTS:
        file, name = entry.split("::")
        path = TESTS / file
        defined = ({node.name for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
                    if isinstance(node, ast.FunctionDef)} if path.is_file() else set())
        if name not in defined:
            missing.append(entry)
    assert not missing, f"tests/conftest.py names what does not exist: {missing}"


def test_the_searches_group_names_modules_that_exist_and_holds_every_shared_ray_user():
    """The worker group of the searches (tests/conftest.py) names existing modules, and
    every module whose tests take the shared Ray is in it: one worker, one Ray start."""
    from conftest import SEARCHES_GROUP_MODULES

    missing = [m for m in SEARCHES_GROUP_MODULES if not (TESTS / f"{m}.py").is_file()]
    assert not missing, f"tests/conftest.py's SEARCHES_GROUP_MODULES: no such module {missing}"
    users = {p.stem for p in TESTS.glob("test_*.py")
             if any(isinstance(node, ast.FunctionDef)
                    and "shared_ray" in {a.arg for a in node.args.args}
                    for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"))))}
    assert "test_search_choices" in users  # the walk finds them
    assert users <= SEARCHES_GROUP_MODULES, users - SEARCHES_GROUP_MODULES
