"""The bookkeeping of bench/search_efficiency.py and bench/overhead.py on hand-made
timelines: compute counted by every trial up to each report, best-so-far, the time split
of a trial (the scripts themselves run real searches; see README Results)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def se():
    return load("search_efficiency")


def two_trials():
    # trial A: enters at 100, reports 30 examples at 110 and 60 at 120 (score .5, .7);
    # trial B: enters at 105, reports 60 examples at 125 (score .6)
    return {"started": 95.0, "trials": [
        {"trial": "A", "entered_at": 100.0, "reports": [
            {"at": 110.0, "examples": 30, "score": 0.5},
            {"at": 120.0, "examples": 60, "score": 0.7}]},
        {"trial": "B", "entered_at": 105.0, "reports": [
            {"at": 125.0, "examples": 60, "score": 0.6}]}]}


def test_curve_counts_the_compute_of_trials_still_running(se):
    points = se.curve(two_trials())
    assert [p["wall_s"] for p in points] == [15.0, 25.0, 30.0]
    assert [p["best"] for p in points] == [0.5, 0.7, 0.7]
    # at t=110: A has 30 examples, B (entered 105, 60 examples at 125) 5/20 of 60 = 15
    assert points[0]["examples"] == pytest.approx(45.0)
    assert points[1]["examples"] == pytest.approx(60 + 60 * 15 / 20)
    assert points[2]["examples"] == pytest.approx(120.0)
    # trial-seconds: A 10 + B 5 at 110; A stops counting after its last report (20 s)
    assert points[0]["trial_s"] == pytest.approx(15.0)
    assert points[2]["trial_s"] == pytest.approx(20.0 + 20.0)


def test_first_reaching_and_full_training(se):
    points = se.curve(two_trials())
    assert se.first_reaching(points, 0.6)["wall_s"] == 25.0  # A's 0.7 at 120 comes first
    assert se.first_reaching(points, 0.71) is None
    assert se.full_training_s(two_trials()) == pytest.approx(20.0)  # median of 20 and 20


def test_seed_figures_against_the_grid_and_means_over_seeds(se):
    """A method compared with the same seed's grid: the compute share at which it first
    reaches the grid's best, its wall time over one grid training, and its selected
    trial's dev against the grid's; means over seeds are None if any seed never reached."""
    grid = {**two_trials(), "seed": 0, "num_trials": 2, "errors": 0, "wall_s": 30.0,
            "selected": {"dev": 0.60, "dev_se": 0.02, "val": 0.7, "val_se": 0.02}}
    fast = {"seed": 0, "num_trials": 1, "errors": 0, "started": 0.0, "wall_s": 30.0,
            "trials": [{"trial": "C", "entered_at": 0.0, "reports": [
                {"at": 10.0, "examples": 20, "score": 0.72}]}],
            "selected": {"dev": 0.59, "dev_se": 0.02, "val": 0.72, "val_se": 0.02}}
    f = se.seed_figures(fast, grid)
    assert f["examples_to_grid_best_ratio"] == pytest.approx(20 / 120)
    assert f["trial_s_to_grid_best_ratio"] == pytest.approx(10 / 40)
    assert f["wall_vs_one_training"] == pytest.approx(30 / 20)
    assert f["dev_within_one_se_of_grid"] is True  # 0.59 >= 0.60 - 0.02
    slow = {**fast, "seed": 1, "trials": [{**fast["trials"][0], "reports": [
        {"at": 10.0, "examples": 20, "score": 0.65}]}], "selected": {**fast["selected"], "dev": 0.5}}
    g = se.seed_figures(slow, {**grid, "seed": 1})
    assert g["examples_to_grid_best_ratio"] is None and g["dev_within_one_se_of_grid"] is False
    summary = se.summarise({"grid": {0: grid, 1: {**grid, "seed": 1}},
                            "asha_tpe": {0: fast, 1: slow}})
    assert summary["asha_tpe"]["seeds"] == [0, 1]
    assert summary["asha_tpe"]["examples_to_grid_best_ratio"] == {
        "mean": None, "sd": None, "n": 2, "reached": 1}
    assert summary["asha_tpe"]["wall_vs_one_training"]["mean"] == pytest.approx(1.5)
    assert summary["asha_tpe"]["selected_dev"]["mean"] == pytest.approx(0.545)
    assert summary["asha_tpe"]["selected_dev"]["sd"] == pytest.approx(0.0636, abs=1e-4)


def test_overhead_trial_split_adds_up_to_the_wall_time():
    oh = load("overhead")
    reports = [{"pid": 7, "timestamp": 160, "examples_seen": 500, "time/entered_at": 103.0,
                "time/startup_s": 4.0, "time/setup_s": 2.5, "time/train_s": 40.0,
                "time/eval_s": 8.0, "time/checkpoint_s": 1.0, "time/cpu_s": 90.0}]
    actors = {7: {"pid": 7, "requested": 100.0, "ready": 101.0, "end": 160.0}}
    (row,) = oh.trial_table({"trial_x": reports}, actors)
    assert row["wall_s"] == pytest.approx(60.0)
    assert row["launch_s"] == pytest.approx(3.0)
    parts = ("launch_s", "startup_s", "train_s", "eval_s", "ckpt_s", "rest_s")
    assert sum(row[k] for k in parts) == pytest.approx(row["wall_s"])
    assert row["rest_s"] == pytest.approx(60 - 3 - 4 - 40 - 8 - 1)
    assert row["share"] == pytest.approx(48 / 60)
    # a trial whose actor Ray no longer lists is left out, not guessed
    assert oh.trial_table({"trial_y": [{**reports[0], "pid": 8}]}, actors) == []


def test_quality_threshold_maximises_accuracy_and_table_marks_missing_cells():
    import numpy as np
    q = load("quality")
    scores = np.array([0.1, 0.4, 0.35, 0.8, 0.9, 0.6])
    gold = np.array([0, 0, 1, 1, 1, 0])
    cut = q.best_threshold(scores, gold)
    # sorted: 0.1(0) 0.35(1) 0.4(0) 0.6(0) 0.8(1) 0.9(1): the best cut lies between 0.6 and
    # 0.8 and gets 5 of 6 right (only 0.35 wrong); no cut does better
    assert 0.6 < cut < 0.8
    assert ((scores > cut) == gold).mean() == pytest.approx(5 / 6)
    assert max(((scores > c) == gold).mean() for c in np.linspace(0, 1, 101)) == pytest.approx(5 / 6)
    row = {"overall": 0.5, "sst_acc": 0.25, "qqp_acc": 0.75, "sts_corr": 0.125}
    text = q.table([("x", None, row)])
    assert text.splitlines()[-1] == "| x | – | – | – | – | 0.500 | 0.250 | 0.750 | 0.125 |"
