"""The search driver end to end: a real local Ray (num_cpus=2), a real SQLite MLflow store,
the tiny model and tiny data; plus every bad CLI value / space file -> exit 2, nothing written.

One smoke search (6 trials, ASHA) is shared by the assertions (module fixture).
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mtbert.tune.search.choices import DEFAULT_SEARCHER
from mtbert.tune.results.summary import duration
from conftest import sqlite_mlflow_store

REPO = Path(__file__).resolve().parents[1]
NUM_TRIALS = 6


@pytest.fixture(scope="module")
def search(shared_ray, tmp_path_factory, tiny_model_dir, tiny_data_dir):
    from mtbert.tune.cli import main

    root = tmp_path_factory.mktemp("search")
    storage = root / "ray_results"
    uri = sqlite_mlflow_store(root / "mlflow.db")
    console = io.StringIO()
    with contextlib.redirect_stdout(console):
        rc = main(["--space", "smoke", "--budget", "smoke", "--model", tiny_model_dir,
                   "--data-dir", tiny_data_dir, "--num-samples", str(NUM_TRIALS),
                   "--storage-path", str(storage), "--experiment", "smoke-test",
                   "--mlflow-uri", uri, "--seed", "0", "--ensemble-top-k", "3",
                   # one trial at a time: seeded TPE then sees results in a fixed
                   # order, so the ASHA decisions (and the test) are deterministic
                   "--max-concurrent", "1",
                   # Ray's ASHA, deciding on arrival: every trial sampled, some
                   # stopped, some trained to the end (the default, promoting ASHA,
                   # has its own smoke test in test_search_choices.py)
                   "--scheduler", "asha"])
    exp_dir = storage / "smoke-test"
    summary = json.loads((exp_dir / "summary.json").read_text()) if rc == 0 else None
    return {"rc": rc, "exp_dir": exp_dir, "uri": uri, "summary": summary,
            "console": console.getvalue()}


@pytest.fixture(scope="module")
def ray_trials(search):
    """Ray's own view of the finished experiment (its result files, no Ray session)."""
    from ray.tune import ExperimentAnalysis
    analysis = ExperimentAnalysis(str(search["exp_dir"]), default_metric="val/overall",
                                  default_mode="max")
    return analysis


@pytest.fixture(scope="module")
def mlflow_runs(search):
    from mlflow import MlflowClient
    client = MlflowClient(tracking_uri=search["uri"])
    exp = client.get_experiment_by_name("mtbert/smoke")
    runs = client.search_runs([exp.experiment_id])
    return client, runs


def test_smoke_search_completes(search):
    assert search["rc"] == 0
    s = search["summary"]
    exp_dir = search["exp_dir"]
    assert s["counts"]["trials"] == NUM_TRIALS
    assert s["counts"]["errored"] == 0
    assert s["counts"]["completed"] + s["counts"]["stopped_early"] == NUM_TRIALS
    for name in ("summary.md", "best_so_far.png", "learning_curves.png", "importances.json"):
        assert (exp_dir / name).is_file(), name
    # ensemble: CS 224N CSVs for val/dev/test with the right headers and all rows
    pred = exp_dir / "ensemble" / "predictions"
    headers = {"sst": "Predicted_Sentiment", "qqp": "Predicted_Is_Paraphrase",
               "sts": "Predicted_Similarity"}
    for task, header in headers.items():
        for split in ("val", "dev") + (("test",) if task != "qqp" else ()):
            rows = list(csv.reader(open(pred / f"{task}-{split}-output.csv", encoding="utf-8")))
            assert rows[0] == ["id", header]
            assert len(rows) > 1
    ens = s["ensemble"]
    assert ens["method"] == "greedy" and len(ens["candidates"]) == 3
    assert ens["members"][0] == s["best_trial"]["trial_id"]
    assert set(ens["members"]) <= set(ens["candidates"])
    # greedy selection starts from the best member and keeps a mix only if val improves
    assert ens["val"]["val/overall"] >= s["best_trial"]["val"]["val/overall"] - 1e-4
    assert {"val/overall", "val/sst_acc"} <= set(ens["val"]) and "dev/overall" in ens["dev"]
    assert "dev/overall" in s["best_trial"]["dev"]


