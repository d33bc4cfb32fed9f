"""The schedulers and searchers besides ASHA + TPE: BOHB, PBT, PB2, Optuna's
multivariate TPE.  Each runs a smoke search end to end (real local Ray, real SQLite
MLflow, the tiny model and data, as tests/test_tune_driver.py); a pair that does not
work together and a missing optional package are one ``error:`` line, exit 2, nothing
written."""

from __future__ import annotations

import contextlib
import io
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mtbert.tune.trial.objective import OBJECTIVE
from conftest import sqlite_mlflow_store

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def run_search(shared_ray, tmp_path_factory, tiny_model_dir, tiny_data_dir):
    """Run one smoke search with extra flags; its summary, MLflow runs and Ray's view."""
    from mlflow import MlflowClient
    from ray.tune import ExperimentAnalysis

    from mtbert.tune.cli import main

    def run(name: str, *flags: str, trials: int = 2) -> dict:
        root = tmp_path_factory.mktemp(name)
        storage, uri = root / "ray_results", sqlite_mlflow_store(root / "mlflow.db")
        console = io.StringIO()
        with contextlib.redirect_stdout(console):
            rc = main(["--space", "smoke", "--budget", "smoke", "--model", tiny_model_dir,
                       "--data-dir", tiny_data_dir, "--num-samples", str(trials),
                       "--storage-path", str(storage), "--experiment", name,
                       "--mlflow-uri", uri, "--seed", "0", "--ensemble-top-k", "2",
                       "--keep-checkpoints", "all", *flags])
        assert rc == 0
        exp_dir = storage / name
        client = MlflowClient(tracking_uri=uri)
        runs = client.search_runs([client.get_experiment_by_name("mtbert/smoke").experiment_id])
        return {"exp_dir": exp_dir, "client": client, "runs": runs,
                "console": console.getvalue(),
                "summary": json.loads((exp_dir / "summary.json").read_text()),
                "ray": ExperimentAnalysis(str(exp_dir), default_metric="val/overall",
                                          default_mode="max")}
    return run


def _assert_recorded(search: dict, scheduler: str, search_alg: str, trials: int) -> None:
    """summary.json, summary.md and the MLflow parent run name the scheduler and searcher;
    every trial has its MLflow run with one metric point per Ray result."""
    s = search["summary"]
    assert (s["scheduler"], s["search_alg"]) == (scheduler, search_alg)
    assert s["counts"]["trials"] == trials and s["counts"]["errored"] == 0
    assert s["best_trial"] is not None
    markdown = (search["exp_dir"] / "summary.md").read_text()
    assert f"`{search_alg}`" in markdown and f"`{scheduler}`" in markdown
    saved = json.loads((search["exp_dir"] / "mtbert_search.json").read_text())["args"]
    assert (saved["scheduler"], saved["search_alg"]) == (scheduler, search_alg)  # --resume
    runs = search["runs"]
    parent = next(r for r in runs if r.data.tags.get("kind") == "search")
    assert parent.data.params["scheduler"] == scheduler
    assert parent.data.params["search_alg"] == search_alg
    children = {r.data.tags["trial_id"]: r for r in runs if r.data.tags.get("kind") == "trial"}
    assert set(children) == {t.trial_id for t in search["ray"].trials}
    client = search["client"]
    for trial_id, df in search["ray"].trial_dataframes.items():
        history = client.get_metric_history(children[trial_id].info.run_id, "val/overall")
        if df.empty:  # stopped before its first report (promoting ASHA's end): no points
            assert not history
            continue
        # (a trial PBT restarted from another's checkpoint may rewrite Ray's rows)
        assert set(df["examples_seen"]) <= {m.step for m in history}


# ---------------------------------------------------------------------- end to end
def test_bohb_search_runs_on_the_budgets_rungs(run_search):
    search = run_search("bohb", "--scheduler", "bohb", trials=3)
    _assert_recorded(search, "bohb", "bohb", 3)
    # Hyperband's milestones are the budget's rungs (48, 144): a trial it stopped passed one
    for t in search["summary"]["trials"]:
        assert t["status"] in ("completed", "stopped_early")
        assert t["examples_seen"] >= (192 if t["status"] == "completed" else 48)


def test_asha_promote_search_tries_every_trial_and_promotes_the_best_it_compared(run_search):
    """``--scheduler asha-promote`` with --num-samples 4: all 4 trials are drawn and each
    is scored at the smoke budget's decision rung (48 examples; 144 is past the budget's
    middle), where it pauses; floor(n / 3) = 1 is promoted once 3 have reached it, which
    decides the search, and the 4th, drawn all the same, runs on to the rung and is scored
    there.  The one promoted trains the whole budget; the rest are stopped at the rung.
    The scheduler's own record of what it compared (summary.json's ``rung_decisions``)
    names the promoted trial the best of the scores it compared, on the first rung's
    metric of classes_soft,overall_soft, and each trial's rung row is in its history:
    the promoted trial, paused and resumed at the rung, has one row per evaluation, the
    same in summary.json, trials.json and MLflow (Ray's loggers once lost its rows before
    the rung when it resumed: result_logs.py).  A trial was left to try at the decision,
    so the last leg keeps its one CPU (schedulers.PromotingASHA._end_the_rest; threads
    fixed to the CPUs Ray holds: with ``grow`` a trial alone for a moment reports 2)."""
    search = run_search("promote", "--scheduler", "asha-promote", "--trial-threads", "fixed",
                        trials=4)
    summary = search["summary"]
    trials = summary["trials"]
    _assert_recorded(search, "asha-promote", "optuna", 4)
    assert summary["rung_metric"] == "val/classes_soft,val/overall_soft"
    counts = summary["counts"]
    assert counts["not_started"] == 0 and "not_needed" not in counts
    parent = next(r for r in search["runs"] if r.data.tags.get("kind") == "search")
    assert "trials_not_needed" not in parent.data.metrics
    assert "not needed" not in search["console"]
    completed = [t for t in trials if t["status"] == "completed"]
    assert len(completed) == 1 and completed[0]["examples_seen"] >= 192
    stopped = [t for t in trials if t["status"] == "stopped_early"]
    assert len(stopped) == 3 and all(48 <= t["examples_seen"] < 96 for t in stopped)
    winner = completed[0]["trial_id"]
    decisions = summary["rung_decisions"]
    scored = {d["trial_id"]: d["value"] for d in decisions if d["decision"] == "scored"}
    assert set(scored) == {t["trial_id"] for t in trials}  # every trial scored at the rung
    assert {d["rung"] for d in decisions if d["decision"] == "scored"} == {48}
    assert {d["metric"] for d in decisions if d["decision"] == "scored"} == {"val/classes_soft"}
    (promotion,) = [d for d in decisions if d["decision"] == "promoted"]
    assert promotion["trial_id"] == winner and len(promotion["compared"]) >= 3
    assert promotion["value"] == max(promotion["compared"].values()), promotion
    assert {d["trial_id"] for d in decisions if d["decision"] == "stopped"} \
        == {t["trial_id"] for t in stopped}
    known = {t["trial_id"]: t
             for t in json.loads((search["exp_dir"] / "trials.json").read_text())["trials"]}
    client = search["client"]
    threads = {}
    for t in trials:
        df = search["ray"].trial_dataframes[t["trial_id"]]
        at = t["evaluated_at"]
        assert at == sorted(set(at)) and any(a >= 48 for a in at), t
        assert t["rows_missing"] == 0 and t["rows_filled"] == [], t
        # the trial's value at its rung row is what the scheduler compared
        rung_row = df[df["examples_seen"] >= 48].iloc[0]
        assert rung_row["val/classes_soft"] == pytest.approx(scored[t["trial_id"]])
        history = known[t["trial_id"]]["history"]
        assert [int(h["examples_seen"]) for h in history] == at
        points = client.get_metric_history(t["mlflow_run_id"], "val/overall")
        assert sorted(m.step for m in points) == at, (t["trial_id"], at, points)
        threads[t["trial_id"]] = df.set_index("examples_seen")["train/threads"].to_dict()
    assert len(next(t for t in trials if t["trial_id"] == winner)["evaluated_at"]) >= 4
    assert all(n == 1 for d in threads.values() for n in d.values()), threads


