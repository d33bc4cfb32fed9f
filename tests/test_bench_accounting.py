"""The bookkeeping of bench/search_efficiency.py and bench/overhead.py on hand-made
timelines: compute counted by every trial up to each report, best-so-far, the time split
of a trial (the scripts themselves run real searches; see docs/bench/)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from bench import (mps_exit, overhead, quality, search_efficiency, search_grid, search_methods,
                   search_report, search_stats, step_shapes, worker_start)

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def se():
    """The command line and runs.json."""
    return search_efficiency


@pytest.fixture(scope="module")
def methods():
    return search_methods


@pytest.fixture(scope="module")
def stats():
    return search_stats


@pytest.fixture(scope="module")
def grid_stats():
    return search_grid


@pytest.fixture(scope="module")
def report():
    return search_report


def two_trials():
    # trial A: enters at 100, reports 30 examples at 110 and 60 at 120 (score .5, .7);
    # trial B: enters at 105, reports 60 examples at 125 (score .6)
    return {"started": 95.0, "trials": [
        {"trial": "A", "entered_at": 100.0, "reports": [
            {"at": 110.0, "examples": 30, "score": 0.5},
            {"at": 120.0, "examples": 60, "score": 0.7}]},
        {"trial": "B", "entered_at": 105.0, "reports": [
            {"at": 125.0, "examples": 60, "score": 0.6}]}]}


def test_curve_counts_the_compute_of_trials_still_running(stats):
    points = stats.curve(two_trials())
    assert [p["wall_s"] for p in points] == [15.0, 25.0, 30.0]
    assert [p["best"] for p in points] == [0.5, 0.7, 0.7]
    # at t=110: A has 30 examples, B (entered 105, 60 examples at 125) 5/20 of 60 = 15
    assert points[0]["examples"] == pytest.approx(45.0)
    assert points[1]["examples"] == pytest.approx(60 + 60 * 15 / 20)
    assert points[2]["examples"] == pytest.approx(120.0)
    # trial-seconds: A 10 + B 5 at 110; A stops counting after its last report (20 s)
    assert points[0]["trial_s"] == pytest.approx(15.0)
    assert points[2]["trial_s"] == pytest.approx(20.0 + 20.0)


def test_first_reaching_and_full_training(stats):
    points = stats.curve(two_trials())
    assert stats.first_reaching(points, 0.6)["wall_s"] == 25.0  # A's 0.7 at 120 comes first
    assert stats.first_reaching(points, 0.71) is None
    assert stats.full_training_s(two_trials()) == pytest.approx(20.0)  # median of 20 and 20


def test_seed_figures_against_the_grid_and_means_over_seeds(stats):
    """A method compared with the same seed's grid: the compute share at which it first
    reaches the grid's best, its wall time over one grid training, and its selected
    trial's dev against the grid's; means over seeds are None if any seed never reached."""
    grid = {**two_trials(), "seed": 0, "num_trials": 2, "errors": 0, "wall_s": 30.0,
            "selected": {"dev": 0.60, "dev_se": 0.02, "val": 0.7, "val_se": 0.02}}
    fast = {"seed": 0, "num_trials": 1, "errors": 0, "started": 0.0, "wall_s": 30.0,
            "trials": [{"trial": "C", "entered_at": 0.0, "reports": [
                {"at": 10.0, "examples": 20, "score": 0.72}]}],
            "selected": {"dev": 0.59, "dev_se": 0.02, "val": 0.72, "val_se": 0.02}}
    f = stats.seed_figures(fast, grid)
    assert f["examples_to_grid_best_ratio"] == pytest.approx(20 / 120)
    assert f["trial_s_to_grid_best_ratio"] == pytest.approx(10 / 40)
    assert f["wall_vs_one_training"] == pytest.approx(30 / 20)
    assert f["dev_within_one_se_of_grid"] is True  # 0.59 >= 0.60 - 0.02
    slow = {**fast, "seed": 1, "trials": [{**fast["trials"][0], "reports": [
        {"at": 10.0, "examples": 20, "score": 0.65}]}], "selected": {**fast["selected"], "dev": 0.5}}
    g = stats.seed_figures(slow, {**grid, "seed": 1})
    assert g["examples_to_grid_best_ratio"] is None and g["dev_within_one_se_of_grid"] is False
    summary = stats.summarise({"grid": {0: grid, 1: {**grid, "seed": 1}},
                            "asha_tpe": {0: fast, 1: slow}})
    assert summary["asha_tpe"]["seeds"] == [0, 1]
    assert summary["asha_tpe"]["examples_to_grid_best_ratio"] == {
        "mean": None, "sd": None, "n": 2, "reached": 1}
    assert summary["asha_tpe"]["wall_vs_one_training"]["mean"] == pytest.approx(1.5)
    assert summary["asha_tpe"]["selected_dev"]["mean"] == pytest.approx(0.545)
    assert summary["asha_tpe"]["selected_dev"]["sd"] == pytest.approx(0.0636, abs=1e-4)


def test_rank_methods_orders_by_targets_met_then_dev_then_compute(stats):
    """The default's rule: targets met per seed (mean), then the selected dev, then fewer
    examples; the baselines (grid, random), a pair on another space than the continuous
    one and methods with fewer than 3 seeds are not candidates."""
    def seed_row(ratio, wall, within, dev, examples):
        return {"examples_to_grid_best_ratio": ratio, "wall_vs_one_training": wall,
                "dev_within_one_se_of_grid": within, "selected_dev": dev,
                "examples": examples}

    def method(*rows):
        return {"label": "m", "seeds": list(range(len(rows))), "per_seed": list(rows),
                **{k: stats.mean_sd([r[k] for r in rows]) for k in ("selected_dev", "examples")}}
    assert stats.targets_met(seed_row(0.3, 1.9, True, 0.6, 1)) == 3
    assert stats.targets_met(seed_row(None, 1.9, False, 0.6, 1)) == 1  # never reached
    assert stats.targets_met(seed_row(1 / 3, 2.0, True, 0.6, 1)) == 3  # the bounds are met
    summary = {
        # the baselines are not candidates, whatever their figures
        "grid": method(*[seed_row(0.5, 5, True, 0.7, 20000)] * 3),
        "random": method(*[seed_row(0.1, 1, True, 0.9, 20000)] * 3),
        # 1 target in every seed, the best dev
        "dev_only": method(*[seed_row(None, 3.0, True, 0.70, 9000)] * 3),
        # 2, 1, 1 targets: mean 1.33 beats dev_only despite a lower dev
        "cheap": method(seed_row(0.2, 1.5, False, 0.60, 5000),
                        seed_row(None, 1.5, False, 0.61, 5000),
                        seed_row(None, 1.8, False, 0.62, 5000)),
        # ties dev_only on targets and dev, spends fewer examples: ranked above it
        "dev_cheaper": method(*[seed_row(None, 3.0, True, 0.70, 8000)] * 3),
        "two_seeds": method(*[seed_row(0.1, 1.0, True, 0.9, 100)] * 2),
        "asha_tpe_indep_steps": method(*[seed_row(0.1, 1.0, True, 0.9, 100)] * 3),
    }
    ranking = stats.rank_methods(summary)
    assert [r["method"] for r in ranking] == ["cheap", "dev_cheaper", "dev_only"]
    assert ranking[0]["targets_met_per_seed"] == [2, 1, 1]
    assert ranking[0]["targets_met_mean"] == pytest.approx(4 / 3)


def test_the_drivers_default_is_the_pair_the_benchmark_ranks_first(se, methods, stats):
    """The default is the one the benchmark shows best.  The committed
    docs/search_efficiency.json holds the figures of every measured method and their
    ranking; the ranking is rank_methods' over those figures, and its first is the
    driver's default pair."""
    doc = json.loads((Path(se.REPO) / "docs" / "search_efficiency.json").read_text())
    assert len(doc["seeds"]) >= 3
    assert [r["method"] for r in stats.rank_methods(doc["methods"])] == [
        r["method"] for r in doc["ranking"]]
    assert len(doc["ranking"]) >= 4  # random and the scheduler/searcher pairs, 3 seeds each
    assert doc["ranking"][0]["method"] == doc["default"]["method"] == methods.DEFAULT_METHOD