def test_the_summary_says_where_the_wall_time_went(search):
    """summary.json's phases: Tune's loop between the data and the finish, the parts add
    up to the whole, every trial entered and reported within the loop, the first trial
    ready before the first report; the same line in summary.md and on the console."""
    p = search["summary"]["phases"]
    parts = ("data_s", "setup_s", "tune_s", "finish_s")
    assert all(p[k] >= 0 for k in parts) and p["tune_s"] > 1
    assert sum(p[k] for k in parts) == pytest.approx(p["total_s"], abs=1e-3)
    assert p["started_at"] + p["data_s"] <= p["tune_started_at"] < p["tune_ended_at"]
    for trial in search["summary"]["trials"]:
        assert p["tune_started_at"] < trial["best"]["time/entered_at"] < p["tune_ended_at"]
        assert trial["best"]["time/reported_at"] < p["tune_ended_at"]
    # the first trial's Trainer was ready within the loop, before any trial reported
    first_report = min(t["best"]["time/reported_at"] for t in search["summary"]["trials"])
    assert 0 < p["first_ready_s"] < first_report - p["tune_started_at"]
    line = (f"Tune's loop {duration(p['tune_s'])} (the first trial ready "
            f"{duration(p['first_ready_s'])} into it)")
    assert line in (search["exp_dir"] / "summary.md").read_text()
    assert f"[tune] Wall time {duration(p['total_s'])}: data" in search["console"]


def test_the_trials_start_from_one_kept_evaluation(search):
    """The smoke space varies nothing the untrained model depends on, so its trials start
    from the same weights: the search keeps one evaluation at 0 examples
    (mtbert/run/start_scores.py), and every trial's first report carries its scores."""
    kept = list((search["exp_dir"] / "start_scores").glob("*.json"))
    assert len(kept) == 1
    metrics = json.loads(kept[0].read_text())["metrics"]
    firsts = []
    for result in search["exp_dir"].glob("trial_*/result.json"):
        first = json.loads(result.read_text().splitlines()[0])
        assert first["examples_seen"] == 0
        firsts.append(first)
    assert len(firsts) == NUM_TRIALS
    for first in firsts:
        assert first["val/overall"] == metrics["val/overall"]
        assert first["val/sts_corr"] == metrics["val/sts_corr"]


def test_every_trial_reports_its_running_best(search, mlflow_runs):
    """MLflow and Ray rank trials by best/val/overall as the summary does: each trial
    run's latest best/val/overall is the maximum of its val/overall history."""
    client, runs = mlflow_runs
    trials = [r for r in runs if r.data.tags.get("kind") == "trial"]
    assert len(trials) == NUM_TRIALS
    for run in trials:
        history = client.get_metric_history(run.info.run_id, "val/overall")
        best = client.get_metric_history(run.info.run_id, "best/val/overall")
        assert len(best) == len(history) >= 1
        assert run.data.metrics["best/val/overall"] == pytest.approx(
            max(m.value for m in history))
        by_step = sorted(best, key=lambda m: m.step)
        assert all(a.value <= b.value for a, b in zip(by_step, by_step[1:]))  # never falls
    ranking = sorted(trials, key=lambda r: -r.data.metrics["best/val/overall"])
    assert ranking[0].data.tags["trial_id"] == search["summary"]["best_trial"]["trial_id"]


def test_driver_prints_mlflow_links_to_the_runs_view(search, mlflow_runs):
    client, _ = mlflow_runs
    s = search["summary"]
    exp_id, parent = s["mlflow"]["experiment_id"], s["mlflow"]["parent_run_id"]
    key = s["mlflow"]["runs_view"]
    lines = search["console"].splitlines()
    assert f"[tune] MLflow mlflow ui --backend-store-uri {search['uri']} --host 127.0.0.1 " \
           "--port 5000" in lines
    assert (f"[tune] MLflow runs, best first: http://127.0.0.1:5000/#/experiments/{exp_id}/runs"
            f"?workflowType=machine_learning&viewStateShareKey={key}") in lines
    assert (f"[tune] MLflow this search: http://127.0.0.1:5000/#/experiments/{exp_id}/runs/"
            f"{parent}?workflowType=machine_learning") in lines
    view = json.loads(client.get_experiment(exp_id).tags[f"mlflow.sharedViewState.{key}"])
    assert view["orderByKey"] == "metrics.`best/val/overall`" and view["orderByAsc"] is False
    assert view["selectedColumns"][:2] == ["metrics.`best/val/overall`", "metrics.`val/overall`"]
    assert "params.`lr`" in view["selectedColumns"]


