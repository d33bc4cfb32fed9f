"""The driver's Optuna searcher (build_searcher -> ConcurrencyLimiter(DistinctOptunaSearch))
never trains a configuration that a finished trial already scored, while new ones are
left; in a continuous space it behaves as Ray's OptunaSearch."""

from __future__ import annotations

import pytest

from mtbert.tune.search import build_searcher
from mtbert.tune.searchers import MAX_ASKS
from mtbert.tune.spaces import parse_space


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