def test_asha_on_overall_soft_search_sampled_by_optuna_multivariate(run_search):
    """``--rung-metric overall_soft``: a smoke search runs end to end; every result Ray
    and MLflow hold has the soft score beside the objective, and the summary and the
    parent run name what the scheduler decided on.  Its searcher is Optuna's multivariate
    TPE (``--search-alg optuna-mv``), recorded as the others are (one search for both:
    the plain ``optuna`` searcher runs in test_tune_driver.py's search and the
    asha-promote one above)."""
    search = run_search("soft", "--scheduler", "asha", "--search-alg", "optuna-mv",
                        "--rung-metric", "overall_soft", trials=3)
    _assert_recorded(search, "asha", "optuna-mv", 3)
    assert search["summary"]["rung_metric"] == "val/overall_soft"
    assert "deciding on `val/overall_soft`" in (search["exp_dir"] / "summary.md").read_text()
    parent = next(r for r in search["runs"] if r.data.tags.get("kind") == "search")
    assert parent.data.params["rung_metric"] == "val/overall_soft"
    for df in search["ray"].trial_dataframes.values():
        assert df["val/overall_soft"].between(0, 1).all()
        assert (df["val/overall_soft_se"] > 0).all()
    saved = json.loads((search["exp_dir"] / "mtbert_search.json").read_text())["args"]
    assert saved["rung_metric"] == "overall_soft"  # --resume decides on it again


def test_pb2_search_perturbs_within_the_space(run_search):
    search = run_search("pb2", "--scheduler", "pb2")
    _assert_recorded(search, "pb2", "random", 2)
    for trial in search["ray"].trials:  # the smoke space's ranges (PB2 works in float32)
        assert 1e-4 * (1 - 1e-6) <= trial.config["lr"] <= 5e-3 * (1 + 1e-6)
        assert 0.0 <= trial.config["dropout"] <= 0.3 * (1 + 1e-6)


def test_pbt_exploit_changes_lr_and_dropout(run_search):
    """PBT with 2 trials side by side (one CPU each): at an interval (48 examples) the
    worse trial restarts from the better one's checkpoint with a perturbed lr and dropout;
    the change reaches Ray's trial config, its MLflow history (config/*) and PBT's policy
    log.  (Two trials taking turns on one slot of 2 CPUs fix the order of PBT's decisions,
    but each turn then restarts a worker: 90 CPU-seconds against 72-83.)"""
    _assert_exploited(run_search("pbt", "--scheduler", "pbt"))


def test_pbt_on_the_fused_path_exploits_as_unfused(run_search):
    """The same PBT search with ``--fuse on``: the trials train in a trainer actor (the
    thin trials forward its reports) and PBT's pause, exploit and restore act on them as on
    the unfused path: the exploited trial rejoins from the better one's checkpoint and
    trains at its perturbed lr; every trial trains its whole budget."""
    search = run_search("pbt-fused", "--scheduler", "pbt", "--fuse", "on")
    _assert_exploited(search)
    placed = re.search(r"\[tune\] fused: trainer 0: (\d+) trials .* ended (\d+) finished, "
                       r"\d+ stopped, (\d+) failed", search["console"])
    assert placed, search["console"][-3000:]
    joins, finished, failed = map(int, placed.groups())
    assert finished == 2 and failed == 0 and joins > 2  # each pause and exploit rejoins


def _assert_exploited(search: dict) -> None:
    _assert_recorded(search, "pbt", "random", 2)
    exp_dir, client = search["exp_dir"], search["client"]
    assert (exp_dir / "pbt_global.txt").read_text().strip(), "PBT logged no exploit"
    children = {r.data.tags["trial_id"]: r for r in search["runs"]
                if r.data.tags.get("kind") == "trial"}
    changed, trained_at_new_lr = set(), []
    for trial in search["ray"].trials:
        run = children[trial.trial_id]
        for key in ("lr", "dropout"):
            history = sorted(client.get_metric_history(run.info.run_id, f"config/{key}"),
                             key=lambda m: m.step)
            assert history[-1].value == pytest.approx(trial.config[key])  # what it ended on
            sampled = float(run.data.params[key])  # logged once, at the trial's start
            if len({m.value for m in history}) > 1:
                assert history[0].value == pytest.approx(sampled)
                assert trial.config[key] != pytest.approx(sampled)
                changed.add(key)
            if key == "lr" and len({m.value for m in history}) > 1:
                # the trainer trained at the perturbed lr (not the checkpoint's): at an
                # evaluation after the exploit the reported lr is the new config's (where
                # the wsd schedule has not decayed it: not at the budget's end)
                actual = {m.step: m.value for m in client.get_metric_history(
                    run.info.run_id, "train/lr")}
                trained_at_new_lr.append(any(
                    m.value != pytest.approx(sampled)
                    and actual.get(m.step) == pytest.approx(m.value) for m in history))
    assert changed == {"lr", "dropout"}
    assert any(trained_at_new_lr), trained_at_new_lr
    # every trial trained its whole budget (PBT stops none)
    assert search["summary"]["counts"]["completed"] == 2