def test_keep_checkpoints_best_keeps_loadable_weights_and_no_training_state(search,
                                                                           tiny_data_dir):
    """--keep-checkpoints best (default): the best trial's and the ensemble members'
    weights in models/, loadable, predicting dev exactly as the search reported (in the
    precision its config gives on this device, as the search predicted); no training
    state left anywhere in the experiment."""
    import pyarrow.parquet as pq

    from mtbert.core.config import TrainConfig
    from mtbert.core.devices import uses_bf16
    from mtbert.data import encoding_for, load_data
    from mtbert.run.model_files import load_model
    from mtbert.run.inference import predict_split
    s, exp_dir = search["summary"], search["exp_dir"]
    assert s["keep_checkpoints"] == "best"
    kept = {s["best_trial"]["trial_id"], *s["ensemble"]["members"]}
    assert set(s["models"]) == kept
    assert sorted(p.name for p in (exp_dir / "models").iterdir()) == sorted(kept)
    assert not list(exp_dir.rglob("state.pt"))
    # weight files only in the kept models (copies of their best checkpoints' files)
    for name in ("heads.safetensors", "model.safetensors"):
        assert {p.relative_to(exp_dir).parts[:2] for p in exp_dir.rglob(name)} == {
            ("models", trial_id) for trial_id in kept}, name
    assert (exp_dir / "mtbert_pruned.json").is_file()
    best = s["best_trial"]
    assert best["model"] == s["models"][best["trial_id"]]
    cfg, model = load_model(best["model"])
    assert cfg.to_dict() == TrainConfig.from_dict(best["config"]).to_dict()
    data = load_data(TrainConfig.from_dict({**best["config"], "data_dir": tiny_data_dir}))
    reported = Path(best["predictions"])
    for task in ("sst", "qqp", "sts"):
        split = data.split(task, "dev")
        device = model.encoder.device  # in the precision the search predicted in
        pred = predict_split(model, split, encoding_for(task, cfg.pair_encoding), data.pad_id,
                             cfg.eval_batch_size, device,
                             autocast=uses_bf16(cfg.precision, device))
        table = pq.read_table(reported / f"dev-{task}.parquet").to_pydict()
        column = "probability" if task == "qqp" else "prediction"
        np.testing.assert_allclose(pred, table[column], rtol=0, atol=1e-6, err_msg=task)


def test_quality_bench_rescores_a_pruned_search(search):
    """``python -m bench.quality`` re-scores a search finished with the default
    --keep-checkpoints best (its trials' checkpoints gone, the kept models in models/ID):
    on the tiny data the search already scored every dev row, so the figures must agree."""
    s, exp_dir = search["summary"], search["exp_dir"]
    assert not list(exp_dir.rglob("state.pt"))
    best = s["best_trial"]
    out = exp_dir.parent / "quality"
    done = subprocess.run([sys.executable, "-m", "bench.quality", "--experiment-dir",
                           str(exp_dir), "--data-dir", best["config"]["data_dir"], "--threads",
                           "1", "--out", str(out)], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((out / "quality.json").read_text())["search"]
    assert result["best_trial"] == best["trial_id"]
    assert result["candidates"][0] == best["trial_id"]
    for key in ("sst_acc", "qqp_acc", "sts_corr", "overall"):
        assert result["best"]["dev"][key] == pytest.approx(best["dev"][f"dev/{key}"], abs=1e-9), key


def test_resume_of_a_pruned_search_is_refused(search):
    out = subprocess.run([sys.executable, "tune_driver.py", "--resume", "--experiment",
                          "smoke-test", "--storage-path", str(search["exp_dir"].parent)],
                         cwd=REPO, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "RAY_ADDRESS": ""})
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, out.stderr[-2000:]
    assert "finished and its training states were removed (--keep-checkpoints best)" in lines[0]


def test_asha_stops_some_trials_early(search, ray_trials):
    s = search["summary"]
    max_examples = s["budget"]["max_examples"]
    stopped = [t for t in s["trials"] if t["status"] == "stopped_early"]
    assert stopped, "ASHA stopped no trial"
    by_id = {t.trial_id: t for t in ray_trials.trials}
    for t in s["trials"]:
        last = by_id[t["trial_id"]].last_result
        assert t["examples_seen"] == last["examples_seen"]
        assert (t["status"] == "stopped_early") == (last["examples_seen"] < max_examples)
    assert any(t["status"] == "completed" for t in s["trials"])
    # every example trained counts: each trial's runs (files the trainable writes as it
    # trains and where it stops) make its examples_trained -- past the report ASHA
    # stopped it at, as far as it had trained when the stop took hold
    for t in s["trials"]:
        folder = search["exp_dir"] / t["name"] / "mtbert_trained"
        [run] = [json.loads(p.read_text()) for p in folder.glob("*.json")]
        assert run["from"] == 0 and t["examples_trained"] == run["to"] >= t["examples_seen"]
        if t["status"] == "completed":  # its last evaluation at its very end
            assert run["to"] == t["examples_seen"] >= s["budget"]["max_examples"]
        else:
            assert run["how"] in ("stopped", "worker exit"), run
    assert s["examples_trained"] == sum(t["examples_trained"] for t in s["trials"])


