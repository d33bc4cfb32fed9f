"""The bookkeeping of bench/search_efficiency.py, bench/overhead.py and bench/quality.py
on hand-made timelines, each run as its command reporting on runs written here
(``--report-only``; the scripts themselves run real searches, see docs/bench/): compute
counted by every trial up to each report, best-so-far, the figures against the grid and
the ranking, what decides the grid, the time split of a trial."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO

#: the settings search_efficiency's runs share (its defaults, the model named apart)
SETTINGS = {"full_examples": 2000, "train_rows": 1000, "eval_rows": 300, "workers": 2,
            "lr": 1.5e-4, "batch_size": 16, "warmup_examples": 96, "trials": 9,
            "model": "m", "gpus_per_trial": 0.0}


def bench(module: str, *argv: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", f"bench.{module}", *argv], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


def flags(settings: dict) -> list[str]:
    return [f"--{k.replace('_', '-')}={v}" for k, v in settings.items()]


def efficiency(folder: Path, runs: dict, *more: str, settings: dict = SETTINGS) -> dict:
    """search_efficiency's report of ``runs`` ({method: {seed: run}}), ``--report-only``
    over a runs.json written in ``folder``: its search_efficiency.json, and the curves it
    wrote beside runs.json."""
    out, docs = folder / "out", folder / "docs"
    out.mkdir(parents=True)
    (out / "runs.json").write_text(json.dumps({"args": settings, "runs": runs}))
    done = bench("search_efficiency", "--report-only", "--out", str(out), "--docs", str(docs),
                 *flags(settings), *more)
    assert done.returncode == 0, done.stderr[-3000:]
    doc = json.loads((docs / "search_efficiency.json").read_text())
    doc["curves"] = json.loads((out / "curves.json").read_text())
    return doc


def trial(name: str, entered_at: float, reports: list[tuple], dropout: float = 0.1,
          lam: float = 1.0, se: float | None = None) -> dict:
    """A trial's record: its reports (at, examples, score), its configuration and best."""
    out = {"trial": name, "entered_at": entered_at,
           "config": {"dropout": dropout, "smart_lambda_sst": lam},
           "reports": [{"at": at, "examples": ex, "score": score} for at, ex, score in reports]}
    if reports:
        out["best_val"] = max(score for _, _, score in reports)
    if se is not None:
        out["best_val_se"] = se
    return out


def run(seed: int, trials: list[dict], started: float = 0.0, wall_s: float = 100.0,
        selected: dict | None = None) -> dict:
    out = {"seed": seed, "num_trials": len(trials), "errors": 0, "started": started,
           "wall_s": wall_s, "trials": trials, "command": "hand-made"}
    return {**out, "selected": selected} if selected else out


def two_trials(seed: int = 0, **more) -> dict:
    # trial A: enters at 100, reports 30 examples at 110 and 60 at 120 (score .5, .7);
    # trial B: enters at 105, reports 60 examples at 125 (score .6)
    return run(seed, [trial("A", 100.0, [(110.0, 30, 0.5), (120.0, 60, 0.7)]),
                      trial("B", 105.0, [(125.0, 60, 0.6)])], started=95.0, **more)


def one_report(seed: int, score: float) -> dict:
    """A run of one trial that reports ``score`` at 100 examples, 10 s in."""
    return run(seed, [trial("g", 0.0, [(10.0, 100, score)])])


@pytest.fixture(scope="module")
def timelines(tmp_path_factory):
    """The two trials above as a method's run against grids whose best is 0.6 (seed 0)
    and 0.71 (seed 2), and as the grid of seed 1 (a run of wall 30 against it)."""
    return efficiency(tmp_path_factory.mktemp("timelines"), {
        "grid": {0: one_report(0, 0.6), 1: two_trials(1), 2: one_report(2, 0.71)},
        "random": {0: two_trials(0), 1: run(1, [trial("r", 0.0, [(10.0, 100, 0.65)])],
                                           wall_s=30.0), 2: two_trials(2)}})


