"""Metrics arithmetic against hand-computed values; config validation names the key."""

from __future__ import annotations

import numpy as np
import pytest

from mtbert.core.config import TrainConfig, parse_set_args
from mtbert.core.errors import ConfigError
from scipy import stats

from mtbert.run.metrics import overall_score, pearson, split_metrics, task_metrics


def test_overall_score_hand_computed():
    # report 004's dev figures: (0.545 + 0.908 + (0.894 + 1) / 2) / 3 = 0.8000
    assert overall_score(0.545, 0.908, 0.894) == pytest.approx(0.8000, abs=5e-5)
    assert overall_score(0.2, 0.5, -1.0) == pytest.approx(0.7 / 3)
    metrics = split_metrics("val", {
        "sst": task_metrics("sst", np.array([0, 1, 2, 2]), np.array([0, 1, 2, 3])),
        "qqp": task_metrics("qqp", np.array([1, 1, 0, 0]), np.array([1, 0, 0, 0])),
        "sts": task_metrics("sts", np.array([1.0, 2.0, 3.0]), np.array([2.0, 4.0, 6.0])),
    })
    assert metrics["val/sst_acc"] == 0.75 and metrics["val/qqp_acc"] == 0.75
    assert metrics["val/sts_corr"] == pytest.approx(1.0)
    assert metrics["val/overall"] == pytest.approx((0.75 + 0.75 + 1.0) / 3)


def test_standard_errors_match_the_bootstrap():
    """The analytic standard errors beside every score agree with scipy's bootstrap of the
    same rows within 15 %, and overall's combines the three as independent terms."""
    rng = np.random.default_rng(0)
    n = 400
    sst_gold = rng.integers(0, 5, n)
    sst_pred = np.where(rng.random(n) < 0.45, sst_gold, rng.integers(0, 5, n))
    qqp_gold = rng.integers(0, 2, n)
    qqp_pred = np.where(rng.random(n) < 0.6, qqp_gold, 1 - qqp_gold)
    sts_gold = rng.uniform(0, 5, n)
    sts_pred = sts_gold + rng.normal(0, 1.5, n)
    m = split_metrics("val", {"sst": task_metrics("sst", sst_pred, sst_gold),
                              "qqp": task_metrics("qqp", qqp_pred, qqp_gold),
                              "sts": task_metrics("sts", sts_pred, sts_gold)})
    acc = m["val/sst_acc"]
    assert m["val/sst_acc_se"] == pytest.approx(np.sqrt(acc * (1 - acc) / n))
    r = m["val/sts_corr"]
    assert m["val/sts_corr_se"] == pytest.approx((1 - r * r) / np.sqrt(n - 3))
    assert m["val/overall_se"] == pytest.approx(np.sqrt(
        m["val/sst_acc_se"] ** 2 + m["val/qqp_acc_se"] ** 2 + (m["val/sts_corr_se"] / 2) ** 2)
        / 3)
    boot = dict(n_resamples=2000, random_state=1, method="percentile")
    sst_boot = stats.bootstrap(((sst_pred == sst_gold).astype(float),), np.mean, **boot)
    assert m["val/sst_acc_se"] == pytest.approx(sst_boot.standard_error, rel=0.15)
    sts_boot = stats.bootstrap((sts_pred, sts_gold), lambda a, b: stats.pearsonr(a, b).statistic,
                               paired=True, **boot)
    assert m["val/sts_corr_se"] == pytest.approx(sts_boot.standard_error, rel=0.15)