# ---------------------------------------------------------------------- bad input
def _argv(tmp_path, tiny_model_dir, tiny_data_dir, *flags):
    return ["--space", "smoke", "--budget", "smoke", "--model", tiny_model_dir,
            "--data-dir", tiny_data_dir, "--storage-path", str(tmp_path / "out"), *flags]


def _assert_one_error(capsys, rc, tmp_path, *expected):
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: "), err
    for text in expected:
        assert text in err[0], err[0]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("flags, expected", [
    (["--scheduler", "bohb", "--search-alg", "optuna"],
     ["--scheduler bohb needs --search-alg bohb", "got --search-alg optuna"]),
    (["--scheduler", "asha", "--search-alg", "bohb"],
     ["--search-alg bohb needs --scheduler bohb", "got --scheduler asha"]),
    (["--scheduler", "pbt", "--search-alg", "optuna"],
     ["--scheduler pbt needs --search-alg random", "got --search-alg optuna"]),
    (["--scheduler", "pb2", "--search-alg", "optuna-mv"],
     ["--scheduler pb2 needs --search-alg random", "got --search-alg optuna-mv"]),
    (["--scheduler", "asha-promote", "--search-alg", "random"],
     ["--scheduler asha-promote needs --search-alg optuna or optuna-mv",
      "got --search-alg random", "free a paused trial's place"]),
    (["--scheduler", "asha-promote", "--search-alg", "bohb"],
     ["--scheduler asha-promote needs --search-alg optuna or optuna-mv",
      "got --search-alg bohb"]),
])
def test_a_mismatched_pair_is_one_error(tmp_path, capsys, tiny_model_dir, tiny_data_dir,
                                        flags, expected):
    from mtbert.tune.cli import main
    rc = main(_argv(tmp_path, tiny_model_dir, tiny_data_dir, *flags))
    _assert_one_error(capsys, rc, tmp_path, *expected)


@pytest.mark.parametrize("text, expected", [
    ('[{"lr": 1e-3, "dropout": 0.1,\n  "batch_size": 16,}]', ["line 2: not JSON"]),
    ('{"lr": 1e-3}', ["expected a non-empty JSON list of objects"]),
    ('[{"lr": 1e-3, "dropout": 0.1}]', ["point 1: no value of batch_size"]),
    ('[{"lr": 1e-3, "dropout": 0.1, "batch_size": 16},'
     ' {"lr": 1e-3, "dropout": 0.5, "batch_size": 16}]',
     ["point 2: dropout=0.5 is outside the space's uniform [0, 0.3]"]),
    ('[{"lr": 1e-3, "dropout": 0.1, "batch_size": 12}]',
     ["point 1: batch_size=12 is not one of the space's choices (8, 16)"]),
    ('[{"lr": 1e-3, "dropout": 0.1, "batch_size": 16, "warmup_ratio": 0.1}]',
     ["point 1: warmup_ratio: not a key the space smoke searches"]),
    ('[{"lr": 1e-3, "dropout": 0.1, "batch_size": 16}, {"lr": 2e-3, "dropout": 0.2, '
     '"batch_size": 8}, {"lr": 3e-3, "dropout": 0.0, "batch_size": 8}]',
     ["3 points, more than --num-samples 2"]),
])
def test_bad_points_are_one_error_naming_the_file_and_point(tmp_path, capsys, tiny_model_dir,
                                                            tiny_data_dir, text, expected):
    """``--points FILE``: a file that is not a list of the space's points is one error line
    naming the file (and the line, the point, the key), exit 2, nothing written."""
    from mtbert.tune.cli import main
    points = tmp_path / "points.json"
    points.write_text(text)
    rc = main(_argv(tmp_path, tiny_model_dir, tiny_data_dir, "--num-samples", "2",
                    "--points", str(points)))
    _assert_one_error(capsys, rc, tmp_path, f"--points {points}", *expected)


def test_pbt_needs_a_space_that_samples_what_it_perturbs(tmp_path, capsys, tiny_model_dir,
                                                         tiny_data_dir):
    from mtbert.tune.cli import main
    space = tmp_path / "batch.yaml"
    space.write_text("description: batch only\nparams:\n  batch_size: {choice: [8, 16]}\n")
    argv = _argv(tmp_path, tiny_model_dir, tiny_data_dir, "--scheduler", "pbt")
    argv[1] = str(space)
    _assert_one_error(capsys, main(argv), tmp_path, "--scheduler pbt: the space batch "
                      "samples none of lr, dropout")


def test_missing_pb2_package_names_the_extra(tmp_path, capsys, monkeypatch, tiny_model_dir,
                                             tiny_data_dir):
    from mtbert.tune.cli import main
    monkeypatch.setitem(sys.modules, "sklearn", None)  # `import sklearn` raises ImportError
    rc = main(_argv(tmp_path, tiny_model_dir, tiny_data_dir, "--scheduler", "pb2"))
    _assert_one_error(capsys, rc, tmp_path, "--scheduler pb2 needs sklearn (missing: "
                      "sklearn): pip install 'mtbert-tune[pb2]'")


def test_missing_bohb_package_names_the_extra(tmp_path, tiny_model_dir, tiny_data_dir):
    """The real CLI in a process where hpbandster cannot be imported."""
    argv = _argv(tmp_path, tiny_model_dir, tiny_data_dir, "--scheduler", "bohb")
    code = ("import sys; sys.modules['hpbandster'] = None; "
            "from mtbert.tune.cli import main; sys.exit(main(sys.argv[1:]))")
    out = subprocess.run([sys.executable, "-c", code, *argv], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "error: --scheduler bohb needs hpbandster, ConfigSpace (missing: hpbandster): "
        "pip install 'mtbert-tune[bohb]'"]
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------- settings
@pytest.mark.parametrize("scheduler, growth", [("asha", 2), ("pbt", 1), ("pb2", 1),
                                               ("bohb", 2)])
