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

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def run_search(shared_ray, tmp_path_factory, tiny_model_dir, tiny_data_dir):
    """Run one smoke search with extra flags; its summary, MLflow runs and Ray's view."""
    from mlflow import MlflowClient
    from ray.tune import ExperimentAnalysis

    from mtbert.tune.cli import main

    def run(name: str, *flags: str, trials: int = 2) -> dict:
        root = tmp_path_factory.mktemp(name)
        storage, uri = root / "ray_results", f"sqlite:///{root / 'mlflow.db'}"
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


def test_asha_promote_search_promotes_the_top_third(run_search):
    """``--scheduler asha-promote``: trials pause at the smoke budget's decision rung (48
    examples; 144 is past the budget's middle); floor(n / 3) = 1 is promoted once 3 have
    reached it, which ends the sampling (a 4th, if Ray had started it, is stopped before
    the rung) and trains the whole budget, with both places' CPUs unless a trial stopped
    then was still queued (schedulers.PromotingASHA._end_the_rest); the rest are stopped
    at the rung.  The one promoted beat >= 2 others at the rung on its metric: with
    --rung-metric left out, the first rung's of classes_soft,overall_soft.  (Threads fixed
    to the CPUs Ray holds: with ``grow`` a trial alone for a moment reports 2 too.)"""
    search = run_search("promote", "--scheduler", "asha-promote", "--trial-threads", "fixed",
                        trials=4)
    trials = search["summary"]["trials"]
    _assert_recorded(search, "asha-promote", "optuna", len(trials))
    assert search["summary"]["rung_metric"] == "val/classes_soft,val/overall_soft"
    assert len(trials) in (3, 4)
    # the 4th, if never sampled, was not needed (the driver warns of no lost trial)
    counts = search["summary"]["counts"]
    assert (counts["not_started"], counts["not_needed"]) == (0, 4 - len(trials))
    parent = next(r for r in search["runs"] if r.data.tags.get("kind") == "search")
    assert parent.data.metrics["trials_not_needed"] == 4 - len(trials)
    completed = [t for t in trials if t["status"] == "completed"]
    assert len(completed) == 1 and completed[0]["examples_seen"] >= 192
    stopped = [t for t in trials if t["status"] == "stopped_early"]
    assert len(stopped) == len(trials) - 1
    assert sum(48 <= t["examples_seen"] < 96 for t in stopped) >= 2
    assert all(t["examples_seen"] < 96 for t in stopped)
    at_rung, threads, unreported = {}, {}, 0
    for trial_id, df in search["ray"].trial_dataframes.items():
        if df.empty:  # stopped before its first report (queued, maybe: see below)
            unreported += 1
            continue
        if (df["examples_seen"] >= 48).any():
            at_rung[trial_id] = df[df["examples_seen"] >= 48].iloc[0]["val/classes_soft"]
        threads[trial_id] = df.set_index("examples_seen")["train/threads"].to_dict()
    winner = completed[0]["trial_id"]
    assert sum(score < at_rung[winner] for score in at_rung.values()) >= 2, \
        (winner, at_rung, unreported, trials)
    # the last leg: both places' CPUs, unless the last promotion stopped a queued trial
    last_leg = threads[winner][max(threads[winner])]
    assert last_leg == 2 or (last_leg == 1 and unreported)
    assert all(n == 1 for t, d in threads.items() for e, n in d.items()
               if t != winner or e <= 48)


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
    """PBT with 2 trials taking turns on one slot (2 CPUs each: the order of reports, and
    so PBT's decisions, are fixed): at an interval (48 examples) the worse trial restarts
    from the better one's checkpoint with a perturbed lr and dropout; the change reaches
    Ray's trial config, its MLflow history (config/*) and PBT's policy log."""
    _assert_exploited(run_search("pbt", "--scheduler", "pbt", "--cpus-per-trial", "2"))


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
    objects), the searcher (the driver's RunningTrialsLimiter) and stop_trial."""

    def __init__(self, searcher, finished):
        from types import SimpleNamespace
        self.trials = []
        self.search_alg = SimpleNamespace(searcher=searcher, is_finished=lambda: finished[0],
                                          set_finished=lambda: finished.__setitem__(0, True))

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
    return asha, limiter, _Controller(limiter, finished), finished, metrics[0]


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
    from mtbert.errors import ConfigError
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
    trial; a rung promotes at most synchronous halving's 9 / 3 and 3 / 3.  Once the first
    rung's 3 are promoted the searcher is finished; the last promotion stops the trials
    still running to a rung and resumes with both places' CPUs; at the end the trials
    still paused are stopped."""
    from ray.tune.execution.placement_groups import PlacementGroupFactory
    from ray.tune.experiment import Trial
    from ray.tune.schedulers import TrialScheduler

    asha, limiter, controller, finished, soft = _promoting_asha_on_222(9, last_leg_cpus=2)
    assert asha.rungs == [222, 666] and asha.quota == [3, 1]
    assert asha.set_search_properties(OBJECTIVE, "max") and asha.metric == soft

    def start(name):
        assert not finished[0], "Ray asks a finished searcher for no trial"
        assert limiter.suggest(name) is not None, f"no place for {name}"
        trial = Trial("t", config={}, trial_id=name, stub=True)
        trial.placement_group_factory = PlacementGroupFactory([{"CPU": 1}])
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
    assert not asha.ended_sampling
    assert arrive(t["f"], 224, 0.65) == C      # n = 6, top 2 = d, f: f goes on
    assert finished[0] and asha.ended_sampling  # the first rung's 3: no trial comes after
    assert arrive(t["g"], 224, 0.90) == P      # top of 7, but the rung's share is used
    t["h"] = Trial("t", config={}, trial_id="h", stub=True)  # one Ray had queued before
    t["h"].placement_group_factory = PlacementGroupFactory([{"CPU": 1}])
    controller.trials.append(t["h"])
    assert resume() is t["h"]
    assert arrive(t["f"], 668, 0.55) == P      # rung 666, n = 3: d (0.75) promoted
    assert t["h"].status == Trial.TERMINATED   # ... and h, running to a rung, stopped
    assert t["d"].placement_group_factory.required_resources["CPU"] == 1
    assert resume() is t["d"]                   # with both places' CPUs
    assert t["d"].placement_group_factory.required_resources == {"CPU": 2}
    assert asha.choose_trial_to_run(controller) is None  # d runs; b, f, ... stay paused
    assert all(t[n].status == Trial.PAUSED for n in "abcefg")
    t["d"].set_status(Trial.TERMINATED)         # d trained to the end
    assert asha.choose_trial_to_run(controller) is None
    assert all(t[n].status == Trial.TERMINATED for n in "abcdefgh")
    assert asha.promoted == [{"b", "d", "f"}, {"d"}]
    # a resumed search's fresh records: a trial that resumed from its rung-666 checkpoint
    # and reports only at the end of the budget is not judged there (it ends)
    fresh = _promoting_asha_on_222(9)[0]
    assert fresh.on_trial_result(controller, t["d"], {"examples_seen": 2000, soft: 0.8}) == C
    # Optuna was told each trial's first-rung soft score, once
    told = {tr.params["dropout"]: tr.value for tr in limiter.searcher._ot_study.trials}
    assert sorted(told.values()) == [0.10, 0.40, 0.50, 0.60, 0.65, 0.70, 0.90]


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
    no trial can train past 2,000 examples any more -- so the searcher is finished there,
    the first rung's fourth share void (the run had sampled a fifth trial and trained it
    2,000 examples for nothing); at the end the paused trials are stopped."""
    from ray.tune.execution.placement_groups import PlacementGroupFactory
    from ray.tune.experiment import Trial
    from ray.tune.schedulers import TrialScheduler

    asha, limiter, controller, finished, soft = _promoting_asha_small()
    t = {}

    def start(name):
        assert not finished[0] and limiter.suggest(name) is not None
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
    assert not finished[0] and len(asha.promoted[0]) == 3 < asha.quota[0]
    assert arrive("d", 2024, 0.559) == C       # n = 3: d, the second rung's second
    assert asha.promoted == [{"b", "d", "e"}, {"b", "d"}]
    assert asha.decided and finished[0] and asha.ended_sampling  # the fourth share: void
    assert asha.choose_trial_to_run(controller) is None  # b and d train on; nothing else
    t["b"].set_status(Trial.TERMINATED), t["d"].set_status(Trial.TERMINATED)
    assert asha.choose_trial_to_run(controller) is None
    assert all(t[n].status == Trial.TERMINATED for n in "abcde")


def test_the_decision_stops_a_trial_promoted_from_a_lower_rung_not_yet_resumed():
    """Where a first-rung promotion waits to be resumed when the deciding rung promotes
    its last, that trial is stopped (no rung can promote it further), as is a trial
    running to the first rung; the trials paused unpromoted stay until the end."""
    from ray.tune.execution.placement_groups import PlacementGroupFactory
    from ray.tune.experiment import Trial
    from ray.tune.schedulers import TrialScheduler

    asha, limiter, controller, _, soft = _promoting_asha_small()
    for name in "abcdef":
        assert limiter.suggest(name) is not None
        limiter.on_pause(name)  # paused: their places free
        trial = Trial("t", config={}, trial_id=name, stub=True)
        trial.placement_group_factory = PlacementGroupFactory([{"CPU": 1}])
        trial.set_status(Trial.PAUSED)
        controller.trials.append(trial)
    a, b, c, d, e, f = controller.trials
    # b, d and e promoted from the first rung, b promoted from the second and e paused
    # there; a promoted from the first rung, waiting to be resumed; c paused, unpromoted
    asha.scores = [{"a": 0.41, "b": 0.43, "c": 0.40, "d": 0.45, "e": 0.44}, {"b": 0.45,
                                                                             "e": 0.44}]
    asha.promoted = [{"a", "b", "d", "e"}, {"b"}]
    assert asha._was_promoted(a) and not asha.decided
    b.set_status(Trial.RUNNING), f.set_status(Trial.RUNNING)  # f runs to the first rung
    d.set_status(Trial.RUNNING)
    assert asha.on_trial_result(controller, d, {"examples_seen": 2024, soft: 0.56}) \
        == TrialScheduler.CONTINUE  # n = 3, top 1: d, the second rung's second
    assert asha.decided and asha.promoted[1] == {"b", "d"}
    assert a.status == f.status == Trial.TERMINATED  # void now
    assert c.status == e.status == Trial.PAUSED and b.status == d.status == Trial.RUNNING
    assert asha.choose_trial_to_run(controller) is None


def test_promoting_asha_keeps_the_first_rungs_promoted_when_the_next_promotes_none():
    """8 trials, rf 3: the first rung promotes 2, the second floor(2 / 3) = 0.  The second
    promotion from the first rung is the last one; the first promoted, training on to the
    second rung, goes on (it was stopped there), and once both have paused at the second
    rung and nothing runs, the end rule trains the better one to the end, with both
    places' CPUs (the other one stays paused)."""
    from ray.tune.execution.placement_groups import PlacementGroupFactory
    from ray.tune.experiment import Trial
    from ray.tune.schedulers import TrialScheduler

    asha, limiter, controller, finished, soft = _promoting_asha_on_222(8, last_leg_cpus=2)
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
    assert finished[0] and asha.promoted == [{"b", "d"}, set()]
    assert t["b"].status == Trial.RUNNING   # promoted too: it trains on
    assert arrive("b", 668, 0.62) == P and arrive("d", 668, 0.75) == P
    assert t["d"].placement_group_factory.required_resources == {"CPU": 1}  # b ran on
    assert asha.choose_trial_to_run(controller) is t["d"]  # the end rule: the better one
    assert asha.promoted == [{"b", "d"}, {"d"}]
    assert t["d"].placement_group_factory.required_resources == {"CPU": 2}  # b is paused


def test_promoting_asha_resumes_a_last_promotion_that_arrives_with_more_cpus():
    """The trial whose own arrival makes the last promotion pauses (Ray changes the
    resources of a trial that is not running) and is resumed at once with both places'
    CPUs; with ``last_leg_cpus`` 0 it goes on as it is.  Where the last promotion stops a
    PENDING trial (Ray 2.60 keeps it staged, and a cached worker with it: a smoke search
    hung with the widened leg pending) it goes on as it is too."""
    from ray.tune.execution.placement_groups import PlacementGroupFactory
    from ray.tune.experiment import Trial
    from ray.tune.schedulers import TrialScheduler

    from mtbert.tune.search.budgets import get_budget
    budget = get_budget("smoke").resolved(1000)
    for cpus, pending, decision in ((2, False, TrialScheduler.PAUSE),
                                    (0, False, TrialScheduler.CONTINUE),
                                    (2, True, TrialScheduler.CONTINUE)):
        asha, limiter, controller, finished, soft = _promoting_asha(
            budget, 3, 48, last_leg_cpus=cpus, rung_metric="classes_soft")
        assert asha.rungs == [48] and asha.quota == [1]
        if pending:  # queued by Ray, its worker not started, when the last promotion comes
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
        assert got == decision and finished[0] and asha.promoted == [{"c"}]
        c = controller.trials[-1]
        if pending:
            assert controller.trials[0].status == Trial.TERMINATED
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