def test_overall_soft_from_gold_class_probabilities_hand_computed():
    """SST p_gold = the mean probability of each row's gold class (rows x 5), QQP's from
    p(duplicate) (1 - p where gold is 0); overall_soft puts them in overall's place, with
    the standard error of a mean, sd / sqrt(n)."""
    sst_p = np.array([[0.6, 0.1, 0.1, 0.1, 0.1],     # gold 0: 0.6
                      [0.2, 0.2, 0.2, 0.2, 0.2],     # gold 3: 0.2
                      [0.0, 0.0, 0.1, 0.0, 0.9]])    # gold 4: 0.9
    sst = task_metrics("sst", sst_p.argmax(1), np.array([0, 3, 4]), probabilities=sst_p)
    assert sst["sst_acc"] == pytest.approx(2 / 3)
    assert sst["sst_p_gold"] == pytest.approx((0.6 + 0.2 + 0.9) / 3)
    assert sst["sst_p_gold_se"] == pytest.approx(np.std([0.6, 0.2, 0.9], ddof=1) / np.sqrt(3))
    qqp_p = np.array([0.9, 0.3, 0.2, 0.6])
    qqp = task_metrics("qqp", (qqp_p >= 0.5).astype(int), np.array([1, 1, 0, 0]),
                       probabilities=qqp_p)
    assert qqp["qqp_p_gold"] == pytest.approx((0.9 + 0.3 + 0.8 + 0.4) / 4)
    sts = task_metrics("sts", np.array([1.0, 2.0, 3.0, 4.0]), np.array([1.0, 3.0, 2.0, 4.0]))
    m = split_metrics("val", {"sst": sst, "qqp": qqp, "sts": sts})
    r = m["val/sts_corr"]
    assert m["val/overall_soft"] == pytest.approx((1.7 / 3 + 0.6 + (r + 1) / 2) / 3)
    assert m["val/overall"] == pytest.approx((2 / 3 + 0.5 + (r + 1) / 2) / 3)
    assert m["val/overall_soft_se"] == pytest.approx(np.sqrt(
        sst["sst_p_gold_se"] ** 2 + qqp["qqp_p_gold_se"] ** 2 + (sts["sts_corr_se"] / 2) ** 2)
        / 3)
    # classes_soft: the two gold-class probabilities alone (STS r left out)
    assert m["val/classes_soft"] == pytest.approx((1.7 / 3 + 0.6) / 2)
    assert m["val/classes_soft_se"] == pytest.approx(np.sqrt(
        sst["sst_p_gold_se"] ** 2 + qqp["qqp_p_gold_se"] ** 2) / 2)
    # without probabilities (ensembles score hard labels) there is no soft score
    hard = split_metrics("val", {"sst": task_metrics("sst", sst_p.argmax(1), np.array([0, 3, 4])),
                                 "qqp": task_metrics("qqp", np.array([1, 0]), np.array([1, 1])),
                                 "sts": sts})
    assert "val/overall" in hard and "val/overall_soft" not in hard
    assert "val/classes_soft" not in hard


def test_precision_recall_f1_and_confusion():
    m = task_metrics("qqp", np.array([1, 1, 0, 0, 1]), np.array([1, 0, 0, 1, 1]))
    # tp = 2, fp = 1, fn = 1
    assert m["qqp_precision"] == pytest.approx(2 / 3) and m["qqp_recall"] == pytest.approx(2 / 3)
    assert m["qqp_f1"] == pytest.approx(2 / 3)
    s = task_metrics("sst", np.array([0, 0, 1, 4]), np.array([0, 1, 1, 4]))
    assert s["sst_confusion"][1] == [1, 1, 0, 0, 0] and s["sst_confusion"][4][4] == 1
    # per-class precision: c0 1/2, c1 1, c4 1, c2 c3 0 -> macro 2.5/5
    assert s["sst_precision_macro"] == pytest.approx(0.5)
    assert s["sst_recall_macro"] == pytest.approx((1 + 0.5 + 1) / 5)


def test_pearson_matches_definition_and_handles_constants():
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=50), rng.normal(size=50)
    assert pearson(x, y) == pytest.approx(np.corrcoef(x, y)[0, 1])
    assert pearson(np.ones(5), np.arange(5.0)) == 0.0


def test_config_rejects_unknown_and_invalid_values_naming_the_key():
    with pytest.raises(ConfigError, match="'learning_rate'") as err:
        TrainConfig.from_dict({"learning_rate": 1e-3})
    assert err.value.key == "learning_rate"
    cases = [({"lr": -1}, "lr"), ({"dropout": 1.5}, "dropout"), ({"schedule": "zigzag"}, "schedule"),
             ({"batch_size": 0}, "batch_size"), ({"epochs": 2.5}, "epochs"),
             ({"pcgrad": True}, "pcgrad"), ({"smart_lambda_sst": float("nan")}, "smart_lambda_sst"),
             ({"pcgrad": "maybe"}, "pcgrad")]
    for values, key in cases:
        with pytest.raises(ConfigError) as err:
            TrainConfig.from_dict(values)
        assert err.value.key == key and key in str(err.value)
    TrainConfig.from_dict({"pcgrad": True, "update": "summed"})  # valid together


def test_coercion_from_cli_and_yaml(tmp_path):
    values = parse_set_args(["lr=1e-5", "pcgrad=true", "update=summed", "epochs=2", "model=123"])
    cfg = TrainConfig.from_dict(values)
    assert cfg.lr == 1e-5 and cfg.pcgrad is True and cfg.epochs == 2 and cfg.model == "123"
    path = tmp_path / "c.yaml"
    path.write_text(cfg.to_yaml())
    assert TrainConfig.from_yaml(path) == cfg
    path.write_text("lr: [1, 2\n")
    with pytest.raises(ConfigError, match="invalid YAML"):
        TrainConfig.from_yaml(path)
    path.write_text("- lr\n")
    with pytest.raises(ConfigError, match="expected a mapping"):
        TrainConfig.from_yaml(path)
    with pytest.raises(ConfigError, match="expected key=value"):
        parse_set_args(["lr"])