def test_population_schedulers_evaluate_at_a_fixed_interval(tmp_path, tiny_model_dir,
                                                            tiny_data_dir, scheduler, growth):
    """The small budget evaluates on ASHA's rungs (x2); PBT / PB2 every 1,000 examples,
    their perturbation interval: in the base config and once the budget is resolved."""
    from mtbert.tune.cli import build_parser
    from mtbert.tune.search.tuner import build_scheduler
    from mtbert.tune.settings import resolve_settings
    args = build_parser().parse_args(["--space", "smoke", "--budget", "small", "--model",
                                      tiny_model_dir, "--data-dir", tiny_data_dir,
                                      "--storage-path", str(tmp_path / "out"),
                                      "--scheduler", scheduler])
    settings = resolve_settings(args)
    assert settings.base["eval_growth"] == growth
    assert settings.resolved_for(3000).base["eval_growth"] == growth
    assert settings.base["eval_every"] == 1000
    if scheduler in ("pbt", "pb2"):
        scheduler = build_scheduler(scheduler, settings.budget, settings.space)
        assert scheduler.interval == 1000 and scheduler._perturbation_interval == 1
    assert not (tmp_path / "out").exists()


def test_rung_metric_default_and_resume_of_a_search_saved_before_it(tmp_path, tiny_model_dir,
                                                                   tiny_data_dir):
    """The default rung metric is classes_soft,overall_soft under the default scheduler
    (asha-promote), overall_soft under the others; --resume of a search whose saved
    settings predate --rung-metric decides (and says it decides) on the objective, as it
    did; a saved rung metric is kept."""
    from mtbert.tune.cli import build_parser
    from mtbert.tune.saved_settings import SETTINGS_FILE
    from mtbert.tune.settings import resolve_settings
    argv = ["--space", "smoke", "--budget", "smoke", "--model", tiny_model_dir, "--data-dir",
            tiny_data_dir, "--storage-path", str(tmp_path / "out"), "--experiment", "old"]
    settings = resolve_settings(build_parser().parse_args(argv))
    assert (settings.scheduler, settings.rung_metric) == ("asha-promote",
                                                          "classes_soft,overall_soft")
    for scheduler in ("asha", "bohb", "pbt"):
        assert resolve_settings(build_parser().parse_args(
            [*argv, "--scheduler", scheduler])).rung_metric == "overall_soft"
    saved = settings.saved()
    exp = tmp_path / "out" / "old"
    exp.mkdir(parents=True)
    for kept, expected in ((None, "overall"), ("overall_soft", "overall_soft")):
        args = {k: v for k, v in saved["args"].items() if k != "rung_metric"}
        if kept:
            args["rung_metric"] = kept
        (exp / SETTINGS_FILE).write_text(json.dumps({**saved, "args": args}))
        resumed = resolve_settings(build_parser().parse_args([*argv, "--resume"]))
        assert resumed.rung_metric == expected


def test_hyperband_brackets_start_on_the_budgets_rungs():
    """Every bracket's first milestone, in examples, is one of the budget's ASHA rungs."""
    from mtbert.tune.search.budgets import BUDGETS
    from mtbert.tune.search.schedulers.ray_classes import HyperBandOnRungs
    for budget in BUDGETS.values():
        budget = budget.resolved(100_000)
        scheduler = HyperBandOnRungs(budget, OBJECTIVE)
        starts = [scheduler._get_r0(s) * budget.grace_period
                  for s in range(scheduler._s_max_1)]
        assert min(starts) == budget.grace_period, budget.name
        assert set(starts) <= set(budget.rungs()), budget.name


@pytest.mark.parametrize("rung_metric, stopped", [("overall_soft", True), ("overall", False)])
def test_asha_decides_on_the_rung_metric(rung_metric, stopped):
    """Built on a rung metric, ASHA keeps it when the Tuner passes the objective (Ray
    refuses a scheduler with its own metric otherwise) and cuts on it: at the first rung
    trial b is above a on val/overall but below it on val/overall_soft."""
    from types import SimpleNamespace

    from ray.tune.schedulers import TrialScheduler

    from mtbert.tune.search.budgets import get_budget
    from mtbert.tune.trial.objective import RUNG_METRICS
    from mtbert.tune.search.tuner import build_scheduler
    budget = get_budget("smoke").resolved(1000)
    asha = build_scheduler("asha", budget, rung_metric=RUNG_METRICS[rung_metric])
    assert asha.set_search_properties(OBJECTIVE, "max")  # what Tuner(metric=...) does
    assert asha._metric == RUNG_METRICS[rung_metric]
    a, b = SimpleNamespace(trial_id="a"), SimpleNamespace(trial_id="b")
    rung = {"examples_seen": budget.grace_period}
    decisions = []
    for trial, hard, soft in ((a, 0.60, 0.50), (b, 0.70, 0.40)):
        asha.on_trial_add(None, trial)
        decisions.append(asha.on_trial_result(
            None, trial, {**rung, OBJECTIVE: hard, RUNG_METRICS["overall_soft"]: soft}))
    assert decisions == [TrialScheduler.CONTINUE,
                         TrialScheduler.STOP if stopped else TrialScheduler.CONTINUE]


class _Controller:
    """What PromotingASHA asks of Ray's TuneController: its trials (Ray's own Trial
    objects), the searcher (the driver's RunningTrialsLimiter), whether the search
    algorithm has given every trial asked for (as Ray's SearchGenerator: once it has made
    ``num_samples``, or where a test says so) and stop_trial.  It has no ``set_finished``:
    the scheduler never ends the sampling."""

    def __init__(self, searcher, finished, num_samples: int):
        from types import SimpleNamespace
        self.trials = []
        self.search_alg = SimpleNamespace(
            searcher=searcher,
            is_finished=lambda: finished[0] or len(self.trials) >= num_samples)

    def get_trials(self):
        return self.trials

    def stop_trial(self, trial):
        trial.set_status(trial.TERMINATED)


def _promoting_asha(budget, num_samples: int, first_rung: int, last_leg_cpus: float = 0.0,
                    rung_metric: str = "overall_soft"):
    """PromotingASHA on ``budget`` deciding on ``rung_metric`` (a --rung-metric), 2 workers,
    with the driver's searcher (told at ``first_rung``) and a fake controller; the last
    value returned is the first rung's metric."""
    from mtbert.tune.trial.objective import rung_metric_keys
    from mtbert.tune.search.tuner import build_scheduler, build_searcher
    from mtbert.tune.search.spaces import parse_space
    metrics = rung_metric_keys(rung_metric)
    asha = build_scheduler("asha-promote", budget, rung_metric=metrics, workers=2,
                           num_samples=num_samples, last_leg_cpus=last_leg_cpus)
    space = parse_space({"description": "d", "params": {"dropout": {"uniform": [0.1, 0.5]}}},
                        "t.yaml")
    limiter = build_searcher("optuna", 0, 2, num_samples, "asha-promote", first_rung,
                             metrics)
    limiter.set_search_properties(OBJECTIVE, "max", space.param_space())
    finished = [False]
    return asha, limiter, _Controller(limiter, finished, num_samples), finished, metrics[0]


