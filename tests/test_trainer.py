"""The training loop on a tiny random BERT: loss falls, metrics are right, resume is exact,
the CLI writes its files and refuses bad input with exit 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pyarrow.parquet as pq
import pytest

from mtbert.data import load_data
from mtbert.run.metrics import overall_score, pearson
from mtbert.run.inference import load_checkpoint_model
from mtbert.loop.trainer import Trainer

REPO_ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]


def test_training_loss_falls(tiny_config, tmp_path):
    cfg = tiny_config(epochs=12, lr=3e-3, eval_dev=False, schedule="round_robin", update="summed")
    trainer = Trainer(cfg, load_data(cfg), tmp_path)
    trainer.fit()
    start, first, last = trainer.history[0], trainer.history[1], trainer.history[-1]
    assert start["examples_seen"] == 0 and "train/loss_sst" not in start  # eval_at_start
    # SST (5 classes, sentiment words) and STS (topic overlap) are learnable by a tiny random
    # BERT in 72 steps; QQP's topic matching needs more and is not asserted here.
    for task in ("sst", "sts"):
        assert last[f"train/loss_{task}"] < 0.8 * first[f"train/loss_{task}"], task
    assert last["val/overall"] > first["val/overall"]
    assert len(trainer.history) == 1 + 12 and last["examples_seen"] == 12 * 3 * 54  # 60 rows - 6 val


def test_time_breakdown_is_cumulative_and_bounded_by_the_wall_clock(tiny_config, tmp_path):
    import time
    cfg = tiny_config(epochs=2, eval_every=100, eval_dev=False)
    reports = []
    started = time.perf_counter()
    trainer = Trainer(cfg, load_data(cfg), tmp_path,
                      report=lambda m, d: (reports.append(dict(m)), time.sleep(0.2)))
    trainer.fit()
    wall = time.perf_counter() - started
    assert len(reports) >= 3
    for key in ("time/setup_s", "time/train_s", "time/eval_s", "time/checkpoint_s"):
        values = [r[key] for r in reports]
        assert values == sorted(values) and values[0] >= 0, key
    assert reports[-1]["time/train_s"] > 0 and reports[-1]["time/eval_s"] > 0
    # the 0.2 s spent in each report callback is spent on the checkpoint thread, while
    # training goes on: counted as report time, neither training nor checkpoint (the
    # training thread's own wait for checkpoints); each report counts the reports before it
    assert reports[-1]["time/report_s"] >= 0.2 * (len(reports) - 1)
    # each report counts the checkpoints written up to it (the 0-example one has none)
    assert [r["checkpoints_written"] for r in reports] == list(range(len(reports)))
    sizes = [r["checkpoint_bytes"] for r in reports]
    assert sizes[0] == 0 and all(b > a for a, b in zip(sizes, sizes[1:]))
    assert reports[-1]["time/train_s"] + reports[-1]["time/eval_s"] < reports[-1]["train_seconds"]
    last = reports[-1]
    assert (last["time/setup_s"] + last["time/train_s"] + last["time/eval_s"]
            + last["time/checkpoint_s"]) <= wall


def test_next_eval_point_fixed_and_geometric():
    from mtbert.loop.trainer import next_eval_point
    assert [next_eval_point(s, 100) for s in (0, 99, 100, 250)] == [100, 100, 200, 300]
    # growth = ASHA's reduction factor: the points are its rungs 222, 666, 1998
    assert [next_eval_point(s, 222, 3.0) for s in (0, 221, 222, 700, 1997)] == [
        222, 222, 666, 1998, 1998]
    assert next_eval_point(1000, 1000, 2.0) == 2000 and next_eval_point(2016, 1000, 2.0) == 4000


def test_geometric_evaluations_land_on_the_points_and_the_end(tiny_config, tmp_path):
    from mtbert.loop.trainer import next_eval_point
    cfg = tiny_config(epochs=3, eval_every=40, eval_growth=2.0, eval_dev=False)
    seen = []
    trainer = Trainer(cfg, load_data(cfg), tmp_path,
                      report=lambda m, d: seen.append(m["examples_seen"]))
    trainer.fit()
    total = 3 * 3 * 54  # epochs x tasks x training rows
    assert seen[0] == 0 and seen[-1] == total  # eval_at_start, then the points and the end
    point, expected = 40, []
    for s in seen[1:-1]:  # each report is the first step at or past the next point
        assert s >= point and s - cfg.batch_size < point, (s, point)
        expected.append(point)
        point = next_eval_point(s, 40, 2.0)
    assert expected == [40, 80, 160, 320] and point > total


def test_metrics_match_the_written_predictions(tiny_config, tmp_path):
    cfg = tiny_config(epochs=2)
    trainer = Trainer(cfg, load_data(cfg), tmp_path)
    metrics = trainer.fit()
    pred = tmp_path / "predictions"
    for split in ("val", "dev"):
        sst = pq.read_table(pred / f"{split}-sst.parquet").to_pandas()
        qqp = pq.read_table(pred / f"{split}-qqp.parquet").to_pandas()
        sts = pq.read_table(pred / f"{split}-sts.parquet").to_pandas()
        sst_acc = float((sst.prediction == sst.label).mean())
        qqp_acc = float((qqp.prediction == qqp.label).mean())
        assert (qqp.prediction == (qqp.probability >= 0.5)).all()
        sts_r = pearson(sts.prediction.to_numpy(), sts.label.to_numpy())
        assert metrics[f"{split}/sst_acc"] == pytest.approx(sst_acc)
        assert metrics[f"{split}/qqp_acc"] == pytest.approx(qqp_acc)
        assert metrics[f"{split}/sts_corr"] == pytest.approx(sts_r)
        assert metrics[f"{split}/overall"] == pytest.approx(overall_score(sst_acc, qqp_acc, sts_r))
        assert np.array(metrics[f"{split}/sst_confusion"]).sum() == len(sst)
    csv_lines = (pred / "sst-test-output.csv").read_text().splitlines()
    assert csv_lines[0] == "id,Predicted_Sentiment" and len(csv_lines) == 1 + 20
    assert (pred / "sts-test-output.csv").read_text().startswith("id,Predicted_Similarity")
    assert not (pred / "qqp-test-output.csv").exists()  # there is no QQP test-student file
    # the checkpoint carries the val predictions of its evaluation
    ckpt_sts = pq.read_table(tmp_path / "checkpoint" / "predictions" / "val-sts.parquet").to_pandas()
    assert ckpt_sts.prediction.tolist() == pq.read_table(pred / "val-sts.parquet").to_pandas().prediction.tolist()
    # the checkpoint reloads to the same predictions
    cfg_back, model = load_checkpoint_model(tmp_path / "checkpoint")
    assert cfg_back == cfg
    trainer.model = model
    assert trainer.evaluate("val")["val/overall"] == pytest.approx(metrics["val/overall"])


def test_soft_scores_are_the_models_gold_class_probabilities_row_by_row(tiny_config, tmp_path):
    """val/sst_p_gold and val/qqp_p_gold equal the probabilities of the gold class that the
    model gives each row scored alone (so the length-ordered batches are put back in row
    order); the SST classes are those probabilities' argmax; overall_soft combines them."""
    import torch

    from mtbert.data import collate
    cfg = tiny_config(epochs=1, eval_dev=False)
    trainer = Trainer(cfg, load_data(cfg), tmp_path, checkpoints=False)
    trainer.fit()
    metrics = trainer.evaluate("val")
    model = trainer.model.eval()
    for task in ("sst", "qqp"):
        split = trainer.data.split(task, "val")
        p_gold = []
        for row in range(len(split)):
            batch = collate(split, np.array([row]), trainer.encodings[task], trainer.data.pad_id)
            batch.pop("labels")
            with torch.no_grad():
                logits = model(task, batch).logits.float()[0]
            gold = int(split.labels[row])
            p = logits.softmax(-1)[gold] if task == "sst" else torch.sigmoid(logits).reshape(())
            p_gold.append(float(p) if task == "sst" or gold == 1 else 1.0 - float(p))
        assert metrics[f"val/{task}_p_gold"] == pytest.approx(np.mean(p_gold), abs=1e-5), task
        assert metrics[f"val/{task}_p_gold_se"] == pytest.approx(
            np.std(p_gold, ddof=1) / np.sqrt(len(p_gold)), abs=1e-5), task
    assert metrics["val/overall_soft"] == pytest.approx(overall_score(
        metrics["val/sst_p_gold"], metrics["val/qqp_p_gold"], metrics["val/sts_corr"]))
    hard = trainer._last_val_predictions["sst"]
    assert hard.ndim == 1 and hard.dtype == np.int64
    assert metrics["val/sst_acc"] == pytest.approx(
        float((hard == trainer.data.split("sst", "val").labels).mean()))