def _grid_run(seed: int, score) -> dict:
    return {"seed": seed, "trials": [
        {"config": {"dropout": d, "smart_lambda_sst": lam}, "best_val": score(d, lam, seed)}
        for d in (0.1, 0.2, 0.3, 0.4, 0.5) for lam in (1.0, 5.0)]}


def test_grid_analysis_separates_what_decides_the_grid_from_noise(grid_stats):
    """Scores that fall with dropout, a seed offset, a fixed lambda effect and a small
    interaction: the analysis finds the ranking alike over seeds, the per-dropout means,
    lambda's effect exactly, and the interaction as the residual."""
    wobble = {0: 0.004, 1: -0.004, 2: 0.0}
    def score(d, lam, seed):
        return 0.7 - 0.5 * d + 0.01 * seed + (0.002 if lam == 5.0 else 0.0) + (
            wobble[seed] if d == 0.3 else 0.0)
    a = grid_stats.grid_analysis({s: _grid_run(s, score) for s in (0, 1, 2)})
    assert a["seeds"] == [0, 1, 2]
    assert all(r["rho"] == pytest.approx(1.0) for r in a["spearman_between_seeds"])
    assert len(a["spearman_between_seeds"]) == 3
    assert a["mean_val_by_dropout"]["0.1"] == pytest.approx(0.7 - 0.05 + 0.01 + 0.001)
    assert a["lambda_effect"]["mean"] == pytest.approx(0.002)
    assert a["lambda_effect"]["max_abs"] == pytest.approx(0.002)
    assert a["anova_configs"]["p"] < 1e-6
    assert 0 < a["residual_sd"] < 0.004
    assert a["best_config_per_seed"]["0"] == [0.1, 5.0]
    # scores that do not depend on the configuration: no shared ranking, no effect
    noise = {(d, lam, s): v for (d, lam, s), v in zip(
        [(d, lam, s) for s in (0, 1, 2) for d in (0.1, 0.2, 0.3, 0.4, 0.5) for lam in (1.0, 5.0)],
        __import__("numpy").random.default_rng(0).normal(0.6, 0.01, 30))}
    b = grid_stats.grid_analysis({s: _grid_run(s, lambda d, lam, s_: noise[(d, lam, s_)])
                          for s in (0, 1, 2)})
    assert b["anova_configs"]["p"] > 0.05
    # one seed: nothing to compare
    assert grid_stats.grid_analysis({0: _grid_run(0, score)}) is None
    ceiling = b["reach_ceiling"]
    assert ceiling["every_seed"]["1"] == pytest.approx(ceiling["per_seed"]["1"] ** 3)
    assert 0 < ceiling["per_seed"]["1"] < ceiling["per_seed"]["2"] < ceiling["per_seed"]["3"] < 1


