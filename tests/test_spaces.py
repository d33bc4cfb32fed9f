"""Search spaces: the shipped files load, map onto Ray Tune / Optuna, and every bad file
is one clear SpaceError naming the file and the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from mtbert.core.config import TrainConfig
from mtbert.tune.search.spaces import (SpaceError, available_spaces, default_spaces_dir,
                                       list_spaces, load_space)

REQUIRED = ("smart", "sampler", "pcgrad", "arch", "pretrain", "full", "smoke")


def test_shipped_spaces_load_and_cover_the_issue():
    names = available_spaces()
    for name in REQUIRED:
        assert name in names
    listed = dict(list_spaces())
    assert not [n for n, d in listed.items() if d.startswith("INVALID")]
    smart = load_space("smart")
    assert {"smart_lambda_sst", "smart_lambda_qqp", "smart_lambda_sts", "smart_eps", "smart_mu",
            "lr", "dropout", "batch_size"} <= set(smart.searched)
    assert {"schedule", "round_robin_mode", "steps_per_epoch", "update"} <= set(
        load_space("sampler").searched)
    assert load_space("pcgrad").fixed == {"update": "summed"}
    assert {"pair_encoding", "shared_pair_layer", "sts_head", "sts_loss", "pooling"} <= set(
        load_space("arch").searched)
    full = load_space("full")
    assert {"batch_size", "lr", "dropout", "weight_decay", "smart_lambda_sst", "schedule",
            "pcgrad"} <= set(full.searched)


@pytest.mark.parametrize("name", REQUIRED)
def test_every_sampled_config_is_a_valid_train_config(name):
    """Random draws of each space build a valid TrainConfig (no conflicting combos)."""
    import numpy as np
    space = load_space(name)
    rng = np.random.default_rng(0)
    domains = space.param_space()
    for _ in range(20):
        config = {k: (v.sample(random_state=rng) if hasattr(v, "sample") else v)
                  for k, v in domains.items()}
        cfg = TrainConfig.from_dict(config)
        for key, p in space.searched.items():
            value = getattr(cfg, key)
            if p.dist == "choice":
                assert value in p.choices
            else:
                assert p.low <= value <= p.high


def test_distributions_map_to_ray_and_optuna(tmp_path):
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution
    from ray.tune.search.sample import Categorical, Float, Integer
    path = tmp_path / "mixed.yaml"
    path.write_text(
        "description: all kinds\n"
        "params:\n"
        "  lr: {loguniform: [1.0e-5, 1e-3]}\n"      # '1e-3' is a YAML string: still a number
        "  dropout: {uniform: [0.0, 0.5]}\n"
        "  smart_steps: {randint: [1, 3]}\n"
        "  schedule: {choice: [sqrt, annealed]}\n"
        "  pcgrad: {fixed: true}\n"
        "  update: summed\n", encoding="utf-8")
    space = load_space(str(path))
    ps = space.param_space()
    assert isinstance(ps["lr"], Float) and ps["lr"].lower == 1e-5 and ps["lr"].upper == 1e-3
    assert isinstance(ps["smart_steps"], Integer)
    assert (ps["smart_steps"].lower, ps["smart_steps"].upper) == (1, 4)  # Ray: upper exclusive
    assert isinstance(ps["schedule"], Categorical) and ps["schedule"].categories == ["sqrt", "annealed"]
    assert ps["pcgrad"] is True and ps["update"] == "summed"
    od = space.optuna_distributions()
    assert od["lr"] == FloatDistribution(1e-5, 1e-3, log=True)
    assert od["dropout"] == FloatDistribution(0.0, 0.5)
    assert od["smart_steps"] == IntDistribution(1, 3)
    assert od["schedule"] == CategoricalDistribution(["sqrt", "annealed"])
    assert set(od) == {"lr", "dropout", "smart_steps", "schedule"}
    assert space.fixed == {"pcgrad": True, "update": "summed"}


def test_quniform_samples_only_the_steps_in_ray_and_optuna(tmp_path):
    """A stepped range draws low, low + step, ..., high -- the ends included -- through
    Ray's own sampling and through Optuna's TPE (what OptunaSearch builds from it)."""
    import numpy as np
    import optuna
    from optuna.distributions import FloatDistribution
    path = tmp_path / "stepped.yaml"
    path.write_text("description: steps\nparams:\n  dropout: {quniform: [0.1, 0.5, 0.05]}\n"
                    "  smart_lambda_sst: {quniform: [1, 5, 1]}\n", encoding="utf-8")
    space = load_space(str(path))
    assert space.searched["dropout"].describe() == "quniform [0.1, 0.5, step 0.05]"
    assert space.to_dict()["params"]["dropout"] == {"quniform": [0.1, 0.5, 0.05]}
    rng = np.random.default_rng(0)
    drawn = {round(space.param_space()["dropout"].sample(random_state=rng), 9)
             for _ in range(400)}
    assert drawn == {round(0.1 + 0.05 * k, 9) for k in range(9)}
    od = space.optuna_distributions()
    assert od["dropout"] == FloatDistribution(0.1, 0.5, step=0.05)
    # the searcher the driver builds: Ray's OptunaSearch over the Ray domains, TPE past
    # its random start-up trials
    from ray.tune.search.optuna import OptunaSearch
    searcher = OptunaSearch(space=space.param_space(), metric="score", mode="max",
                            sampler=optuna.samplers.TPESampler(seed=0, n_startup_trials=3))
    seen = []
    for i in range(10):
        config = searcher.suggest(f"t{i}")
        seen.append((config["dropout"], config["smart_lambda_sst"]))
        searcher.on_trial_complete(f"t{i}", {"score": -config["dropout"]})
    assert {round(d, 9) for d, _ in seen} <= drawn
    assert {lam for _, lam in seen} <= {1.0, 2.0, 3.0, 4.0, 5.0}


BAD = {
    "unknown_key": ("params:\n  learning_rate: {loguniform: [1.0e-5, 1.0e-3]}\n",
                    "learning_rate: unknown trainer config key"),
    "data_field": ("params:\n  max_length: {choice: [64, 128]}\n",
                   "max_length: cannot be searched"),
    "model_field": ("params:\n  model: bert-base-uncased\n", "model: cannot be searched"),
    "budget_field": ("params:\n  epochs: {randint: [1, 3]}\n", "epochs: cannot be searched"),
    "unknown_dist": ("params:\n  lr: {normal: [0.0, 1.0]}\n", "lr: invalid distribution"),
    "two_dists": ("params:\n  lr: {uniform: [0.1, 0.2], loguniform: [0.1, 0.2]}\n",
                  "lr: invalid distribution"),
    "bare_list": ("params:\n  batch_size: [8, 16]\n", "batch_size: a bare list is ambiguous"),
    "bounds_order": ("params:\n  dropout: {uniform: [0.5, 0.1]}\n", "dropout: uniform needs low < high"),
    "bounds_range": ("params:\n  dropout: {uniform: [0.1, 0.95]}\n",
                     "dropout: uniform bound 0.95 is outside the valid range of dropout"),
    "open_low": ("params:\n  lr: {uniform: [0.0, 0.001]}\n",
                 "lr: uniform bound 0 is outside the valid range of lr (must be > 0)"),
    "log_zero": ("params:\n  weight_decay: {loguniform: [0.0, 0.1]}\n",
                 "weight_decay: loguniform needs low > 0"),
    "quniform_arity": ("params:\n  dropout: {quniform: [0.1, 0.5]}\n",
                       "dropout: quniform needs [low, high, step], got [0.1, 0.5]"),
    "quniform_off_step": ("params:\n  dropout: {quniform: [0.1, 0.5, 0.15]}\n",
                          "dropout: quniform needs low and high to be multiples of step"),
    "quniform_step": ("params:\n  dropout: {quniform: [0.1, 0.5, 0]}\n",
                      "dropout: quniform step must be > 0"),
    "quniform_on_int": ("params:\n  batch_size: {quniform: [8, 32, 8]}\n",
                        "batch_size: quniform needs a float field"),
    "float_dist_on_int": ("params:\n  batch_size: {uniform: [8, 32]}\n",
                          "batch_size: uniform needs a float field"),
    "randint_on_float": ("params:\n  lr: {randint: [1, 3]}\n", "lr: randint needs an integer field"),
    "randint_range": ("params:\n  smart_steps: {randint: [1, 20]}\n",
                      "smart_steps: randint bound 20 is outside the valid range"),
    "bad_choice": ("params:\n  schedule: {choice: [sqrt, zigzag]}\n",
                   "schedule='zigzag' is not one of"),
    "choice_out_of_range": ("params:\n  batch_size: {choice: [0, 8]}\n", "batch_size=0 must be >= 1"),
    "dup_choice": ("params:\n  batch_size: {choice: [8, 8]}\n", "batch_size: choice lists a value twice"),
    "empty_choice": ("params:\n  batch_size: {choice: []}\n", "batch_size: choice needs a non-empty list"),
    "bad_bound": ("params:\n  lr: {loguniform: [small, 1.0e-3]}\n", "lr: loguniform bound 'small' is not a number"),
    "bad_fixed": ("params:\n  pcgrad: maybe\n", "pcgrad='maybe' is not a valid bool"),
    "conflict": ("params:\n  pcgrad: {choice: [false, true]}\n",
                 "pcgrad: value True is invalid with the space's fixed values"),
    "fixed_conflict": ("params:\n  pcgrad: true\n  update: per_task\n",
                       "the fixed values are invalid together"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_space_names_file_and_key(tmp_path, case):
    body, expected = BAD[case]
    path = tmp_path / f"{case}.yaml"
    path.write_text("description: a bad space\n" + body, encoding="utf-8")
    with pytest.raises(SpaceError) as info:
        load_space(str(path))
    message = str(info.value)
    assert message.startswith(str(path)), message
    assert expected in message, message


@pytest.mark.parametrize("text, expected", [
    ("params: {lr: 0.1}\n", "description: expected a one-line text"),
    ("description: x\n", "params: expected a non-empty mapping"),
    ("description: x\nparams: {}\n", "params: expected a non-empty mapping"),
    ("description: x\nparams: {lr: 0.1}\nextra: 1\n", "extra: unknown top-level key"),
    ("- lr\n- dropout\n", "expected a mapping"),
    ("description: x\nparams: {lr: [0.1\n", "invalid YAML"),
])
def test_bad_space_structure(tmp_path, text, expected):
    path = tmp_path / "bad.yaml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(SpaceError) as info:
        load_space(str(path))
    assert str(info.value).startswith(str(path))
    assert expected in str(info.value)


def test_unknown_space_name_lists_known_ones():
    with pytest.raises(SpaceError) as info:
        load_space("no_such_space")
    assert "unknown search space" in str(info.value) and "smart" in str(info.value)
    with pytest.raises(SpaceError, match="no such file"):
        load_space("/nonexistent/space.yaml")


def test_list_spaces_marks_invalid_files(tmp_path):
    (tmp_path / "good.yaml").write_text("description: fine\nparams: {lr: 0.001}\n")
    (tmp_path / "bad.yaml").write_text("description: broken\nparams: {max_length: 64}\n")
    listed = dict(list_spaces(tmp_path))
    assert listed["good"].startswith("fine")
    assert listed["bad"].startswith("INVALID:") and "max_length" in listed["bad"]
    assert Path(default_spaces_dir()).name == "search_spaces"