@pytest.mark.parametrize("schedule,update,extra,stop_after", [
    ("random_order", "per_task", {}, 2),
    ("sqrt", "summed", {}, 2),
    # learned cosine map, fitted QQP cosine start, faster heads; a resumed run
    # does not evaluate at 0 again (with a report callback the 0-example evaluation has
    # no checkpoint: the first one to resume from is the first trained one)
    ("random_order", "per_task", {"pair_encoding": "siamese", "sts_head": "cosine",
                                  "head_lr_multiplier": 10.0}, 2),
    ("random_order", "per_task", {"pair_encoding": "siamese", "sts_head": "cosine"}, 3),
    # fixed-size batches (filler rows) at static lengths, with SMART's noise and replays
    ("random_order", "per_task", {"pad_lengths": "buckets", "smart_lambda_sst": 1.0,
                                  "smart_mu": 0.5}, 2),
])
def test_resume_from_checkpoint_is_exact(tiny_config, tmp_path, schedule, update, extra,
                                         stop_after):
    cfg = tiny_config(epochs=2, eval_every=40, max_examples=200, schedule=schedule, update=update,
                      dropout=0.2, eval_dev=False, **extra)
    data = load_data(cfg)
    straight_reports = []
    Trainer(cfg, data, tmp_path / "a",
            report=lambda m, d: straight_reports.append(m["val/overall"])).fit()
    # interrupt: a run that stops after its stop_after-th evaluation (the first is the one
    # at 0 examples, reported without a checkpoint)

    class Stop(Exception):
        pass

    interrupted_reports = []

    def stop_after_n(metrics, checkpoint_dir):
        interrupted_reports.append(metrics["val/overall"])
        if len(interrupted_reports) == stop_after:
            raise Stop

    with pytest.raises(Stop):
        Trainer(cfg, data, tmp_path / "b", report=stop_after_n).fit()
    resumed_reports, resumed_seen = [], []
    resumed = Trainer(cfg, data, tmp_path / "b", resume_from=tmp_path / "b" / "checkpoint",
                      report=lambda m, d: (resumed_reports.append(m["val/overall"]),
                                           resumed_seen.append(m["examples_seen"])))
    assert resumed.examples_seen >= (40 if stop_after > 1 else 0)
    final = resumed.fit()
    assert interrupted_reports == straight_reports[:stop_after]
    assert resumed_reports == straight_reports[stop_after:]  # bit-identical on CPU
    assert 0 not in resumed_seen  # the 0-example evaluation is not repeated on resume
    history = [json.loads(line) for line in (tmp_path / "b" / "history.jsonl").open()]
    assert [h["examples_seen"] for h in history][0] == 0
    assert len({h["examples_seen"] for h in history}) == len(history)
    straight_final = json.loads((tmp_path / "a" / "metrics.json").read_text())
    assert final["val/overall"] == straight_final["val/overall"]
    assert final["examples_seen"] == straight_final["examples_seen"]