def test_reach_ceiling_against_its_closed_forms(grid_stats):
    """k trainings of the best configuration against the grid's best: ten equal
    configurations give k / (k + 10) (the grid's maximum is any of the 10 + k draws
    equally); one configuration far above the rest, k / (k + 1)."""
    equal = grid_stats.reach_ceiling([0.7] * 10, 0.01)
    far = grid_stats.reach_ceiling([0.9] + [0.5] * 9, 0.01)
    for k in (1, 2, 3):
        assert equal[k] == pytest.approx(k / (k + 10), abs=0.01)
        assert far[k] == pytest.approx(k / (k + 1), abs=0.01)


def test_bench_budget_puts_the_rungs_where_the_method_says(methods):
    import argparse
    args = argparse.Namespace(full_examples=2000, warmup_examples=96, train_rows=1000,
                              eval_rows=300, trials=9)
    assert methods.bench_budget(args, methods.METHODS["asha_tpe"]).rungs() == [222, 666, 1998]
    late = methods.bench_budget(args, methods.METHODS["asha_tpe_late"])
    assert late.grace_period == 666 and late.rungs() == [666, 1998]
    assert methods.bench_budget(args, methods.METHODS["grid"]).eval_every == 2000
    for population in ("pbt", "pb2"):  # compared every full / 6, no growth
        budget = methods.bench_budget(args, methods.METHODS[population])
        assert (budget.eval_every, budget.eval_growth) == (333, 1)
    # the driver's pair and rung metric
    assert methods.DEFAULT_METHOD == "asha_promote_staged_last"