def _promoting_asha_on_222(num_samples: int, last_leg_cpus: float = 0.0,
                           rung_metric: str = "overall_soft"):
    """PromotingASHA (``_promoting_asha``) on a 2,000-example budget, rungs 222 / 666 /
    1,998 (rf 3)."""
    from mtbert.tune.search.budgets import Budget
    budget = Budget("b", "d", max_examples=2000, epochs=1, eval_every=222, eval_growth=3,
                    grace_period=222, reduction_factor=3, warmup_examples=96,
                    max_train_per_task=0, max_eval_per_task=0, num_samples=num_samples,
                    ensemble_top_k=1)
    return _promoting_asha(budget, num_samples, 222, last_leg_cpus, rung_metric)


def test_rung_metric_names_one_metric_or_one_per_rung():
    from mtbert.core.errors import ConfigError
    from mtbert.tune.trial.objective import rung_metric_keys, rung_metric_label
    assert rung_metric_keys("overall") == (OBJECTIVE,)
    assert rung_metric_keys("classes_soft, overall_soft") == ("val/classes_soft",
                                                             "val/overall_soft")
    assert rung_metric_label("classes_soft,overall_soft") == "val/classes_soft,val/overall_soft"
    with pytest.raises(ConfigError, match="--rung-metric overall,sts: unknown 'sts'"):
        rung_metric_keys("overall,sts")
    with pytest.raises(ConfigError, match="one metric per rung needs --scheduler asha-promote"):
        from mtbert.tune.search.budgets import get_budget
        from mtbert.tune.search.tuner import build_scheduler
        build_scheduler("bohb", get_budget("smoke"), rung_metric=rung_metric_keys(
            "classes_soft,overall_soft"))


def test_promoting_asha_decides_each_rung_on_its_own_metric():
    """--rung-metric classes_soft,overall_soft: the first rung ranks (and the searcher is
    told) val/classes_soft, the second rung val/overall_soft; where they disagree the
    promotions follow each rung's own metric."""
    from ray.tune.experiment import Trial
    from ray.tune.schedulers import TrialScheduler

    asha, limiter, controller, _, first = _promoting_asha_on_222(
        9, rung_metric="classes_soft,overall_soft")
    assert first == "val/classes_soft" and asha.rungs == [222, 666]
    soft = "val/overall_soft"

    def arrive(name, examples, classes, overall_soft):
        trial = next((t for t in controller.trials if t.trial_id == name), None)
        if trial is None:
            assert limiter.suggest(name) is not None
            trial = Trial("t", config={}, trial_id=name, stub=True)
            controller.trials.append(trial)
        trial.set_status(Trial.RUNNING)
        result = {"examples_seen": examples, first: classes, soft: overall_soft}
        decision = asha.on_trial_result(controller, trial, result)
        limiter.on_trial_result(name, result)
        if decision == TrialScheduler.PAUSE:
            trial.set_status(Trial.PAUSED)
        return decision

    # at 224 examples the classifiers rank a > c > b; overall_soft (STS noise) the reverse
    for name, classes, overall_soft in (("a", 0.60, 0.30), ("b", 0.40, 0.70),
                                        ("c", 0.50, 0.50)):
        assert arrive(name, 224, classes, overall_soft) == TrialScheduler.PAUSE
    assert asha.scores[0] == {"a": 0.60, "b": 0.40, "c": 0.50}
    assert asha.promoted[0] == {"a"}  # the top 1 of 3 on classes_soft
    told = limiter.searcher._ot_study.get_trials(deepcopy=False)
    assert sorted(t.value for t in told) == [0.40, 0.50, 0.60]  # TPE learns classes_soft
    # at 668 examples a is scored on overall_soft, not on classes_soft
    arrive("a", 668, 0.90, 0.20)
    assert asha.scores[1] == {"a": 0.20}


def test_promoting_asha_frees_the_place_of_a_trial_ray_errored_unannounced():
    """Ray 2.60 errors a trial whose reused worker fails to reset without telling the
    searcher; the scheduler frees its place (and tells the searcher it failed) at the next
    choice, so the search does not go on with one worker fewer."""
    from ray.tune.experiment import Trial

    asha, limiter, controller, _, _ = _promoting_asha_on_222(9)
    for name in ("a", "b"):
        assert limiter.suggest(name) is not None
        trial = Trial("t", config={}, trial_id=name, stub=True)
        trial.set_status(Trial.RUNNING)
        controller.trials.append(trial)
    assert limiter.suggest("c") is None  # both places taken
    controller.trials[1].set_status(Trial.ERROR)  # Ray's reset failure: no on_trial_complete
    assert limiter.suggest("c") is None
    asha.choose_trial_to_run(controller)
    assert limiter.live_trials == {"a"}
    told = limiter.searcher._ot_study.get_trials(deepcopy=False)
    assert [t.state.name for t in told] == ["RUNNING", "FAIL"]  # b told, as failed
    assert limiter.suggest("c") is not None  # the place is free again