def test_non_finite_loss_stops_with_a_clear_reason(tiny_config, tmp_path):
    from mtbert.loop.trainer import NonFiniteLossError
    cfg = tiny_config(epochs=1, eval_dev=False, schedule="sequential")
    trainer = Trainer(cfg, load_data(cfg), tmp_path)
    with __import__("torch").no_grad():
        trainer.model.qqp_out.bias.fill_(float("inf"))  # a diverged QQP head
    with pytest.raises(NonFiniteLossError, match=r"qqp loss became (nan|inf) at \d+ examples"):
        trainer.fit()
    assert trainer.examples_seen > 0  # SST (first in the sequence) trained before QQP failed


def test_resume_of_a_foreign_or_damaged_checkpoint_names_the_file_and_setting(tiny_config,
                                                                             tmp_path):
    from mtbert.core.errors import ConfigError, DataError
    cfg = tiny_config(max_examples=16, eval_dev=False)
    data = load_data(cfg)
    Trainer(cfg, data, tmp_path).fit()
    checkpoint = tmp_path / "checkpoint"
    # another head shape: the model state does not fit; the setting that differs is named
    with pytest.raises(ConfigError, match=r"heads\.safetensors: written under a different "
                       r"config: shared_pair_layer=False there, True now .*model state does not fit: "
                       r"RuntimeError: .*Missing key") as err:
        Trainer(cfg.replace(shared_pair_layer=True), data, tmp_path, resume_from=checkpoint)
    assert err.value.key == "shared_pair_layer"
    # a run-length change alone is fine (it is what a longer resumed run does)
    assert Trainer(cfg.replace(max_examples=32), data, tmp_path,
                   resume_from=checkpoint).examples_seen >= 16
    (checkpoint / "history.json").write_text('[{"val/overall": 0.5}')
    with pytest.raises(DataError, match=r"history\.json: unreadable \(JSONDecodeError"):
        Trainer(cfg, data, tmp_path, resume_from=checkpoint)
    (checkpoint / "history.json").write_text("[]")
    import torch
    heads = (checkpoint / "heads.safetensors").read_bytes()
    (checkpoint / "heads.safetensors").write_bytes(heads[:len(heads) // 2])  # truncated
    for load in (load_checkpoint_model, lambda c: Trainer(cfg, data, tmp_path, resume_from=c)):
        with pytest.raises(DataError, match=r"checkpoint/heads\.safetensors: damaged or not a "
                           r"safetensors file .*; expected a training state"):
            load(checkpoint)
    (checkpoint / "heads.safetensors").write_bytes(heads)
    torch.save({"model": {}}, checkpoint / "state.pt")
    with pytest.raises(DataError, match=r"state\.pt: not a training state \(no 'optimizer'"):
        Trainer(cfg, data, tmp_path, resume_from=checkpoint)
    # a checkpoint of the single-file layout (weights inside state.pt): one clear error
    (checkpoint / "encoder" / "model.safetensors").unlink()
    with pytest.raises(DataError, match=r"encoder/model\.safetensors: missing \(a checkpoint "
                       r"written before the weights were stored apart from state\.pt"):
        load_checkpoint_model(checkpoint)


def run_cli(*args, cwd=None):
    """A fresh ``python -m mtbert.train`` process."""
    return subprocess.run([sys.executable, "-m", "mtbert.train", *args], capture_output=True,
                          text=True, cwd=cwd or REPO_ROOT, timeout=300)


@pytest.fixture(scope="module")
def forked_cli(tmp_path_factory):
    """``python -m mtbert.train`` processes forked after its imports (tests/forked_cli.py):
    the bad-input cases below, each a process without the seconds of torch and
    transformers imports (test_cli_writes_the_contracted_files runs a fresh one)."""
    from forked_cli import TRAIN_IMPORTS, ForkedCli

    with ForkedCli(TRAIN_IMPORTS, tmp_path_factory.mktemp("forked-cli"), dict(os.environ),
                   REPO_ROOT) as server:
        yield lambda *args: server.run([sys.executable, "-m", "mtbert.train", *args],
                                       cwd=REPO_ROOT, env=dict(os.environ), timeout=300)


def test_cli_writes_the_contracted_files(tiny_model_dir, tiny_data_dir, tmp_path):
    out = tmp_path / "run"
    result = run_cli("--data-dir", tiny_data_dir, "--out", str(out), "--set", f"model={tiny_model_dir}",
                     "--set", "epochs=1", "--set", "max_length=32", "--set", "batch_size=16")
    assert result.returncode == 0, result.stderr
    metrics = json.loads((out / "metrics.json").read_text())
    for prefix in ("val", "dev"):
        for key in ("sst_acc", "qqp_acc", "sts_corr", "overall", "sst_f1_macro", "qqp_f1"):
            assert f"{prefix}/{key}" in metrics
    assert "batch_size: 16" in (out / "config.yaml").read_text()
    assert (out / "checkpoint" / "state.pt").is_file()
    assert (out / "predictions" / "sst-val-output.csv").is_file()
    assert "[mtbert] eval @" in result.stderr  # progress is shown


@pytest.mark.parametrize("extra,fragment", [
    (["--set", "learning_rate=0.1"], "unknown config key 'learning_rate'"),
    (["--set", "dropout=2"], "dropout=2"),
    (["--set", "model=/no/such/model"], "no such model folder"),
    (["--config", "/no/such.yaml"], "cannot read config file"),
])
def test_cli_bad_input_exits_2_and_writes_nothing(forked_cli, tiny_model_dir, tiny_data_dir,
                                                   tmp_path, extra, fragment):
    out = tmp_path / "run"
    result = forked_cli("--data-dir", tiny_data_dir, "--out", str(out), "--set",
                     f"model={tiny_model_dir}", *extra)
    assert result.returncode == 2
    assert fragment in result.stderr and result.stderr.count("error:") == 1
    assert not out.exists()


def test_cli_bad_data_file_exits_2_naming_file_and_line(forked_cli, tiny_model_dir,
                                                         tiny_data_dir, tmp_path):
    import shutil
    data = tmp_path / "data"
    shutil.copytree(tiny_data_dir, data)
    lines = (data / "sts-train.csv").read_text().splitlines()
    lines[5] = lines[5].rsplit("\t", 1)[0] + "\t7.5"
    (data / "sts-train.csv").write_text("\n".join(lines) + "\n")
    out = tmp_path / "run"
    result = forked_cli("--data-dir", str(data), "--out", str(out), "--set",
                        f"model={tiny_model_dir}")
    assert result.returncode == 2
    assert f"{data / 'sts-train.csv'}, line 6: similarity='7.5'" in result.stderr
    assert not out.exists()


def test_the_trainer_trains_on_the_threads_its_hook_asks_for(tiny_config, tmp_path):
    """``threads_wanted`` is asked after every step; from the step where its answer
    changes the trainer trains (and reports, ``Trainer.threads``) on that many threads."""
    import torch

    cfg = tiny_config(epochs=1, eval_dev=False, eval_every=0, schedule="round_robin")
    asked, seen = [], []

    def two_from_the_third_step() -> int:
        asked.append(1)
        seen.append(torch.get_num_threads())  # what the previous step trained on
        return 2 if len(asked) >= 3 else 1
    threads = torch.get_num_threads()
    try:
        trainer = Trainer(cfg, load_data(cfg), tmp_path, threads_wanted=two_from_the_third_step)
        assert trainer.threads == 1
        trainer.fit()
    finally:
        torch.set_num_threads(threads)
    assert len(asked) == len(trainer.epoch_plan(1)) > 4  # after every schedule step
    assert seen[:4] == [1, 1, 1, 2] and set(seen[3:]) == {2} and trainer.threads == 2