def test_first_rung_spread(grid_stats):
    run = {"trials": [
        {"best_val_se": 0.02, "reports": [{"examples": 224, "score": 0.41},
                                          {"examples": 672, "score": 0.5}]},
        {"best_val_se": 0.01, "reports": [{"examples": 220, "score": 0.43}]},
        {"reports": []}]}
    f = grid_stats.first_rung_spread(run)
    assert f["spread"] == pytest.approx(0.02) and f["examples"] == 222
    assert f["val_se"] == pytest.approx(0.015)
    assert grid_stats.first_rung_spread({"trials": run["trials"][:1]}) is None


def test_overhead_trial_split_adds_up_to_the_wall_time():
    reports = [{"pid": 7, "timestamp": 160, "examples_seen": 500, "time/entered_at": 103.0,
                "time/startup_s": 4.0, "time/setup_s": 2.5, "time/train_s": 40.0,
                "time/eval_s": 8.0, "time/checkpoint_s": 1.0, "time/cpu_s": 90.0}]
    actors = {7: {"pid": 7, "requested": 100.0, "ready": 101.0, "end": 160.0}}
    (row,) = overhead.trial_table({"trial_x": reports}, actors)
    assert row["wall_s"] == pytest.approx(60.0)
    assert row["launch_s"] == pytest.approx(3.0)
    parts = ("launch_s", "startup_s", "train_s", "eval_s", "ckpt_s", "rest_s")
    assert sum(row[k] for k in parts) == pytest.approx(row["wall_s"])
    assert row["rest_s"] == pytest.approx(60 - 3 - 4 - 40 - 8 - 1)
    assert row["share"] == pytest.approx(48 / 60)
    # a trial whose actor Ray no longer lists is left out, not guessed
    assert overhead.trial_table({"trial_y": [{**reports[0], "pid": 8}]}, actors) == []


def test_overhead_per_checkpoint_figures():
    """Bytes and seconds per checkpoint from a trial's last report; the stall's share of
    the training time the trial would take at 5,000 examples/s."""
    base = {"pid": 7, "timestamp": 160, "time/entered_at": 103.0, "time/startup_s": 4.0,
            "time/setup_s": 2.5, "time/train_s": 40.0, "time/eval_s": 8.0}
    reports = [{**base, "examples_seen": 0, "checkpoint_dir_name": None},
               {**base, "examples_seen": 1000, "checkpoint_dir_name": "checkpoint_000000"},
               {**base, "examples_seen": 2000, "checkpoint_dir_name": "checkpoint_000001",
                "time/checkpoint_s": 0.2, "checkpoints_written": 2,
                "checkpoint_bytes": 2 * 300 * 2**20, "time/checkpoint_write_s": 1.5,
                "time/report_s": 0.8}]
    actors = {7: {"pid": 7, "requested": 100.0, "ready": 101.0, "end": 160.0}}
    (row,) = overhead.trial_table({"t": reports}, actors)
    f = overhead.checkpoint_figures(row)
    assert f["checkpoints"] == 2 and f["mib"] == pytest.approx(300)
    assert f["write_s"] == pytest.approx(0.75) and f["report_s"] == pytest.approx(0.4)
    assert f["stall_s"] == pytest.approx(0.1)  # 2 reports before the last
    assert f["stall_share_at_gpu_speed"] == pytest.approx(0.1 * 2 / (2000 / 5000))
    # a trainer that reports no checkpoint figures: unknown, not zero
    old = [{k: v for k, v in r.items() if k in base or k in ("examples_seen",
            "checkpoint_dir_name", "time/checkpoint_s")} for r in reports]
    (old_row,) = overhead.trial_table({"t": old}, actors)
    assert overhead.checkpoint_figures(old_row)["mib"] is None


