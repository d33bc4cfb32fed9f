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


def test_the_tests_sent_to_rest_exist_and_take_no_shared_ray():
    """Each test conftest's REST_GROUP_TESTS sends to the other worker is a test function
    of its module that starts its own Ray (taking the shared Ray there would start a
    second one), and the group says ``rest`` for it, parameters or not."""
    from conftest import REST_GROUP_TESTS, worker_group

    for entry in REST_GROUP_TESTS:
        file, name = entry.split("::")
        functions = {node.name: node for node in ast.walk(ast.parse(
            (TESTS / file).read_text(encoding="utf-8"))) if isinstance(node, ast.FunctionDef)}
        assert name in functions, f"REST_GROUP_TESTS: no test {entry}"
        assert "shared_ray" not in {a.arg for a in functions[name].args.args}, entry
        assert worker_group(f"tests/{entry}") == worker_group(f"tests/{entry}[x]") == "rest"
    assert worker_group("tests/test_fault_tolerance.py::test_nan_loss_trial_fails_with_"
                        "reason_others_go_on") == "searches"
    assert worker_group("tests/test_data.py::test_x") == "rest"
