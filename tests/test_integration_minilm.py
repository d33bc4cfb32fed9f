"""One real run: the packaged MiniLM on 100 training rows per task of ../shared/data (two
epochs; 200 validation, dev and test rows per task scored)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def test_minilm_trains_on_a_slice_of_the_real_data(shared_data_dir, tmp_path):
    out = tmp_path / "run"
    sets = ["max_train_per_task=100", "max_eval_per_task=200", "epochs=2", "batch_size=16",
            "lr=5e-5", "schedule=round_robin", "update=summed", "threads=2",
            "pair_encoding=siamese", "sts_head=cosine"]
    args = [sys.executable, "-m", "mtbert.train", "--data-dir", shared_data_dir, "--out", str(out)]
    for s in sets:
        args += ["--set", s]
    result = subprocess.run(args, capture_output=True, text=True, timeout=900, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "token cache" in result.stderr
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["examples_seen"] == 2 * 3 * 100
    # the cosine of MiniLM's mean-pooled embeddings scores STS dev r ~ 0.84 zero-shot; a
    # wrongly loaded (random) encoder scores ~ 0
    assert metrics["val/sts_corr"] > 0.7 and metrics["dev/sts_corr"] > 0.7
    assert 0.0 <= metrics["dev/sst_acc"] <= 1.0 and metrics["dev/qqp_acc"] > 0.5
    history = [json.loads(line) for line in (out / "history.jsonl").read_text().splitlines()]
    assert [h["examples_seen"] for h in history] == [0, 300, 600]  # eval_at_start
    assert history[-1]["train/loss_sts"] < history[1]["train/loss_sts"]
    # the siamese / cosine run starts at MiniLM's zero-shot cosine (STS r ~ 0.84
    # on this slice) and its QQP head at the fitted cosine threshold, not at chance
    assert history[0]["optimizer_steps"] == 0 and history[0]["val/sts_corr"] > 0.75
    assert history[0]["val/qqp_acc"] > 0.65
    for name in ("sst-test-output.csv", "sts-test-output.csv", "qqp-dev-output.csv"):
        assert (out / "predictions" / name).is_file()
    sst_test = (out / "predictions" / "sst-test-output.csv").read_text().splitlines()
    assert len(sst_test) == 1 + 200