def test_quality_threshold_maximises_accuracy_and_table_marks_missing_cells():
    import numpy as np
    scores = np.array([0.1, 0.4, 0.35, 0.8, 0.9, 0.6])
    gold = np.array([0, 0, 1, 1, 1, 0])
    cut = quality.best_threshold(scores, gold)
    # sorted: 0.1(0) 0.35(1) 0.4(0) 0.6(0) 0.8(1) 0.9(1): the best cut lies between 0.6 and
    # 0.8 and gets 5 of 6 right (only 0.35 wrong); no cut does better
    assert 0.6 < cut < 0.8
    assert ((scores > cut) == gold).mean() == pytest.approx(5 / 6)
    assert max(((scores > c) == gold).mean() for c in np.linspace(0, 1, 101)) == pytest.approx(5 / 6)
    row = {"overall": 0.5, "sst_acc": 0.25, "qqp_acc": 0.75, "sts_corr": 0.125}
    text = quality.table([("x", None, row)])
    assert text.splitlines()[-1] == "| x | – | – | – | – | 0.500 | 0.250 | 0.750 | 0.125 |"


def test_step_shapes_splits_first_of_a_shape_steps_from_repeats(tiny_model_dir,
                                                               tiny_data_dir, capsys):
    """bench/step_shapes.py on the tiny model (CPU, eager): every step lands in exactly one
    of 'first step of its shapes' / 'shapes met before', one per distinct shape."""
    log = step_shapes.StepLog()
    assert log.add((("sst", ((4, 16),)),), 2.0, 4) and not log.add((("sst", ((4, 16),)),),
                                                                   0.5, 4)
    assert log.add((("sst", ((3, 16),)),), 1.0, 3)  # a partial batch is a new shape
    s = log.summary()
    assert (s["shapes"], s["steps"], s["repeat_steps"], s["first_of_shape_s"]) == (2, 3, 1, 3.0)
    assert s["repeat_examples_per_s"] == 8.0
    out = step_shapes.main(["--model", tiny_model_dir, "--data-dir", tiny_data_dir,
                            "--batch-size", "4", "--threads", "1", "--seconds", "3"])
    assert out["shapes"] >= 1 and out["steps"] == out["shapes"] + out["repeat_steps"]
    assert "steps on shapes met" in capsys.readouterr().out


def test_step_shapes_padding_ladders(tiny_model_dir, tiny_data_dir, capsys):
    """--padding: padded / real tokens of each ladder, never below the batch's longest row
    (the least padding a batch can have), coarser ladders never below finer ones."""
    out = step_shapes.main(["--model", tiny_model_dir, "--data-dir", tiny_data_dir,
                            "--batch-size", "4", "--padding"])
    assert set(out) == {"sst/single", "qqp/cross", "sts/cross", "qqp/siamese", "sts/siamese"}
    for ratios in out.values():
        assert 1.0 <= ratios["longest row"] <= ratios["16/32/48/64/96/128"]
        assert ratios["16/32/48/64/96/128"] <= ratios["32/64/128"]
    assert "padded tokens / real tokens" in capsys.readouterr().out


