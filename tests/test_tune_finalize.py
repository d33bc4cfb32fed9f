"""End-of-search pieces without Ray: ensemble of member predictions (vote and greedy),
the report's importances and plots, on hand-made data."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from mtbert.tune.results.finalists import build_ensemble
from mtbert.tune.results.importances import param_importances
from mtbert.tune.results.records import TrialRecord
from mtbert.tune.results.report import write_report


class FakeData:
    """Just what build_ensemble reads: ``split(task, name).labels``."""

    def __init__(self, labels):
        self.labels = labels

    def split(self, task, name):
        if name == "test":
            return SimpleNamespace(labels=None)
        return SimpleNamespace(labels=np.asarray(self.labels[name][task]))


GOLD = {"sst": [0, 1, 2, 3, 4, 0], "qqp": [1, 0, 1, 0, 1, 0],
        "sts": [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]}


def member(sst, qqp, sts):
    split = {"sst": np.array(sst), "qqp": np.array(qqp, dtype=float), "sts": np.array(sts)}
    return {"val": split, "dev": split, "test": {"sst": split["sst"], "sts": split["sts"]}}


PREDS = {
    # best on val: sst 4/6, qqp 4/6, sts r high
    "a": member([0, 1, 2, 3, 0, 1], [0.9, 0.1, 0.8, 0.2, 0.1, 0.7], [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]),
    "b": member([0, 1, 0, 0, 4, 0], [0.9, 0.1, 0.2, 0.6, 0.9, 0.1], [5.0, 4.0, 3.0, 2.0, 1.0, 0.0]),
    "c": member([1, 2, 2, 3, 4, 0], [0.2, 0.7, 0.9, 0.1, 0.8, 0.2], [0.5, 1.5, 2.5, 3.5, 4.5, 4.0]),
}
DATA = FakeData({"val": GOLD, "dev": GOLD})


def test_vote_ensemble_exact():
    res = build_ensemble(["a", "b", "c"], PREDS, DATA, "vote")
    assert res.labels["val"]["sst"].tolist() == [0, 1, 2, 3, 4, 0]
    # qqp classes a=[1,0,1,0,0,1] b=[1,0,0,1,1,0] c=[0,1,1,0,1,0]
    assert res.labels["val"]["qqp"].tolist() == [1, 0, 1, 0, 1, 0]
    assert res.labels["val"]["sts"].tolist() == [0.5, 1.5, 2.5, 3.0, 4.0, 4.0]
    assert res.metrics["val/sst_acc"] == 1.0 and res.metrics["val/qqp_acc"] == 1.0
    assert res.best_single["val/sst_acc"] == pytest.approx(4 / 6)
    assert res.weights == {"sst": [1, 1, 1], "qqp": [1, 1, 1], "sts": [1, 1, 1]}
    assert set(res.labels["test"]) == {"sst", "sts"}


def test_greedy_ensemble_selects_on_val_per_task():
    res = build_ensemble(["a", "b", "c"], PREDS, DATA, "greedy")
    assert res.weights["sst"] == [1, 1, 1]          # the 3-way majority fixes every row
    assert res.weights["sts"] == [1, 0, 0]          # member a is already perfect (r = 1)
    assert res.metrics["val/sst_acc"] == 1.0
    assert res.metrics["val/sts_corr"] == pytest.approx(1.0)
    assert res.metrics["val/overall"] >= res.best_single["val/overall"]


def _record(tid, status, lr, bs, score, history):
    return TrialRecord(trial_id=tid, name=f"trial_{tid}", status=status,
                       config={"lr": lr, "batch_size": bs, "warmup_ratio": 0.0},
                       history=history, best={"val/overall": score})


def test_report_files_and_importances(tmp_path):
    from optuna.distributions import CategoricalDistribution, FloatDistribution
    rng = np.random.default_rng(0)
    records = []
    for i in range(8):
        lr = float(10 ** rng.uniform(-5, -3))
        bs = [8, 16][i % 2]
        score = 0.4 + 0.05 * np.log10(lr / 1e-5)  # lr matters, batch size does not
        seen = [50, 100] if i % 3 else [50]
        hist = [{"examples_seen": s, "val/overall": score * s / 100, "timestamp": 10 * i + j}
                for j, s in enumerate(seen)]
        records.append(_record(f"t{i}", "completed" if len(seen) == 2 else "stopped_early",
                               lr, bs, score, hist))
    records.append(_record("bad", "error", 1e-4, 8, float("-inf"), []))
    dists = {"lr": FloatDistribution(1e-5, 1e-3, log=True),
             "batch_size": CategoricalDistribution([8, 16]), "warmup_ratio": None}
    imp = param_importances(records, dists)
    assert set(imp) == {"fanova", "ped_anova"}
    assert imp["fanova"]["lr"] > imp["fanova"]["batch_size"]
    out = write_report(records, dists, tmp_path, rungs=[50, 100])
    for key in ("best_so_far", "learning_curves", "importances", "importances_json"):
        assert (tmp_path / out["files"][key].split("/")[-1]).is_file()
    # too few usable trials: no importances, no crash
    assert param_importances(records[:1], dists) == {}


def test_ensemble_run_is_reused_when_unchanged_and_superseded_when_changed(tmp_path):
    """A search finalised twice (Ctrl-C, then --resume): the same ensemble keeps its MLflow
    run; a different one gets a new run (params are immutable) and the old one is kept,
    tagged ``superseded_by``."""
    from mtbert.tune.infra.tracking import SearchTracker
    tracker = SearchTracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "mtbert/test", tmp_path,
                            fresh=True)
    tracker.start_parent("search", {"space": "x"}, {})
    first = tracker.ensemble_run("e", {"method": "vote", "members": "a,b"})
    assert tracker.ensemble_run("e", {"method": "vote", "members": "a,b"}) == first
    second = tracker.ensemble_run("e", {"method": "vote", "members": "a,c,b"})
    assert second != first
    old, new = tracker.client.get_run(first), tracker.client.get_run(second)
    assert old.data.params == {"method": "vote", "members": "a,b"}
    assert new.data.params == {"method": "vote", "members": "a,c,b"}
    assert old.data.tags["superseded_by"] == second and new.data.tags["supersedes"] == first
    assert new.data.tags["mlflow.parentRunId"] == tracker.parent_run_id
    # the state file names the current ensemble, so a third finalisation reuses it
    reread = SearchTracker(tracker.tracking_uri, "mtbert/test", tmp_path)
    assert reread.state["ensemble_run_id"] == second


def test_a_driver_killed_while_ending_a_trial_resumes_with_its_end(tmp_path):
    """The tracker records a trial's end in its state file before it writes the MLflow run:
    a driver killed between the two resumes with the trial ended (so it is not trained
    again) and writes the run's end then; a frozen trial's run takes no other end."""
    from mtbert.tune.infra.tracking import SearchTracker
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = SearchTracker(uri, "mtbert/test", tmp_path, fresh=True)
    tracker.start_parent("search", {"space": "x"}, {})
    run_id = tracker.child_run("t1", "trial_t1", {"lr": 1e-4})

    def killed(child):
        raise KeyboardInterrupt  # SIGKILL of the driver, here

    tracker._write_end = killed
    with pytest.raises(KeyboardInterrupt):
        tracker.end_trial("t1", "FINISHED", {"status": "completed", "examples_seen": 192})
    assert tracker.client.get_run(run_id).info.status == "RUNNING"
    resumed = SearchTracker(uri, "mtbert/test", tmp_path, fresh=True)  # reads the file
    assert resumed.freeze_ended() == {"t1": {"status": "FINISHED", "error_reason": ""}}
    run = resumed.client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert (run.data.tags["status"], run.data.tags["examples_seen"]) == ("completed", "192")
    # what the driver's records keep for it, whatever Ray's replay of it reports
    assert resumed.ends.before_resume() == {"t1": {"status": "completed", "examples_seen": "192"}}
    resumed.end_trial("t1", "FAILED", {"status": "error", "error_reason": "replayed"})
    run = resumed.client.get_run(run_id)
    assert (run.info.status, run.data.tags["status"]) == ("FINISHED", "completed")


@pytest.mark.parametrize("kill_at", ["before the journal", "between the journal and the state"])
def test_a_driver_killed_while_logging_an_evaluation_loses_it_nowhere(tmp_path, monkeypatch,
                                                                       kill_at):
    """An evaluation's MLflow point and the state file's ``last_step`` (what a resume skips)
    are written journal first: a driver killed at either moment of logging one resumes with
    the point in MLflow exactly once -- sent from the journal, or logged again when the
    restored trial reports it again.  (Recorded first, a kill before the journal lost the
    point: one CI run's trial had MLflow steps [0, 54, 146, 192] against Ray's
    [0, 54, 102, 146, 192].)"""
    from mtbert.tune.infra import outbox as ob
    from mtbert.tune.infra import tracking
    from mtbert.tune.infra.tracking import SearchTracker
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = SearchTracker(uri, "mtbert/test", tmp_path, fresh=True, background=True)
    tracker.start_parent("search", {"space": "x"}, {})
    tracker.child_run("t1", "trial_t1", {"lr": 1e-4})
    assert tracker.log_trial_result("t1", {"val/overall": 0.5}, 0)
    assert tracker.flush(30)

    def killed(*args, **kwargs):
        raise KeyboardInterrupt  # SIGKILL of the driver, here
    if kill_at == "before the journal":
        monkeypatch.setattr(tracker.outbox, "put", killed)
    else:
        monkeypatch.setattr(tracker, "save", killed)
    with pytest.raises(KeyboardInterrupt):
        tracker.log_trial_result("t1", {"val/overall": 0.6}, 54)
    monkeypatch.undo()
    # a new driver process: this one's outbox and in-memory state gone, the files kept
    ob.release(tmp_path / ob.OUTBOX_DIR)
    tracking._SHARED_STATES.pop(str(tracker.state_path))
    resumed = SearchTracker(uri, "mtbert/test", tmp_path, background=True)
    # the restored trial reports its evaluations again (from an earlier checkpoint)
    logged = [resumed.log_trial_result("t1", {"val/overall": v}, step)
              for step, v in ((0, 0.5), (54, 0.6), (102, 0.7))]
    assert logged == [False, kill_at == "before the journal", True]
    assert resumed.flush(30)
    history = resumed.client.get_metric_history(resumed.run_of("t1"), "val/overall")
    assert sorted((m.step, m.value) for m in history) == [(0, 0.5), (54, 0.6), (102, 0.7)]
    resumed.close()


def test_plots_label_every_axis_and_keep_legends_off_the_curves():
    from mtbert.tune.results.report import (best_so_far_figure, importances_figure,
                                            learning_curves_figure)
    from mtbert.tune.results.records import TrialStatus
    trials = [TrialRecord(f"t{i}", f"trial_t{i}", TrialStatus.COMPLETED, {"lr": 1e-4 * i},
                          history=[{"examples_seen": 48 * k, "val/overall": 0.4 + 0.01 * k * i,
                                    "timestamp": float(10 * i + k)} for k in (1, 2, 3)])
              for i in range(1, 9)]
    figures = [best_so_far_figure(trials), learning_curves_figure(trials, rungs=[48, 144]),
               importances_figure({"fanova": {"lr": 0.8, "dropout": 0.2},
                                   "ped_anova": {"lr": 0.6, "dropout": 0.4}})]
    for fig in figures:
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        for ax in fig.axes:
            assert ax.get_xlabel() and ax.get_ylabel(), ax.get_title()
            legend = ax.get_legend()
            if legend is not None:  # entirely to the right of the plotting area
                assert legend.get_window_extent(renderer).x0 >= ax.get_window_extent(renderer).x1
    import matplotlib.pyplot as plt
    for fig in figures:
        plt.close(fig)


def test_the_store_opened_while_ray_starts_is_the_one_the_tracker_uses(tmp_path):
    """``open_store_early``: a new SQLite store's tables are made on a thread (as the
    driver does while Ray starts); the tracker made after it gets MLflow's same store
    object and writes to it; a server URI is left alone."""
    import sqlite3

    from mtbert.tune.infra.tracking import SearchTracker, open_store_early
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    thread = open_store_early(uri)
    thread.join(timeout=120)
    assert not thread.is_alive()
    with sqlite3.connect(tmp_path / "mlflow.db") as db:
        tables = {name for (name,) in db.execute("select name from sqlite_master")}
    assert {"experiments", "runs", "metrics", "alembic_version"} <= tables
    tracker = SearchTracker(uri, "mtbert/test", tmp_path, fresh=True)
    parent = tracker.start_parent("search", {"space": "x"}, {})
    from mlflow import MlflowClient
    store = MlflowClient(tracking_uri=uri)._tracking_client.store
    assert tracker.client._tracking_client.store is store  # one store per URI, opened once
    assert tracker.client.get_run(parent).data.params == {"space": "x"}
    assert open_store_early("http://127.0.0.1:5000") is None


def test_a_finalist_s_val_predictions_come_from_its_checkpoint_as_scoring_gives_them(
        tiny_config, tmp_path):
    """The finalists' phase reads val from the predictions a trial wrote with its checkpoint
    (the same model, batches and precision scored them): equal, in value and dtype, to
    scoring the checkpoint's weights again; a folder without them (an exported model) is
    scored."""
    import shutil

    from mtbert.data import load_data
    from mtbert.loop.trainer import Trainer
    from mtbert.tune.results.finalists import kept_val_predictions, predict_member
    cfg = tiny_config(epochs=1, eval_dev=False)
    data = load_data(cfg)
    Trainer(cfg, data, tmp_path / "run").fit()
    checkpoint = tmp_path / "run" / "checkpoint"
    bare = tmp_path / "bare"
    shutil.copytree(checkpoint, bare)
    shutil.rmtree(bare / "predictions")
    assert kept_val_predictions(str(bare), data) is None
    read = predict_member(str(checkpoint), data, splits=("val",))["val"]
    scored = predict_member(str(bare), data, splits=("val",))["val"]
    assert set(read) == set(scored) == {"sst", "qqp", "sts"}
    for task, values in scored.items():
        assert read[task].dtype == values.dtype, task
        np.testing.assert_array_equal(read[task], values)
    other_rows = load_data(tiny_config(epochs=1, eval_dev=False, max_eval_per_task=3))  # fewer
    assert kept_val_predictions(str(checkpoint), other_rows) is None