def test_curve_counts_the_compute_of_trials_still_running(timelines):
    points = timelines["curves"]["random"]["0"]
    assert [p["wall_s"] for p in points] == [15.0, 25.0, 30.0]
    assert [p["best"] for p in points] == [0.5, 0.7, 0.7]
    # at t=110: A has 30 examples, B (entered 105, 60 examples at 125) 5/20 of 60 = 15
    assert points[0]["examples"] == pytest.approx(45.0)
    assert points[1]["examples"] == pytest.approx(60 + 60 * 15 / 20)
    assert points[2]["examples"] == pytest.approx(120.0)
    # trial-seconds: A 10 + B 5 at 110; A stops counting after its last report (20 s)
    assert points[0]["trial_s"] == pytest.approx(15.0)
    assert points[2]["trial_s"] == pytest.approx(20.0 + 20.0)


def test_first_reaching_and_full_training(timelines):
    """The first point at the grid's best: A's 0.7 at 120 (wall 25: 105 examples, 35
    trial-seconds) reaches seed 0's 0.6 before B's 0.6 does; nothing reaches seed 2's
    0.71.  One full training of seed 1's grid: the median of its trials' 20 and 20 s."""
    per_seed = {f["seed"]: f for f in timelines["methods"]["random"]["per_seed"]}
    assert timelines["curves"]["random"]["0"][1]["wall_s"] == 25.0
    assert per_seed[0]["examples_to_grid_best_ratio"] == pytest.approx(105 / 100)
    assert per_seed[0]["trial_s_to_grid_best_ratio"] == pytest.approx(35 / 10)
    assert per_seed[2]["examples_to_grid_best_ratio"] is None
    assert per_seed[1]["wall_vs_one_training"] == pytest.approx(30.0 / 20.0)


@pytest.fixture(scope="module")
def against_the_grid(tmp_path_factory):
    """A fast and a slow method run against two seeds' grids; and a run's first
    evaluations: three trials (one without a report) in seed 0, one in seed 1."""
    grid = two_trials(0, wall_s=30.0,
                      selected={"dev": 0.60, "dev_se": 0.02, "val": 0.7, "val_se": 0.02})
    fast = run(0, [trial("C", 0.0, [(10.0, 20, 0.72)])], wall_s=30.0,
               selected={"dev": 0.59, "dev_se": 0.02, "val": 0.72, "val_se": 0.02})
    slow = {**fast, "seed": 1, "trials": [trial("C", 0.0, [(10.0, 20, 0.65)])],
            "selected": {**fast["selected"], "dev": 0.5}}
    firsts = run(0, [trial("a", 0.0, [(1.0, 224, 0.41), (2.0, 672, 0.5)], se=0.02),
                     trial("b", 0.0, [(1.5, 220, 0.43)], se=0.01), trial("c", 0.0, [])])
    return efficiency(tmp_path_factory.mktemp("against"), {
        "grid": {0: grid, 1: {**grid, "seed": 1}}, "asha_tpe": {0: fast, 1: slow},
        "bohb": {0: firsts, 1: {**firsts, "seed": 1, "trials": firsts["trials"][:1]}}})


def test_seed_figures_against_the_grid_and_means_over_seeds(against_the_grid):
    """A method compared with the same seed's grid: the compute share at which it first
    reaches the grid's best, its wall time over one grid training, and its selected
    trial's dev against the grid's; means over seeds are None if any seed never reached."""
    summary = against_the_grid["methods"]
    f, g = summary["asha_tpe"]["per_seed"]
    assert f["examples_to_grid_best_ratio"] == pytest.approx(20 / 120)
    assert f["trial_s_to_grid_best_ratio"] == pytest.approx(10 / 40)
    assert f["wall_vs_one_training"] == pytest.approx(30 / 20)
    assert f["dev_within_one_se_of_grid"] is True  # 0.59 >= 0.60 - 0.02
    assert g["examples_to_grid_best_ratio"] is None and g["dev_within_one_se_of_grid"] is False
    assert summary["asha_tpe"]["seeds"] == [0, 1]
    assert summary["asha_tpe"]["examples_to_grid_best_ratio"] == {
        "mean": None, "sd": None, "n": 2, "reached": 1}
    assert summary["asha_tpe"]["wall_vs_one_training"]["mean"] == pytest.approx(1.5)
    assert summary["asha_tpe"]["selected_dev"]["mean"] == pytest.approx(0.545)
    assert summary["asha_tpe"]["selected_dev"]["sd"] == pytest.approx(0.0636, abs=1e-4)