def test_gpu_trials_option_is_checked_and_kept_apart_from_cpu_runs(se, methods, tmp_path, capsys):
    """--gpus-per-trial: a share of one GPU, refused where torch sees no CUDA GPU; a
    runs.json from before the option (CPU runs) is reused on the CPU only."""
    import torch
    with pytest.raises(SystemExit):
        se.parse_args(["--gpus-per-trial", "2"])
    assert "expected a share of one GPU" in capsys.readouterr().err
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            se.parse_args(["--gpus-per-trial", "0.125", "--workers", "8"])
        assert "no CUDA GPU" in capsys.readouterr().err
    p, args = se.parse_args([])
    old = {k: getattr(args, k) for k in methods.SAME if k != "gpus_per_trial"}
    runs = tmp_path / "runs.json"
    runs.write_text(json.dumps({"args": old, "runs": {"grid": {"0": {"wall_s": 1.0}}}}))
    assert se.load_runs(runs, args, p) == {"grid": {0: {"wall_s": 1.0}}}
    p, gpu_args = se.parse_args(["--gpus-per-trial", "0.125", "--report-only"])
    with pytest.raises(SystemExit):
        se.load_runs(runs, gpu_args, p)
    assert "gpus_per_trial" in capsys.readouterr().err


def test_no_dashboard_option_starts_ray_without_one(se):
    """--no-dashboard (a machine whose Ray lacks ray[default]'s packages refuses a
    dashboard): the bench's Ray starts without one; by default it has one."""
    import ray

    from mtbert.tune.infra.cluster import dashboard_url, start_local_ray
    assert se.parse_args(["--report-only"])[1].no_dashboard is False
    _, args = se.parse_args(["--no-dashboard", "--report-only"])
    if ray.is_initialized():
        pytest.skip("a Ray session is already open in this process")
    start_local_ray(not args.no_dashboard, num_cpus=1)
    try:
        assert ray.cluster_resources()["CPU"] == 1
        assert dashboard_url() is None
    finally:
        ray.shutdown()


def test_report_names_the_machine_the_runs_ran_on_not_the_reporting_one(se, report, tmp_path):
    """--report-only on another machine: the figures' machine is the one each run kept
    (the GPU runs' docs/gpu_h200 JSON once read this CPU's); several: all of them."""
    kept = json.loads((REPO / "docs" / "gpu_h200" / "search_efficiency_runs.json")
                      .read_text(encoding="utf-8"))
    h200 = {"cpu_count": 16, "platform": "Linux-x86_64", "processor": "x86_64",
            "gpu": "NVIDIA H200"}
    for by_seed in kept["runs"].values():
        for run in by_seed.values():
            run["machine"] = h200
    out, docs = tmp_path / "out", tmp_path / "docs"
    out.mkdir()
    (out / "runs.json").write_text(json.dumps(kept), encoding="utf-8")
    settings = [f"--{k.replace('_', '-')}={v}" for k, v in kept["args"].items()]
    assert se.main(["--report-only", "--out", str(out), "--docs", str(docs), *settings]) == 0
    written = json.loads((docs / "search_efficiency.json").read_text(encoding="utf-8"))
    assert written["machine"] == h200
    assert written["default"]["wall_vs_one_training"] == pytest.approx(0.861, abs=0.001)
    kept["runs"]["grid"]["1"]["machine"] = {**h200, "gpu": "NVIDIA H100 80GB HBM3"}
    assert len(report.runs_machine({m: {int(k): r for k, r in by_seed.items()}
                                for m, by_seed in kept["runs"].items()})) == 2
    assert report.runs_machine({})["cpu_count"] == os.cpu_count()


def test_carried_figures_fill_in_methods_the_runs_lack(se, methods, report, tmp_path):
    """--carry-figures: an earlier search_efficiency.json's methods that runs.json lacks
    are kept (marked carried) and ranked beside the runs'; a method re-run is the run's;
    a file of other settings, or no such file, is refused."""
    _, args = se.parse_args(["--report-only"])
    settings = {k: getattr(args, k) for k in methods.SAME}
    earlier = {"settings": settings, "commands": ["python bench/search_efficiency.py x"],
               "methods": {"bohb": {"label": "B", "seeds": [0, 1, 2]},
                           "pbt": {"label": "P", "seeds": [0, 1, 2]},
                           "gone": {"label": "not a method any more"}},
               "first_rung": {"bohb": {"0": {"examples": 224, "spread": 0.01}}}}
    path = tmp_path / "earlier.json"
    path.write_text(json.dumps(earlier))
    carried = report.carried_figures(str(path), {"pbt": {0: {}}}, settings)
    assert sorted(carried) == ["bohb"]  # pbt was re-run; "gone" is no method
    assert carried["bohb"]["summary"] == {"label": "B", "seeds": [0, 1, 2], "carried": True}
    assert carried["bohb"]["first_rung"] == {"0": {"examples": 224, "spread": 0.01}}
    assert report.carried_figures(None, {}, settings) == {}
    path.write_text(json.dumps({**earlier, "settings": {**settings, "lr": 1.0}}))
    with pytest.raises(SystemExit, match="measured with other settings \\(lr\\)"):
        report.carried_figures(str(path), {}, settings)
    with pytest.raises(SystemExit, match="not a search_efficiency.json"):
        report.carried_figures(str(tmp_path / "missing.json"), {}, settings)