def test_summary_consistent_with_ray(search, ray_trials):
    s = search["summary"]
    assert {t["trial_id"] for t in s["trials"]} == {t.trial_id for t in ray_trials.trials}
    # the best trained evaluation (the one at 0 examples shows the start, it is not ranked)
    trained = {t.trial_id: df[df["examples_seen"] > 0]["val/overall"].max()
               for t in ray_trials.trials
               for df in [ray_trials.trial_dataframes[t.trial_id]]}
    best = max(ray_trials.trials, key=lambda t: trained[t.trial_id])
    assert s["best_trial"]["trial_id"] == best.trial_id
    best_val = trained[best.trial_id]
    assert s["best_trial"]["val"]["val/overall"] == pytest.approx(best_val)
    assert s["best_trial"]["searched"] == {k: best.config[k] for k in ("lr", "dropout",
                                                                       "batch_size")}
    # the best checkpoint is a checkpoint Ray kept, and it scored the best value; with
    # --keep-checkpoints best (the default) its training state was removed at the end
    ckpt = Path(s["best_trial"]["checkpoint"])
    assert ckpt.is_dir() and not (ckpt / "state.pt").exists()
    assert not (ckpt / "heads.safetensors").exists() and not (ckpt / "encoder").exists()
    assert json.loads((ckpt / "metrics.json").read_text())["val/overall"] == pytest.approx(best_val)
    ranked = [t["best_val_overall"] for t in s["trials"] if t["best_val_overall"] is not None]
    assert max(ranked) == pytest.approx(best_val)