def test_first_rung_spread(against_the_grid):
    f = against_the_grid["first_rung"]["bohb"]["0"]
    assert f["spread"] == pytest.approx(0.02) and f["examples"] == 222
    assert f["val_se"] == pytest.approx(0.015)
    assert against_the_grid["first_rung"]["bohb"]["1"] is None  # one trial: no spread


def _mean_sd(values: list) -> dict:
    if any(v is None for v in values):
        return {"mean": None, "sd": None, "n": len(values),
                "reached": sum(v is not None for v in values)}
    return {"mean": statistics.fmean(values), "sd": statistics.stdev(values)
            if len(values) > 1 else 0.0, "n": len(values)}


def seed_row(ratio, wall, within, dev, examples):
    return {"examples_to_grid_best_ratio": ratio, "wall_vs_one_training": wall,
            "dev_within_one_se_of_grid": within, "selected_dev": dev, "examples": examples}


def method_summary(*rows) -> dict:
    """A method's figures over its seeds, as a report writes them."""
    per_seed = [{"seed": i, "best_val": 0.6, "errors": 0, **r} for i, r in enumerate(rows)]
    return {"label": "m", "seeds": list(range(len(rows))), "per_seed": per_seed,
            **{k: _mean_sd([f[k] for f in per_seed]) for k in (
                "best_val", "examples_to_grid_best_ratio", "wall_vs_one_training",
                "selected_dev", "examples")}}


def carried(folder: Path, methods: dict, runs: dict | None = None) -> dict:
    """The report of ``runs`` with an earlier search_efficiency.json holding ``methods``."""
    folder.mkdir()
    earlier = folder / "earlier.json"
    earlier.write_text(json.dumps({"settings": SETTINGS, "commands": ["earlier"],
                                   "methods": methods, "first_rung": {}}))
    return efficiency(folder, runs or {}, "--carry-figures", str(earlier))


def test_rank_methods_orders_by_targets_met_then_dev_then_compute(tmp_path):
    """The default's rule: targets met per seed (mean), then the selected dev, then fewer
    examples; the baselines (grid, random), a pair on another space than the continuous
    one and methods with fewer than 3 seeds are not candidates."""
    doc = carried(tmp_path / "ranked", {
        # the baselines are not candidates, whatever their figures
        "grid": method_summary(*[seed_row(0.5, 5, True, 0.7, 20000)] * 3),
        "random": method_summary(*[seed_row(0.1, 1, True, 0.9, 20000)] * 3),
        # 1 target in every seed, the best dev
        "asha_tpe": method_summary(*[seed_row(None, 3.0, True, 0.70, 9000)] * 3),
        # 2, 1, 1 targets: mean 1.33 beats asha_tpe despite a lower dev
        "asha_tpe_indep": method_summary(seed_row(0.2, 1.5, False, 0.60, 5000),
                                         seed_row(None, 1.5, False, 0.61, 5000),
                                         seed_row(None, 1.8, False, 0.62, 5000)),
        # ties asha_tpe on targets and dev, spends fewer examples: ranked above it
        "asha_tpe_late": method_summary(*[seed_row(None, 3.0, True, 0.70, 8000)] * 3),
        "bohb": method_summary(*[seed_row(0.1, 1.0, True, 0.9, 100)] * 2),  # two seeds
        "asha_tpe_indep_steps": method_summary(*[seed_row(0.1, 1.0, True, 0.9, 100)] * 3),
    })
    ranking = doc["ranking"]
    assert [r["method"] for r in ranking] == ["asha_tpe_indep", "asha_tpe_late", "asha_tpe"]
    assert ranking[0]["targets_met_per_seed"] == [2, 1, 1]
    assert ranking[0]["targets_met_mean"] == pytest.approx(4 / 3)
    # the targets of one seed: all three, one (never reached), all three on their bounds
    doc = carried(tmp_path / "targets", {"asha_tpe": method_summary(
        seed_row(0.3, 1.9, True, 0.6, 1), seed_row(None, 1.9, False, 0.6, 1),
        seed_row(1 / 3, 2.0, True, 0.6, 1))})
    assert doc["ranking"][0]["targets_met_per_seed"] == [3, 1, 3]
    assert doc["machine"]["cpu_count"] == os.cpu_count()  # no run: this machine's


