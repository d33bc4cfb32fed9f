"""The driver's Optuna searcher (build_searcher -> ConcurrencyLimiter(DistinctOptunaSearch))
never trains a configuration that a finished trial already scored, while new ones are
left; in a continuous space it behaves as Ray's OptunaSearch.  Under asha-promote its
limit counts running trials only and Optuna is told each trial's first-rung score."""

from __future__ import annotations

import pytest

from mtbert.tune.search.tuner import build_searcher
from mtbert.tune.search.searchers import MAX_ASKS
from mtbert.tune.search.spaces import parse_space


def _searcher(params: dict, name: str = "optuna", num_samples: int = 8):
    space = parse_space({"description": "d", "params": params}, "test.yaml")
    limiter = build_searcher(name, seed=0, max_concurrent=2, num_samples=num_samples)
    assert limiter.set_search_properties("val/overall", "max", space.param_space())
    return limiter, limiter.searcher


def _score(config: dict) -> float:
    return 1.0 - config["dropout"] + 0.01 * config["smart_lambda_sst"]


@pytest.mark.parametrize("name", ["optuna", "optuna-mv"])
def test_no_configuration_of_a_stepped_space_trains_twice(name):
    # 3 dropouts x 2 lambdas = 6 configurations
    limiter, searcher = _searcher({"dropout": {"quniform": [0.1, 0.2, 0.05]},
                                   "smart_lambda_sst": {"quniform": [1, 2, 1]}}, name)
    trained = []
    for i in range(6):
        config = limiter.suggest(f"t{i}")
        trained.append((round(config["dropout"], 9), config["smart_lambda_sst"]))
        limiter.on_trial_complete(f"t{i}", {"val/overall": _score(config)})
    assert len(set(trained)) == 6, trained
    # TPE repeats itself in a space this small: the repeats were answered, not trained
    assert searcher.repeats_told > 0
    study = searcher._ot_study
    for trial in study.trials:  # a told repeat carries its twin's score
        twin = next(t for t in study.trials if t.params == trial.params)
        assert trial.value == pytest.approx(twin.value)
    # every configuration tried: after MAX_ASKS repeats in a row the repeat trains
    told = searcher.repeats_told
    config = limiter.suggest("t6")
    assert (round(config["dropout"], 9), config["smart_lambda_sst"]) in trained
    assert searcher.repeats_told == told + MAX_ASKS - 1


def test_a_continuous_space_asks_once_per_trial():
    limiter, searcher = _searcher({"dropout": {"uniform": [0.1, 0.5]},
                                   "smart_lambda_sst": {"uniform": [1, 5]}})
    for i in range(8):
        config = limiter.suggest(f"t{i}")
        limiter.on_trial_complete(f"t{i}", {"val/overall": _score(config)})
    assert searcher.repeats_told == 0 and len(searcher._ot_study.trials) == 8


def test_running_trials_limiter_frees_paused_places_and_tells_the_first_rung():
    """Under asha-promote: a paused trial frees its place (a ConcurrencyLimiter would stop
    proposing with 2 trials paused), a promoted one takes one; each trial is told to
    Optuna once, at its first result at or past the first rung, on the rung metric."""
    space = parse_space({"description": "d", "params": {"dropout": {"uniform": [0.1, 0.5]}}},
                        "test.yaml")
    limiter = build_searcher("optuna", seed=0, max_concurrent=2, num_samples=9,
                             scheduler="asha-promote", first_rung=48,
                             rung_metric="val/overall_soft")
    assert limiter.set_search_properties("val/overall", "max", space.param_space())
    study = limiter.searcher._ot_study
    assert limiter.suggest("a") and limiter.suggest("b")
    assert limiter.suggest("c") is None  # two running
    limiter.on_trial_result("a", {"examples_seen": 16, "val/overall": 0.3,
                                  "val/overall_soft": 0.2})
    assert study.trials[0].value is None  # before the first rung: not told
    for trial_id, soft in (("a", 0.41), ("b", 0.47)):
        limiter.on_trial_result(trial_id, {"examples_seen": 50, "val/overall": 0.43,
                                           "val/overall_soft": soft})
    assert [t.value for t in study.trials] == [0.41, 0.47]
    limiter.on_pause("a")
    limiter.on_pause("b")
    assert limiter.suggest("c") and limiter.suggest("d")  # the paused freed their places
    limiter.on_pause("c")
    limiter.on_unpause("b")  # c's arrival promoted b: the place goes to b
    assert limiter.suggest("e") is None
    # b's later result and its end are not told again; a stopped paused trial frees nothing
    limiter.on_trial_result("b", {"examples_seen": 144, "val/overall": 0.6,
                                  "val/overall_soft": 0.55})
    limiter.on_trial_complete("b", {"examples_seen": 192, "val/overall": 0.62})
    limiter.on_trial_complete("a")
    assert [t.value for t in study.trials[:2]] == [0.41, 0.47]
    assert limiter.suggest("e")  # b's end freed its place: d and e run


@pytest.mark.parametrize("name, scheduler", [("optuna", "asha-promote"), ("optuna-mv", "asha"),
                                             ("random", "asha")])
def test_given_points_are_proposed_first_in_order(name, scheduler):
    """``--points``: the searcher proposes the given configurations first, in order (Ray's
    points_to_evaluate), then its own."""
    space = parse_space({"description": "d", "params": {
        "dropout": {"uniform": [0.1, 0.5]}, "batch_size": {"choice": [8, 16]}}}, "t.yaml")
    points = [{"dropout": 0.123, "batch_size": 16}, {"dropout": 0.456, "batch_size": 8}]
    searcher = build_searcher(name, seed=0, max_concurrent=3, num_samples=3,
                              scheduler=scheduler, first_rung=48, points=points)
    if name == "random":
        from ray.tune.experiment import Experiment
        searcher.add_configurations(Experiment("x", lambda config: None, num_samples=3,
                                               config=space.param_space()))
        configs = [searcher.next_trial().config for _ in range(3)]
        proposed = [{k: c[k] for k in points[0]} for c in configs]
    else:
        assert searcher.set_search_properties("val/overall", "max", space.param_space())
        proposed = [searcher.suggest(f"t{i}") for i in range(3)]
    assert proposed[:2] == points
    assert proposed[2] not in points and 0.1 <= proposed[2]["dropout"] <= 0.5