def test_worker_start_adds_import_seconds_by_package():
    """bench/worker_start.py sums ``-X importtime``'s self column by top-level package; the
    header, other output and malformed rows count for nothing."""
    text = "\n".join([
        "import time: self [us] | cumulative | imported package",
        "import time:      1500 |       1500 |     torch._C",
        "import time:    250000 |     251500 |   torch",
        "import time:     40000 |      40000 | transformers.utils",
        "WORKER_START {}",
        "import time: oops | 1 | broken",
        "import time:    500000 |     540000 | transformers"])
    assert worker_start.import_seconds_by_package(text) == pytest.approx(
        {"transformers": 0.54, "torch": 0.2515})
    assert list(worker_start.import_seconds_by_package(text)) == ["transformers", "torch"]


def test_worker_start_times_each_stage_of_processes_started_together(tmp_path, capsys):
    """Two worker-like processes at once (CPU, no model): each reports every CPU stage, its
    ready time covers them, and torch is among its imports."""
    assert worker_start.main(["--processes", "2", "--json",
                              str(tmp_path / "start.json")]) == 0
    results = json.loads((tmp_path / "start.json").read_text())["results"]
    assert len(results) == 2
    for r in results:
        assert set(r["stages"]) == {"python", "ray", "tune", "trainable", "data", "trainer"}
        assert r["ready_s"] >= sum(r["stages"].values()) > 0
        assert r["packages"]["torch"] > 0.1
    assert "the last ready after" in capsys.readouterr().out


def test_mps_exit_reads_the_fatal_errors_of_a_real_mps_server_log():
    """bench/mps_exit.py counts the MPS server's fatal GPU errors: the server.log kept by
    the full search on one H200 (2026-11-27) has one, client 3214's."""
    log = Path(__file__).resolve().parents[1] / "docs/gpu_h200/worker_exit_check/run2_mps_server.log"
    assert mps_exit.fatal_gpu_errors(log.read_text()) == [("2026-11-27 08:33:54.303", 3214)]
    assert mps_exit.fatal_gpu_errors("[2026-11-27 08:33:38.091 Server  1575] Client "
                                  "{PID: 3216, Context ID: 1} exiting.") == []


def test_mps_exit_needs_a_cuda_gpu(capsys):
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU: the bench would run")
    assert mps_exit.main(["--device", "cuda", "--leavers", "1"]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: bench/mps_exit.py needs a CUDA GPU (--device cuda)")


def test_mps_exit_runs_its_processes_and_reads_their_results(capsys):
    """The bench's processes on CPU stand-ins (no GPU, no MPS): survivors replay while each
    leaver comes, replays and is killed (``--mode kill``), then stop and report."""
    assert mps_exit.main(["--stand-in", "--survivors", "2", "--leavers", "3", "--replays",
                          "20", "--pause-s", "0.1", "--mode", "kill"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == "MPS off: --mps off; mode kill"
    for index, line in enumerate(lines[1:3]):
        replays = int(re.fullmatch(rf"survivor {index}: (\d+) replays, error: None", line)[1])
        assert replays > 0
    assert lines[3] == ("mode kill: 3 of 3 leavers left; 0 of 2 survivors failed; fatal GPU "
                        "errors in the MPS server's log: 0 []")