def test_promoting_asha_promotes_as_li_et_al_algorithm_2():
    """Rungs 222 and 666 decide (1,998 is past the budget's middle).  A trial reaching a
    rung continues if it is the best promotable of the top floor(n / 3); else it pauses
    and the freed place goes to the best promotable (highest rung first), or to a new
    trial; a rung promotes at most synchronous halving's 9 / 3 and 3 / 3.  Every one of
    the 9 trials asked for is drawn and scored at the first rung, those arriving after its
    share is used too; the last promotion stops the trial promoted from the first rung
    and running to the second, and lets the trials on their way to the first rung run on
    (the promoted one keeps its CPU while trials are left to try); at the end the trials
    still paused are stopped."""
    from ray.tune.execution.placement_groups import PlacementGroupFactory
    from ray.tune.experiment import Trial
    from ray.tune.schedulers import TrialScheduler

    asha, limiter, controller, _, soft = _promoting_asha_on_222(9, last_leg_cpus=2)
    assert asha.rungs == [222, 666] and asha.quota == [3, 1]
    assert asha.set_search_properties(OBJECTIVE, "max") and asha.metric == soft
    search_alg = controller.search_alg

    def start(name, running=True):
        assert not search_alg.is_finished(), "Ray asks a finished searcher for no trial"
        assert limiter.suggest(name) is not None, f"no place for {name}"
        trial = Trial("t", config={}, trial_id=name, stub=True)
        trial.placement_group_factory = PlacementGroupFactory([{"CPU": 1}])
        if running:
            trial.set_status(Trial.RUNNING)
        controller.trials.append(trial)
        return trial

    def arrive(trial, examples, score):
        decision = asha.on_trial_result(controller, trial, {"examples_seen": examples,
                                                            soft: score, OBJECTIVE: 0.4})
        limiter.on_trial_result(trial.trial_id, {"examples_seen": examples, soft: score})
        if decision == TrialScheduler.PAUSE:
            trial.set_status(Trial.PAUSED)
        return decision

    def resume():  # Ray runs what the scheduler chooses
        trial = asha.choose_trial_to_run(controller)
        if trial is not None:
            trial.set_status(Trial.RUNNING)
        return trial

    P, C = TrialScheduler.PAUSE, TrialScheduler.CONTINUE
    t = {n: start(n) for n in ("a", "b")}
    assert arrive(t["a"], 224, 0.50) == P and arrive(t["b"], 224, 0.60) == P
    t.update({n: start(n) for n in ("c", "d")})  # the paused freed their places
    assert arrive(t["c"], 224, 0.40) == P      # n = 3: b (paused) is promoted in c's place
    assert resume() is t["b"] and limiter.suggest("x") is None
    assert arrive(t["d"], 224, 0.70) == C      # n = 4: d is the top one, not yet promoted
    assert arrive(t["b"], 668, 0.62) == P      # rung 666, n = 1
    t["e"] = start("e")
    assert arrive(t["e"], 224, 0.10) == P      # n = 5, top 1 = d, promoted
    t["f"] = start("f")
    assert arrive(t["d"], 668, 0.75) == P and resume() is None  # rung 666: n = 2
    t["g"] = start("g")
    assert arrive(t["f"], 224, 0.65) == C      # n = 6, top 2 = d, f: f goes on
    assert len(asha.promoted[0]) == asha.quota[0] and not search_alg.is_finished()
    assert arrive(t["g"], 224, 0.90) == P      # top of 7, but the rung's share is used
    t["h"] = start("h", running=False)          # drawn all the same; Ray queues it
    assert resume() is t["h"]
    assert arrive(t["f"], 668, 0.55) == P      # rung 666, n = 3: d (0.75) promoted
    assert asha.decided
    assert t["h"].status == Trial.RUNNING      # on its way to the first rung: it is tried
    assert resume() is t["d"]                   # with its own CPU: i is still to be tried
    assert t["d"].placement_group_factory.required_resources == {"CPU": 1}
    assert arrive(t["h"], 224, 0.95) == P      # the best at the rung: no share is left
    t["i"] = start("i")                         # the ninth and last, in h's place
    assert search_alg.is_finished()
    assert arrive(t["i"], 224, 0.20) == P
    assert asha.choose_trial_to_run(controller) is None  # d runs; the rest stay paused
    assert all(t[n].status == Trial.PAUSED for n in "abcefghi")
    t["d"].set_status(Trial.TERMINATED)         # d trained to the end
    assert asha.choose_trial_to_run(controller) is None
    assert all(tr.status == Trial.TERMINATED for tr in controller.trials)
    assert asha.promoted == [{"b", "d", "f"}, {"d"}]
    assert set(asha.scores[0]) == set("abcdefghi")  # all 9 scored at the first rung
    # a resumed search's fresh records: a trial that resumed from its rung-666 checkpoint
    # and reports only at the end of the budget is not judged there (it ends)
    fresh = _promoting_asha_on_222(9)[0]
    assert fresh.on_trial_result(controller, t["d"], {"examples_seen": 2000, soft: 0.8}) == C
    # Optuna was told each trial's first-rung soft score, once
    told = {tr.params["dropout"]: tr.value for tr in limiter.searcher._ot_study.trials}
    assert sorted(told.values()) == [0.10, 0.20, 0.40, 0.50, 0.60, 0.65, 0.70, 0.90, 0.95]


def _arrivals(asha, controller, soft: str, trials: dict, resume: bool = False):
    """``arrive(name, examples, score)``: trial ``name`` reports ``score`` on ``soft`` at
    ``examples`` (set running first where ``resume``: Ray resumed it); the scheduler's
    decision, with the trial paused where it says PAUSE."""
    from ray.tune.experiment import Trial
    from ray.tune.schedulers import TrialScheduler

    def arrive(name, examples, score):
        if resume:
            trials[name].set_status(Trial.RUNNING)
        decision = asha.on_trial_result(controller, trials[name],
                                        {"examples_seen": examples, soft: score})
        if decision == TrialScheduler.PAUSE:
            trials[name].set_status(Trial.PAUSED)
        return decision
    return arrive


def _promoting_asha_small():
    """PromotingASHA (``_promoting_asha``) on the `small` budget (rungs 1,000 and 2,000
    decide, rf 2, 8 trials: quotas 4 -> 2), 1 CPU per trial, the last leg on 2."""
    from mtbert.tune.search.budgets import get_budget
    made = _promoting_asha(get_budget("small"), 8, 1000, last_leg_cpus=2)
    asha = made[0]
    assert asha.rungs == [1000, 2000] and asha.quota == [4, 2] and asha.deciding == 1
    return made


