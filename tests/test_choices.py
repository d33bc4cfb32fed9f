"""The registry of choices (mtbert/tune/choices.py): the command line, the settings and
the Tuner read it, so a new scheduler is one class in one module -- here, this test's."""

from __future__ import annotations

import pytest

from mtbert.tune import choices
from mtbert.tune.budgets import get_budget
from mtbert.tune.choices import SCHEDULERS, SEARCHERS, SchedulerChoice, register


class ToyMarker:
    """What the toy scheduler builds (standing in for a Ray scheduler)."""

    def __init__(self, budget, metric: str):
        self.budget, self.metric = budget, metric


@pytest.fixture
def toy():
    """A toy scheduler registered the way choices.py registers its own; removed after."""
    saved = dict(SCHEDULERS)

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

    yield Toy
    SCHEDULERS.clear()
    SCHEDULERS.update(saved)


def _argv(tmp_path, model, data, *flags):
    return ["--space", "smoke", "--budget", "smoke", "--model", model, "--data-dir", data,
            "--storage-path", str(tmp_path / "out"), *flags]


def test_a_toy_scheduler_is_one_class(toy, tmp_path, capsys, tiny_model_dir, tiny_data_dir):
    from mtbert.tune.cli import build_parser, main
    from mtbert.tune.tuner import build_scheduler, reuses_actors
    from mtbert.tune.settings import resolve_settings

    parser = build_parser()
    assert "toy: a scheduler a test adds (with --search-alg random)" in " ".join(
        parser.format_help().split())
    args = parser.parse_args(_argv(tmp_path, tiny_model_dir, tiny_data_dir, "--scheduler", "toy"))
    settings = resolve_settings(args)
    assert (settings.scheduler, settings.search_alg) == ("toy", "random")
    assert settings.rung_metric == "overall_soft"
    built = build_scheduler("toy", get_budget("smoke"), settings.space, "val/overall_soft")
    assert isinstance(built, ToyMarker) and built.metric == "val/overall_soft"
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
