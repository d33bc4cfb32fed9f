"""The registry of choices (mtbert/tune/search/choices.py): the command line, the settings and
the Tuner read it, so a new scheduler is one module in mtbert/tune/search/schedulers/ plus
its registry line -- here, a module this test writes, and the import that line makes."""

from __future__ import annotations

import importlib
import sys
import textwrap

import pytest

from mtbert.tune.search import choices
from mtbert.tune.search.budgets import get_budget
from mtbert.tune.search.choices import SCHEDULERS, SEARCHERS

#: a scheduler's whole module, as one would add it to mtbert/tune/search/schedulers/
TOY_MODULE = textwrap.dedent('''
    """``--scheduler toy``: a scheduler a test adds."""
    from mtbert.tune.search.choice import register
    from mtbert.tune.search.schedulers.base import SchedulerChoice


    class ToyMarker:
        """What the toy scheduler builds (standing in for a Ray scheduler)."""

        def __init__(self, budget, metric: str):
            self.budget, self.metric = budget, metric


    @register
    class Toy(SchedulerChoice):
        name = "toy"
        help = "a scheduler a test adds"
        works_with = ("random",)
        why_only = "it is a toy"
        default_searcher = "random"
        reuses_actors = False

        def build(self, budget, space, metrics, workers, num_samples, last_leg_cpus):
            return ToyMarker(budget, metrics[0])
''')


@pytest.fixture
def toy(tmp_path, monkeypatch):
    """The toy scheduler's module written as a file, and the registry line run: the import
    of that module (the package's lines import its modules the same way); removed after."""
    saved = dict(SCHEDULERS)
    folder = tmp_path / "added"
    folder.mkdir()
    (folder / "toy_scheduler.py").write_text(TOY_MODULE, encoding="utf-8")
    monkeypatch.syspath_prepend(str(folder))
    module = importlib.import_module("toy_scheduler")  # the registry line
    yield module
    sys.modules.pop("toy_scheduler", None)
    SCHEDULERS.clear()
    SCHEDULERS.update(saved)


def test_the_registry_lines_are_the_package_s_modules():
    """Every module of mtbert/tune/search/schedulers/ (its base, the shared population
    class and the Ray classes aside) registers one scheduler, and each of its registry lines
    imports one of them."""
    from pathlib import Path

    from mtbert.tune.search import schedulers
    folder = Path(schedulers.__file__).parent
    modules = sorted(p.stem for p in folder.glob("*.py")
                     if p.stem not in {"__init__", "base", "population", "ray_classes"})
    lines = [line.split()[3] for line in (folder / "__init__.py").read_text().splitlines()
             if line.startswith("from mtbert.tune.search.schedulers import ")]
    assert sorted(lines) == modules
    assert len(SCHEDULERS) == len(modules)
    assert {type(c).__module__.rsplit(".", 1)[-1] for c in SCHEDULERS.values()} == set(modules)


def _argv(tmp_path, model, data, *flags):
    return ["--space", "smoke", "--budget", "smoke", "--model", model, "--data-dir", data,
            "--storage-path", str(tmp_path / "out"), *flags]


def test_a_toy_scheduler_is_one_module(toy, tmp_path, capsys, tiny_model_dir, tiny_data_dir):
    from mtbert.tune.cli import build_parser, main
    from mtbert.tune.search.tuner import build_scheduler, reuses_actors
    from mtbert.tune.settings import resolve_settings

    parser = build_parser()
    assert "toy: a scheduler a test adds (with --search-alg random)" in " ".join(
        parser.format_help().split())
    args = parser.parse_args(_argv(tmp_path, tiny_model_dir, tiny_data_dir, "--scheduler", "toy"))
    settings = resolve_settings(args)
    assert (settings.scheduler, settings.search_alg) == ("toy", "random")
    assert settings.rung_metric == "overall_soft"
    built = build_scheduler("toy", get_budget("smoke"), settings.space, "val/overall_soft")
    assert isinstance(built, toy.ToyMarker) and built.metric == "val/overall_soft"
    assert not reuses_actors("toy", None)
    # a pair it does not allow: one error line, exit 2, nothing written
    rc = main(_argv(tmp_path, tiny_model_dir, tiny_data_dir, "--scheduler", "toy",
                    "--search-alg", "optuna"))
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err == ["error: --scheduler toy needs --search-alg random (or leave "
                               "--search-alg out), got --search-alg optuna: it is a toy"]
    assert not (tmp_path / "out").exists()


def test_the_registry_is_consistent():
    """Every pair and default names a registered choice; the defaults work together."""
    for name, c in SCHEDULERS.items():
        assert c.name == name and c.help and c.default_searcher in SEARCHERS
        assert set(c.works_with) <= set(SEARCHERS) and bool(c.works_with) == bool(c.why_only)
        assert choices.resolve_search_alg(name, None) == c.default_searcher
    for name, c in SEARCHERS.items():
        assert c.name == name and c.help and c.default_scheduler in (None, *SCHEDULERS)
        assert set(c.works_with) <= set(SCHEDULERS) and bool(c.works_with) == bool(c.why_only)
        scheduler = choices.resolve_scheduler(None, name)
        assert choices.resolve_search_alg(scheduler, name) == name
    assert choices.DEFAULT_SCHEDULER in SCHEDULERS and choices.DEFAULT_SEARCHER in SEARCHERS