def test_mlflow_parent_and_child_runs(search, ray_trials, mlflow_runs):
    client, runs = mlflow_runs
    s = search["summary"]
    parents = [r for r in runs if r.data.tags.get("kind") == "search"]
    assert len(parents) == 1
    parent = parents[0]
    assert parent.info.run_id == s["mlflow"]["parent_run_id"]
    assert parent.info.status == "FINISHED"
    assert parent.data.params["space"] == "smoke" and parent.data.params["budget"] == "smoke"
    assert parent.data.params["seed"] == "0" and parent.data.params["search_alg"] == DEFAULT_SEARCHER
    assert parent.data.tags["best_trial_id"] == s["best_trial"]["trial_id"]
    assert parent.data.metrics["best/val/overall"] == pytest.approx(
        s["best_trial"]["val"]["val/overall"])
    for part in ("data_s", "setup_s", "tune_s", "first_ready_s", "finish_s", "total_s"):
        assert parent.data.metrics[f"time/{part}"] == pytest.approx(s["phases"][part])
    artifacts = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"summary.json", "summary.md", "report"} <= artifacts
    # its MLflow page says what the search found: summary.md is the run's note
    markdown = (search["exp_dir"] / "summary.md").read_text()
    assert parent.data.tags["mlflow.note.content"] == markdown
    assert f"best trial {s['best_trial']['trial_id']}" in markdown
    assert parent.data.metrics["examples_trained"] == s["examples_trained"] > 0

    children = [r for r in runs if r.data.tags.get("kind") == "trial"]
    assert len(children) == NUM_TRIALS  # exactly one per trial
    assert all(r.data.tags["mlflow.parentRunId"] == parent.info.run_id for r in children)
    by_trial = {r.data.tags["trial_id"]: r for r in children}
    summary_trials = {t["trial_id"]: t for t in s["trials"]}
    for trial in ray_trials.trials:
        run = by_trial[trial.trial_id]
        assert run.info.run_id == summary_trials[trial.trial_id]["mlflow_run_id"]
        # every hyperparameter as a param (the whole TrainConfig), sampled values exact
        assert float(run.data.params["lr"]) == pytest.approx(trial.config["lr"])
        assert int(run.data.params["batch_size"]) == trial.config["batch_size"]
        assert "smart_lambda_sst" in run.data.params and run.data.params["eval_dev"] == "False"
        # metric history: one point per evaluation, step = examples seen
        df = ray_trials.trial_dataframes[trial.trial_id]
        history = client.get_metric_history(run.info.run_id, "val/overall")
        assert [m.step for m in sorted(history, key=lambda m: m.step)] == list(df["examples_seen"])
        assert [m.value for m in sorted(history, key=lambda m: m.step)] == pytest.approx(
            list(df["val/overall"]))
        for key in ("val/sst_acc", "val/qqp_acc", "val/sts_corr", "examples_seen",
                    "time/train_s", "time/eval_s", "time/startup_s", "time/cpu_s"):
            assert len(client.get_metric_history(run.info.run_id, key)) == len(df)
        assert "time/entered_at" not in run.data.metrics  # a clock reading, Ray only
        # the time breakdown as Ray got it: training and scoring inside the trial's own clock
        # (the first evaluation is at 0 examples: the start, before any training)
        assert df["examples_seen"].iloc[0] == 0 and df["time/train_s"].iloc[0] == 0
        assert (df["time/train_s"].iloc[1:] > 0).all() and (df["time/eval_s"] > 0).all()
        assert (df["time/startup_s"] >= df["time/setup_s"]).all()
        # (the trial's own clock: entry to report.  Not Ray's time_total_s, which counts
        # only the time Ray spends waiting in train(): the trainer reports from its
        # checkpoint thread while training goes on, so it fell 3 ms short once)
        spent = df["time/reported_at"] - df["time/entered_at"]
        assert (df["time/train_s"] + df["time/eval_s"] <= spent).all()
        assert (df["time/entered_at"] <= df["timestamp"] + 1).all()
        status = summary_trials[trial.trial_id]["status"]
        assert run.data.tags["status"] == status
        assert run.data.tags["stopped_early"] == str(status == "stopped_early").lower()
        assert int(run.data.tags["rung_reached"]) == summary_trials[trial.trial_id]["rung_reached"]
        assert run.info.status == "FINISHED"
        names = {a.path for a in client.list_artifacts(run.info.run_id)}
        assert {"config.yaml", "predictions", "sst_confusion.png"} <= names
        preds = {a.path for a in client.list_artifacts(run.info.run_id, "predictions")}
        assert "predictions/val-sst.parquet" in preds

    ensembles = [r for r in runs if r.data.tags.get("kind") == "ensemble"]
    assert len(ensembles) == 1
    ens = ensembles[0]
    assert ens.data.params["members"] == ",".join(s["ensemble"]["members"])
    assert ens.data.metrics["val/overall"] == pytest.approx(s["ensemble"]["val"]["val/overall"])
    assert ens.data.metrics["dev/overall"] == pytest.approx(s["ensemble"]["dev"]["dev/overall"])


# ---------------------------------------------------------------------- bad input
BAD_SPACE = {
    "unknown_key": "params:\n  learnin_rate: {uniform: [0.1, 0.2]}\n",
    "bad_distribution": "params:\n  lr: {gaussian: [0.1, 0.2]}\n",
    "out_of_range": "params:\n  dropout: {uniform: [0.0, 2.0]}\n",
    "data_field": "params:\n  max_train_per_task: {choice: [10, 20]}\n",
}


def _assert_rejected(capsys, rc, storage: Path, expected: str):
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert len(err) == 1 and err[0].startswith("error: "), err
    assert expected in err[0], err[0]
    assert not storage.exists(), "something was written"


@pytest.mark.parametrize("case", sorted(BAD_SPACE))
def test_bad_space_file_exits_2_with_nothing_written(tmp_path, capsys, tiny_model_dir,
                                                     tiny_data_dir, case):
    from mtbert.tune.cli import main
    space = tmp_path / f"{case}.yaml"
    space.write_text("description: bad\n" + BAD_SPACE[case], encoding="utf-8")
    storage = tmp_path / "out"
    rc = main(["--space", str(space), "--model", tiny_model_dir, "--data-dir", tiny_data_dir,
               "--storage-path", str(storage)])
    key = BAD_SPACE[case].split()[1].rstrip(":")
    _assert_rejected(capsys, rc, storage, f"{space}: {key}:")