def test_promoting_asha_is_decided_when_its_deciding_rung_has_promoted_its_share():
    """The main job's order of events (2026-11-26, `small`): the second rung promotes its 2
    among its first 3 arrivals, after 3 of the first rung's 4.  That decides the search --
    no trial can train past 2,000 examples any more -- and the first rung's fourth share
    is void; the three trials not yet drawn are drawn all the same (before 2026-11-29 the
    searcher was finished there, 5 of the 8 tried), each scored at the first rung and
    paused; the two promoted train on, each on its own CPU while trials are left to try;
    at the end the paused trials are stopped."""
    from ray.tune.execution.placement_groups import PlacementGroupFactory
    from ray.tune.experiment import Trial
    from ray.tune.schedulers import TrialScheduler

    asha, limiter, controller, _, soft = _promoting_asha_small()
    t = {}

    def start(name):
        assert not controller.search_alg.is_finished() and limiter.suggest(name) is not None
        t[name] = Trial("t", config={}, trial_id=name, stub=True)
        t[name].placement_group_factory = PlacementGroupFactory([{"CPU": 1}])
        t[name].set_status(Trial.RUNNING)
        controller.trials.append(t[name])

    arrive = _arrivals(asha, controller, soft, t)

    P, C = TrialScheduler.PAUSE, TrialScheduler.CONTINUE
    start("a"), start("b")
    assert arrive("a", 1024, 0.398) == P       # first rung, n = 1
    start("c")
    assert arrive("b", 1000, 0.432) == C       # n = 2: the top 1, b, goes on
    assert arrive("c", 1024, 0.405) == P       # n = 3: still b
    start("d")
    assert arrive("b", 2000, 0.446) == P       # second rung, n = 1
    start("e")
    assert arrive("d", 1024, 0.454) == C       # first rung n = 4: top 2 = d, b
    assert arrive("e", 1024, 0.440) == C       # n = 5: top 2 = d, e: e goes on (3 of 4)
    assert arrive("e", 2024, 0.440) == P       # second rung, n = 2: b (0.446) promoted
    assert asha.choose_trial_to_run(controller) is t["b"]
    t["b"].set_status(Trial.RUNNING)
    assert len(asha.promoted[0]) == 3 < asha.quota[0]
    assert arrive("d", 2024, 0.559) == C       # n = 3: d, the second rung's second
    assert asha.promoted == [{"b", "d", "e"}, {"b", "d"}] and asha.decided
    assert not controller.search_alg.is_finished()  # 5 of 8 drawn: 3 still to try
    assert asha.choose_trial_to_run(controller) is None  # b and d train on
    t["b"].set_status(Trial.TERMINATED)         # b trained to the end: its place is free
    limiter.on_trial_complete("b")
    for name, score in (("f", 0.470), ("g", 0.300), ("h", 0.420)):
        start(name)
        assert arrive(name, 1024, score) == P  # f tops the first rung: no share is left
    assert controller.search_alg.is_finished() and set(asha.scores[0]) == set("abcdefgh")
    assert t["d"].placement_group_factory.required_resources == {"CPU": 1}
    assert asha.choose_trial_to_run(controller) is None  # d trains on; nothing else
    t["d"].set_status(Trial.TERMINATED)
    assert asha.choose_trial_to_run(controller) is None
    assert all(t[n].status == Trial.TERMINATED for n in "abcdefgh")
    # the searcher was told all 8 first-rung scores
    assert len(limiter.searcher._ot_study.get_trials(deepcopy=False)) == 8


def test_the_decision_stops_a_trial_promoted_from_a_lower_rung_not_yet_resumed():
    """Where a first-rung promotion waits to be resumed when the deciding rung promotes
    its last, that trial is stopped (no rung can promote it further), while a trial
    running to the first rung runs on (it is tried); the trials paused unpromoted stay
    until the end.  The last promoted trial goes on with the CPUs of the stopped trial
    (pausing to take them) only where no trial is left to try and the stopped one was not
    queued by Ray (PENDING: Ray 2.60 holds a cached worker for it)."""
    from ray.tune.execution.placement_groups import PlacementGroupFactory
    from ray.tune.experiment import Trial
    from ray.tune.schedulers import TrialScheduler

    from mtbert.tune.search.budgets import get_budget
    for f_running, queued, decision in ((True, False, TrialScheduler.CONTINUE),
                                        (False, False, TrialScheduler.PAUSE),
                                        (False, True, TrialScheduler.CONTINUE)):
        asha, limiter, controller, _, soft = _promoting_asha(get_budget("small"), 8, 1000,
                                                             last_leg_cpus=3)
        for name in "abcdefgh":  # all 8 drawn
            assert limiter.suggest(name) is not None
            limiter.on_pause(name)  # paused: their places free
            trial = Trial("t", config={}, trial_id=name, stub=True)
            trial.placement_group_factory = PlacementGroupFactory([{"CPU": 1}])
            trial.set_status(Trial.PAUSED)
            controller.trials.append(trial)
        a, b, c, d, e, f, g, h = controller.trials
        # b, d and e promoted from the first rung, b promoted from the second and e paused
        # there; a promoted from the first rung, waiting to be resumed (or queued by Ray);
        # c, g, h (and f, unless it still runs to the first rung) paused, unpromoted
        asha.scores = [{"a": 0.41, "b": 0.43, "c": 0.40, "d": 0.45, "e": 0.44, "g": 0.30,
                        "h": 0.31}, {"b": 0.45, "e": 0.44}]
        asha.promoted = [{"a", "b", "d", "e"}, {"b"}]
        assert asha._was_promoted(a) and not asha.decided
        if queued:
            a.set_status(Trial.PENDING)
        if f_running:
            f.set_status(Trial.RUNNING)
        else:
            asha.scores[0]["f"] = 0.32
        b.set_status(Trial.RUNNING), d.set_status(Trial.RUNNING)
        assert asha.on_trial_result(controller, d, {"examples_seen": 2024, soft: 0.56}) \
            == decision  # n = 3, top 1: d, the second rung's second
        assert asha.decided and asha.promoted[1] == {"b", "d"}
        assert a.status == Trial.TERMINATED  # void now
        assert f.status == (Trial.RUNNING if f_running else Trial.PAUSED)
        assert c.status == e.status == Trial.PAUSED and b.status == Trial.RUNNING
        if decision == TrialScheduler.PAUSE:  # b keeps its CPU: d takes a's and its own
            d.set_status(Trial.PAUSED)
            assert asha.choose_trial_to_run(controller) is d
            assert d.placement_group_factory.required_resources == {"CPU": 2}
        else:
            assert asha.choose_trial_to_run(controller) is None
            assert d.placement_group_factory.required_resources == {"CPU": 1}