def test_the_drivers_default_is_the_pair_the_benchmark_ranks_first(tmp_path):
    """The default is the one the benchmark shows best.  The committed
    docs/search_efficiency.json holds the figures of every measured method and their
    ranking; the ranking is the report's over those figures, and its first is the
    driver's default pair."""
    doc = json.loads((REPO / "docs" / "search_efficiency.json").read_text())
    assert len(doc["seeds"]) >= 3
    settings = {**SETTINGS, **doc["settings"]}
    again = efficiency(tmp_path, {}, "--carry-figures",
                       str(REPO / "docs" / "search_efficiency.json"), settings=settings)
    assert [r["method"] for r in again["ranking"]] == [r["method"] for r in doc["ranking"]]
    assert len(doc["ranking"]) >= 4  # random and the scheduler/searcher pairs, 3 seeds each
    assert doc["ranking"][0]["method"] == doc["default"]["method"] == \
        again["default"]["method"]


def _grid_run(seed: int, score) -> dict:
    return run(seed, [trial(f"{d}-{lam}", 0.0, [(1.0, 2000, score(d, lam, seed))], d, lam)
                      for d in (0.1, 0.2, 0.3, 0.4, 0.5) for lam in (1.0, 5.0)])


def grid_analysis(folder: Path, grids: dict) -> dict | None:
    return efficiency(folder, {"grid": grids})["grid_analysis"]


def test_grid_analysis_separates_what_decides_the_grid_from_noise(tmp_path):
    """Scores that fall with dropout, a seed offset, a fixed lambda effect and a small
    interaction: the analysis finds the ranking alike over seeds, the per-dropout means,
    lambda's effect exactly, and the interaction as the residual."""
    wobble = {0: 0.004, 1: -0.004, 2: 0.0}
    def score(d, lam, seed):
        return 0.7 - 0.5 * d + 0.01 * seed + (0.002 if lam == 5.0 else 0.0) + (
            wobble[seed] if d == 0.3 else 0.0)
    a = grid_analysis(tmp_path / "a", {s: _grid_run(s, score) for s in (0, 1, 2)})
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
        np.random.default_rng(0).normal(0.6, 0.01, 30))}
    b = grid_analysis(tmp_path / "b", {s: _grid_run(s, lambda d, lam, s_: noise[(d, lam, s_)])
                                       for s in (0, 1, 2)})
    assert b["anova_configs"]["p"] > 0.05
    # one seed: nothing to compare
    assert grid_analysis(tmp_path / "c", {0: _grid_run(0, score)}) is None
    ceiling = b["reach_ceiling"]
    assert ceiling["every_seed"]["1"] == pytest.approx(ceiling["per_seed"]["1"] ** 3)
    assert 0 < ceiling["per_seed"]["1"] < ceiling["per_seed"]["2"] < ceiling["per_seed"]["3"] < 1