@pytest.mark.parametrize("extra, expected", [
    (["--num-samples", "0"], "--num-samples 0: must be >= 1"),
    (["--max-concurrent", "0"], "--max-concurrent 0: must be >= 1"),
    (["--cpus-per-trial", "0"], "--cpus-per-trial 0: must be > 0"),
    (["--cpus-per-trial", "512"], "--cpus-per-trial 512: this machine has only"),
    (["--gpus-per-trial", "-1"], "--gpus-per-trial -1: must be >= 0"),
    (["--seed", "-3"], "--seed -3: must be >= 0"),
    (["--ensemble-top-k", "9", "--num-samples", "4"], "--ensemble-top-k 9: more than"),
    (["--ensemble-top-k", "0"], "--ensemble-top-k 0: must be >= 1"),
    (["--experiment", "a/b"], "--experiment 'a/b': use letters"),
    (["--mlflow-uri", "ftp://example/x"], "unsupported scheme"),
    (["--mlflow-uri", "http://127.0.0.1:9"], "MLflow server unreachable"),
    (["--resume"], "--resume needs --experiment"),
    (["--resume", "--experiment", "nothing-here"], "no search to resume"),
    (["--data-dir", "/nonexistent/data"], "--data-dir /nonexistent/data: folder not found"),
    (["--model", "/nonexistent/model"], "no such model folder"),
    (["--space", "no_such_space"], "unknown search space"),
    (["--budget", "huge"], "argument --budget: invalid choice"),
    (["--num-samples", "many"], "argument --num-samples: invalid int value"),
    (["--search-alg", "grid"], "argument --search-alg: invalid choice"),
])
def test_bad_cli_value_exits_2_with_nothing_written(tmp_path, capsys, tiny_model_dir,
                                                    tiny_data_dir, extra, expected):
    from mtbert.tune.cli import main
    storage = tmp_path / "out"
    argv = ["--space", "smoke", "--budget", "smoke", "--model", tiny_model_dir,
            "--data-dir", tiny_data_dir, "--storage-path", str(storage)]
    flags = extra[0::2]
    argv = [a for i, a in enumerate(argv) if not (a in flags or (i and argv[i - 1] in flags))]
    try:
        rc = main(argv + extra)
    except SystemExit as exc:  # argparse errors
        rc = exc.code
    _assert_rejected(capsys, rc, storage, expected)


def test_bad_data_file_exits_2(tmp_path, capsys, tiny_model_dir, tiny_data_dir):
    import shutil

    from mtbert.tune.cli import main
    data = tmp_path / "data"
    shutil.copytree(tiny_data_dir, data)
    (data / "sts-train.csv").write_text("\tid\tsentence1\tsentence2\tsimilarity\n"
                                        "0\tx1\ta\tb\t9.0\n", encoding="utf-8")
    storage = tmp_path / "out"
    rc = main(["--space", "smoke", "--budget", "smoke", "--model", tiny_model_dir,
               "--data-dir", str(data), "--storage-path", str(storage)])
    _assert_rejected(capsys, rc, storage, "sts-train.csv, line 2")


def test_existing_experiment_needs_resume(tmp_path, capsys, tiny_model_dir, tiny_data_dir):
    from mtbert.tune.cli import main
    storage = tmp_path / "out"
    (storage / "taken").mkdir(parents=True)
    rc = main(["--space", "smoke", "--budget", "smoke", "--model", tiny_model_dir,
               "--data-dir", tiny_data_dir, "--storage-path", str(storage),
               "--experiment", "taken"])
    err = capsys.readouterr().err
    assert rc == 2 and "already exists; pass --resume" in err
    assert [p.name for p in storage.iterdir()] == ["taken"]


def test_cli_process_exit_codes(tmp_path):
    """The real `python tune_driver.py`: --list-spaces, and a bad space -> exit 2, one line."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    out = subprocess.run([sys.executable, "tune_driver.py", "--list-spaces"], cwd=REPO,
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0
    names = [line.split()[0] for line in out.stdout.splitlines()]
    assert {"smart", "sampler", "pcgrad", "arch", "pretrain", "full", "smoke"} <= set(names)
    bad = tmp_path / "bad.yaml"
    bad.write_text("description: bad\nparams:\n  dropout: {uniform: [0.1, 3.0]}\n")
    out = subprocess.run([sys.executable, "tune_driver.py", "--space", str(bad),
                          "--storage-path", str(tmp_path / "out")], cwd=REPO,
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        f"error: {bad}: dropout: uniform bound 3 is outside the valid range of dropout "
        "(must be <= 0.9)"]
    assert not (tmp_path / "out").exists()