def test_promoting_asha_keeps_the_first_rungs_promoted_when_the_next_promotes_none():
    """8 trials, rf 3: the first rung promotes 2, the second floor(2 / 3) = 0.  The second
    promotion from the first rung is the last one; the first promoted, training on to the
    second rung, goes on, and the other 4 trials asked for are drawn and scored at the
    first rung; once all 8 are tried, both promoted have paused at the second rung and
    nothing runs, the end rule trains the better one to the end, with both places' CPUs
    (the rest stay paused, then are stopped)."""
    from ray.tune.execution.placement_groups import PlacementGroupFactory
    from ray.tune.experiment import Trial
    from ray.tune.schedulers import TrialScheduler

    asha, limiter, controller, _, soft = _promoting_asha_on_222(8, last_leg_cpus=2)
    assert asha.rungs == [222, 666] and asha.quota == [2, 0]
    t = {}

    def start(name):
        assert limiter.suggest(name) is not None
        t[name] = Trial("t", config={}, trial_id=name, stub=True)
        t[name].placement_group_factory = PlacementGroupFactory([{"CPU": 1}])
        controller.trials.append(t[name])

    arrive = _arrivals(asha, controller, soft, t, resume=True)

    P, C = TrialScheduler.PAUSE, TrialScheduler.CONTINUE
    start("a"), start("b")
    assert arrive("a", 224, 0.50) == P and arrive("b", 224, 0.60) == P
    start("c"), start("d")                  # the paused freed their places
    assert arrive("c", 224, 0.40) == P      # n = 3: b promoted in c's place
    assert asha.choose_trial_to_run(controller) is t["b"]
    t["b"].set_status(Trial.RUNNING)
    assert arrive("d", 224, 0.70) == C      # n = 4: d, the last promotion
    assert asha.promoted == [{"b", "d"}, set()] and not controller.search_alg.is_finished()
    assert t["b"].status == Trial.RUNNING   # promoted too: it trains on
    assert arrive("b", 668, 0.62) == P
    start("e")
    assert arrive("d", 668, 0.75) == P
    start("f")
    for name, score in (("e", 0.3), ("f", 0.8)):  # f tops the first rung: no share left
        assert arrive(name, 224, score) == P
    assert asha.choose_trial_to_run(controller) is None  # g, h still to be drawn
    for name in "gh":
        start(name)
        assert arrive(name, 224, 0.2) == P
    assert controller.search_alg.is_finished()
    assert t["d"].placement_group_factory.required_resources == {"CPU": 1}  # b ran on
    assert asha.choose_trial_to_run(controller) is t["d"]  # the end rule: the better one
    assert asha.promoted == [{"b", "d"}, {"d"}]
    assert t["d"].placement_group_factory.required_resources == {"CPU": 2}  # b is paused


def test_promoting_asha_resumes_a_last_promotion_that_arrives_with_more_cpus():
    """The trial whose own arrival makes the last promotion, once every trial asked for
    has been tried, pauses (Ray changes the resources of a trial that is not running) and
    is resumed at once with both places' CPUs; with ``last_leg_cpus`` 0 it goes on as it
    is, and so it does where a trial Ray has queued is still to be tried (it runs to the
    first rung on its own CPU)."""
    from ray.tune.execution.placement_groups import PlacementGroupFactory
    from ray.tune.experiment import Trial
    from ray.tune.schedulers import TrialScheduler

    from mtbert.tune.search.budgets import get_budget
    budget = get_budget("smoke").resolved(1000)
    for cpus, pending, decision in ((2, False, TrialScheduler.PAUSE),
                                    (0, False, TrialScheduler.CONTINUE),
                                    (2, True, TrialScheduler.CONTINUE)):
        asha, limiter, controller, _, soft = _promoting_asha(
            budget, 3 + pending, 48, last_leg_cpus=cpus, rung_metric="classes_soft")
        assert asha.rungs == [48] and asha.quota == [1]
        if pending:  # queued by Ray, its worker not started, when the last promotion comes
            assert limiter.suggest("q") is not None
            queued = Trial("t", config={}, trial_id="q", stub=True)
            queued.placement_group_factory = PlacementGroupFactory([{"CPU": 1}])
            controller.trials.append(queued)
            assert queued.status == Trial.PENDING
        for name, score in (("a", 0.41), ("b", 0.40), ("c", 0.45)):
            assert limiter.suggest(name) is not None
            trial = Trial("t", config={}, trial_id=name, stub=True)
            trial.placement_group_factory = PlacementGroupFactory([{"CPU": 1}])
            trial.set_status(Trial.RUNNING)
            controller.trials.append(trial)
            got = asha.on_trial_result(controller, trial, {"examples_seen": 48, soft: score})
            if name != "c":
                assert got == TrialScheduler.PAUSE
                trial.set_status(Trial.PAUSED)
                limiter.on_pause(name)
        assert got == decision and asha.promoted == [{"c"}]
        assert controller.search_alg.is_finished()
        c = controller.trials[-1]
        if pending:
            assert controller.trials[0].status == Trial.PENDING  # to be tried, not stopped
        if decision == TrialScheduler.PAUSE:
            c.set_status(Trial.PAUSED)
            assert asha.choose_trial_to_run(controller) is c
            assert c.placement_group_factory.required_resources == {"CPU": 2}
        else:
            assert c.placement_group_factory.required_resources == {"CPU": 1}


def test_promoting_asha_trains_one_trial_to_the_end_when_fewer_than_rf_reach_a_rung():
    """2 trials, rf 3: floor(2 / 3) = 0 promotions at the rung; once the searcher has
    given both and both are paused, the better one is promoted (some trial trains the
    whole budget, with both places' CPUs), then the other is stopped."""
    from ray.tune.execution.placement_groups import PlacementGroupFactory
    from ray.tune.experiment import Trial
    from ray.tune.schedulers import TrialScheduler

    from mtbert.tune.search.budgets import get_budget
    asha, limiter, controller, finished, soft = _promoting_asha(
        get_budget("smoke").resolved(1000), 2, 48, last_leg_cpus=2, rung_metric="classes_soft")
    assert asha.rungs == [48] and asha.quota == [0]
    finished[0] = True  # the searcher has given both trials
    for name, score in (("a", 0.41), ("b", 0.45)):
        assert limiter.suggest(name) is not None
        trial = Trial("t", config={}, trial_id=name, stub=True)
        trial.placement_group_factory = PlacementGroupFactory([{"CPU": 1}])
        trial.set_status(Trial.RUNNING)
        controller.trials.append(trial)
        assert asha.on_trial_result(controller, trial, {"examples_seen": 48, soft: score}) \
            == TrialScheduler.PAUSE
        trial.set_status(Trial.PAUSED)
    a, b = controller.trials
    assert asha.choose_trial_to_run(controller) is b and asha.promoted == [{"b"}]
    assert b.placement_group_factory.required_resources == {"CPU": 2}
    b.set_status(Trial.RUNNING)
    assert asha.choose_trial_to_run(controller) is None and a.status == Trial.PAUSED
    b.set_status(Trial.TERMINATED)
    assert asha.choose_trial_to_run(controller) is None and a.status == Trial.TERMINATED


def test_actors_are_reused_only_where_no_trial_pauses_and_no_node_can_die():
    from mtbert.tune.search.tuner import reuses_actors
    assert reuses_actors("asha", None) and reuses_actors("fifo", None)
    for pausing in ("bohb", "pbt", "pb2"):
        assert not reuses_actors(pausing, None)
    # promoting ASHA pauses a trial where a place goes to another, never in turns
    assert reuses_actors("asha-promote", None) and not reuses_actors("asha-promote", "auto")
    # a cluster: a lost node's cached actor would take the retries (test_fault_tolerance)
    assert not reuses_actors("asha", "auto") and not reuses_actors("asha", "127.0.0.1:6379")