def test_reach_ceiling_against_its_closed_forms(tmp_path):
    """k trainings of the grid's best configuration against the grid's best: ten equal
    configurations (means over two seeds 0.7 each) give k / (k + 10) (the grid's maximum
    is any of the 10 + k draws equally); one configuration far above the rest,
    k / (k + 1)."""
    def alike(d, lam, seed):  # each configuration 0.7 on average, the seeds +-0.01
        return 0.7 + (0.01 if (seed + round(d * 10) + (lam > 1)) % 2 else -0.01)

    def far(d, lam, seed):
        return alike(d, lam, seed) + (0.2 if (d, lam) == (0.1, 1.0) else -0.2)

    equal = grid_analysis(tmp_path / "equal", {s: _grid_run(s, alike) for s in (0, 1)})
    best = grid_analysis(tmp_path / "far", {s: _grid_run(s, far) for s in (0, 1)})
    for k in (1, 2, 3):
        assert equal["reach_ceiling"]["per_seed"][str(k)] == pytest.approx(k / (k + 10),
                                                                           abs=0.01)
        assert best["reach_ceiling"]["per_seed"][str(k)] == pytest.approx(k / (k + 1),
                                                                          abs=0.01)


def test_bench_budget_puts_the_rungs_where_the_method_says(timelines):
    """With one full training of 2,000 examples: ASHA's rungs at full/9, full/3, full;
    a later first rung; grid scored at the end; PBT and PB2 compared every full/6."""
    budgets = timelines["budgets"]
    assert budgets["asha_tpe"]["rungs"] == [222, 666, 1998]
    late = budgets["asha_tpe_late"]
    assert late["grace_period"] == 666 and late["rungs"] == [666, 1998]
    assert budgets["grid"]["eval_every"] == 2000
    for population in ("pbt", "pb2"):  # compared every full / 6, no growth
        assert (budgets[population]["eval_every"], budgets[population]["eval_growth"]) == (
            333, 1)
    # the driver's pair and rung metric
    assert timelines["default"]["method"] == "asha_promote_staged_last"


def overhead(folder: Path, results: dict[str, list[dict]], actors: dict) -> dict:
    """bench/overhead.py's tables, ``--report-only``, of a search whose trials reported
    ``results`` ({trial folder: reports}) and whose trial actors Ray timed as ``actors``:
    its rows by trial."""
    for name, reports in results.items():
        (folder / "exp" / name).mkdir(parents=True)
        (folder / "exp" / name / "result.json").write_text(
            "".join(json.dumps(r) + "\n" for r in reports))
    (folder / "overhead.json").write_text(json.dumps({
        "command": "hand-made", "experiment_dir": str(folder / "exp"), "command_wall_s": 70.0,
        "actors": {str(pid): a for pid, a in actors.items()}}))
    done = bench("overhead", "--report-only", "--out", str(folder))
    assert done.returncode == 0, done.stderr[-3000:]
    return {r["trial"]: r for r in json.loads((folder / "overhead.json").read_text())["trials"]}


def test_overhead_trial_split_adds_up_to_the_wall_time(tmp_path):
    reports = [{"pid": 7, "timestamp": 160, "examples_seen": 500, "time/entered_at": 103.0,
                "time/startup_s": 4.0, "time/setup_s": 2.5, "time/train_s": 40.0,
                "time/eval_s": 8.0, "time/checkpoint_s": 1.0, "time/cpu_s": 90.0}]
    actors = {7: {"pid": 7, "requested": 100.0, "ready": 101.0, "end": 160.0}}
    # a trial whose actor Ray no longer lists is left out, not guessed
    rows = overhead(tmp_path, {"trial_x": reports, "trial_y": [{**reports[0], "pid": 8}]},
                    actors)
    assert list(rows) == ["trial_x"]
    row = rows["trial_x"]
    assert row["wall_s"] == pytest.approx(60.0)
    assert row["launch_s"] == pytest.approx(3.0)
    parts = ("launch_s", "startup_s", "train_s", "eval_s", "ckpt_s", "rest_s")
    assert sum(row[k] for k in parts) == pytest.approx(row["wall_s"])
    assert row["rest_s"] == pytest.approx(60 - 3 - 4 - 40 - 8 - 1)
    assert row["share"] == pytest.approx(48 / 60)


def test_overhead_per_checkpoint_figures(tmp_path):
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
    f = overhead(tmp_path / "new", {"t": reports}, actors)["t"]["per_checkpoint"]
    assert f["checkpoints"] == 2 and f["mib"] == pytest.approx(300)
    assert f["write_s"] == pytest.approx(0.75) and f["report_s"] == pytest.approx(0.4)
    assert f["stall_s"] == pytest.approx(0.1)  # 2 reports before the last
    assert f["stall_share_at_gpu_speed"] == pytest.approx(0.1 * 2 / (2000 / 5000))
    # a trainer that reports no checkpoint figures: unknown, not zero
    old = [{k: v for k, v in r.items() if k in base or k in ("examples_seen",
            "checkpoint_dir_name", "time/checkpoint_s")} for r in reports]
    assert overhead(tmp_path / "old", {"t": old}, actors)["t"]["per_checkpoint"]["mib"] is None


def test_quality_threshold_maximises_accuracy_and_table_marks_missing_cells(tiny_data_dir,
                                                                           tmp_path):
    """bench/quality.py's zero-shot baseline on the tiny data: the QQP cut it fits on
    val scores val as well as any cut of the same cosines can (recomputed here with the
    product's encoder and batches); its table marks the cells it has no figure for."""
    import torch

    from mtbert.core.config import TrainConfig
    from mtbert.core.pretrained import load_encoder
    from mtbert.data import collate, load_data

    done = bench("quality", "--baseline-only", "--data-dir", tiny_data_dir, "--threads", "1",
                 "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    zero_shot = json.loads((tmp_path / "quality.json").read_text())["zero_shot"]
    cut = zero_shot["settings"]["qqp_cosine_threshold"]
    data = load_data(TrainConfig(data_dir=tiny_data_dir, max_train_per_task=0,
                                 max_eval_per_task=0))
    split = data.split("qqp", "val")
    batch = collate(split, np.arange(len(split)), "siamese", data.pad_id)
    encoder = load_encoder(data.model).eval()
    with torch.inference_mode():
        pooled = []
        for side in ("a", "b"):
            mask = batch[f"attention_mask_{side}"].unsqueeze(-1).float()
            hidden = encoder(input_ids=batch[f"input_ids_{side}"],
                             attention_mask=batch[f"attention_mask_{side}"]).last_hidden_state
            pooled.append((hidden * mask).sum(1) / mask.sum(1).clamp(min=1))
        scores = torch.nn.functional.cosine_similarity(*pooled, dim=-1).numpy()
    gold = np.asarray(split.labels) > 0.5
    best = max(((scores > c) == gold).mean() for c in np.concatenate(
        [[scores.min() - 1], np.sort(scores), [scores.max() + 1]]))
    assert ((scores > cut) == gold).mean() == pytest.approx(best)
    assert zero_shot["val"]["qqp_acc"] == pytest.approx(best)
    table = [line for line in done.stdout.splitlines() if line.startswith("|")]
    assert table[-1] == ("| report 004 (BERT-base, GPU, full QQP) | – | – | – | – | 0.800 "
                         "| 0.545 | 0.908 | 0.894 |")


def test_gpu_trials_option_is_checked_and_kept_apart_from_cpu_runs(tmp_path):
    """--gpus-per-trial: a share of one GPU, refused where torch sees no CUDA GPU; a
    runs.json from before the option (CPU runs) is reused on the CPU only."""
    import torch

    done = bench("search_efficiency", "--gpus-per-trial", "2")
    assert done.returncode == 2 and "expected a share of one GPU" in done.stderr
    if not torch.cuda.is_available():
        done = bench("search_efficiency", "--gpus-per-trial", "0.125", "--workers", "8")
        assert done.returncode == 2 and "no CUDA GPU" in done.stderr
    old = {k: v for k, v in SETTINGS.items() if k != "gpus_per_trial"}
    doc = efficiency(tmp_path / "cpu", {"grid": {0: two_trials(0)}}, settings=old)
    assert doc["methods"]["grid"]["seeds"] == [0]
    done = bench("search_efficiency", "--report-only", "--gpus-per-trial", "0.125", "--out",
                 str(tmp_path / "cpu" / "out"), *flags(old))
    assert done.returncode == 2 and "gpus_per_trial" in done.stderr


def test_no_dashboard_option_starts_ray_without_one():
    """--no-dashboard (a machine whose Ray lacks ray[default]'s packages refuses a
    dashboard): the bench's Ray starts without one; by default it has one."""
    import ray

    from mtbert.tune.infra.cluster import dashboard_url, start_local_ray
    assert "--no-dashboard" in bench("search_efficiency", "--help").stdout
    if ray.is_initialized():
        pytest.skip("a Ray session is already open in this process")
    start_local_ray(False, num_cpus=1)
    try:
        assert ray.cluster_resources()["CPU"] == 1
        assert dashboard_url() is None
    finally:
        ray.shutdown()


def test_report_names_the_machine_the_runs_ran_on_not_the_reporting_one(tmp_path):
    """--report-only on another machine: the figures' machine is the one each run kept
    (the GPU runs' docs/gpu_h200 JSON once read this CPU's); several: all of them."""
    kept = json.loads((REPO / "docs" / "gpu_h200" / "search_efficiency_runs.json")
                      .read_text(encoding="utf-8"))
    h200 = {"cpu_count": 16, "platform": "Linux-x86_64", "processor": "x86_64",
            "gpu": "NVIDIA H200"}
    for by_seed in kept["runs"].values():
        for one in by_seed.values():
            one["machine"] = h200
    written = efficiency(tmp_path / "one", kept["runs"], settings=kept["args"])
    assert written["machine"] == h200
    assert written["default"]["wall_vs_one_training"] == pytest.approx(0.861, abs=0.001)
    kept["runs"]["grid"]["1"]["machine"] = {**h200, "gpu": "NVIDIA H100 80GB HBM3"}
    assert len(efficiency(tmp_path / "two", kept["runs"], settings=kept["args"])["machine"]) == 2


def test_carried_figures_fill_in_methods_the_runs_lack(tmp_path):
    """--carry-figures: an earlier search_efficiency.json's methods that runs.json lacks
    are kept (marked carried) and ranked beside the runs'; a method re-run is the run's;
    a file of other settings, or no such file, is refused."""
    bohb = {**method_summary(*[seed_row(0.2, 1.5, True, 0.6, 5000)] * 3), "label": "B"}
    earlier = {"settings": SETTINGS, "commands": ["python bench/search_efficiency.py x"],
               "methods": {"bohb": bohb, "pbt": {**bohb, "label": "P"},
                           "gone": {"label": "not a method any more"}},
               "first_rung": {"bohb": {"0": {"examples": 224, "spread": 0.01, "val_se": 0.02}}}}
    path = tmp_path / "earlier.json"
    path.write_text(json.dumps(earlier))
    doc = efficiency(tmp_path / "carried", {"pbt": {0: two_trials(0)}},
                     "--carry-figures", str(path))
    assert doc["carried"] == ["bohb"]  # pbt was re-run; "gone" is no method
    assert doc["methods"]["bohb"] == {**bohb, "carried": True}
    assert doc["first_rung"]["bohb"] == {"0": {"examples": 224, "spread": 0.01, "val_se": 0.02}}
    assert [r["method"] for r in doc["ranking"]] == ["bohb"]
    assert efficiency(tmp_path / "none", {"pbt": {0: two_trials(0)}})["carried"] == []
    path.write_text(json.dumps({**earlier, "settings": {**SETTINGS, "lr": 1.0}}))
    out = tmp_path / "carried" / "out"
    done = bench("search_efficiency", "--report-only", "--out", str(out), "--docs",
                 str(tmp_path / "docs"), "--carry-figures", str(path), *flags(SETTINGS))
    assert done.returncode == 1 and "measured with other settings (lr)" in done.stderr
    done = bench("search_efficiency", "--report-only", "--out", str(out), "--docs",
                 str(tmp_path / "docs"), "--carry-figures", str(tmp_path / "missing.json"),
                 *flags(SETTINGS))
    assert done.returncode == 1 and "not a search_efficiency.json" in done.stderr
