"""bench/peers.py: the project's search and its three peers on a tiny model, real Ray and
Optuna: each trains, each selected trial is scored on the same dev rows, and all saw the
same rows and the same space."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench.common import REPO

NUM_TRIALS = 2


@pytest.fixture(scope="module")
def peer_runs(shared_ray, tmp_path_factory, tiny_model_dir, tiny_data_dir):
    """Each method once, seed 0, budget smoke, the smart space, 2 trials, in this process
    on the shared Ray."""
    from bench.peer_problem import driver_argv
    from bench.peers import METHODS, run_method

    root = tmp_path_factory.mktemp("peers")
    runs = {}
    for method in METHODS:
        argv = driver_argv("smart", "smoke", 0, tiny_data_dir, tiny_model_dir,
                           str(root / method / "project"), "peers", num_samples=NUM_TRIALS,
                           max_concurrent=2, gpus_per_trial=0)
        runs[method] = run_method(method, argv, root / method, max_concurrent=2)
    return runs


def test_each_method_trains_and_its_pick_is_scored_on_the_same_dev_rows(peer_runs):
    from bench.peers import figures, markdown_table

    assert set(peer_runs) == {"project", "plain_ray", "hf_ray", "hf_optuna"}
    dev_rows = {r["problem_rows"]["dev"] for r in peer_runs.values()}
    assert len(dev_rows) == 1
    for method, run in peer_runs.items():
        assert run["num_trials"] == NUM_TRIALS, method
        # every trial trained: its last evaluation is past the start
        assert all(t["examples"] > 0 for t in run["trials"]), (method, run["trials"])
        assert run["examples"] == sum(t["examples"] for t in run["trials"])
        assert 0 <= run["trials_at_end"] <= NUM_TRIALS
        assert run["eval_points"] == [48, 96, 144, 192] and run["rungs"] == [48, 144]
        selected = run["selected"]
        assert selected["trial_id"] in {t["trial_id"] for t in run["trials"]}, method
        assert set(selected["config"]) == {"smart_lambda_sst", "smart_lambda_qqp",
                                           "smart_lambda_sts", "smart_eps", "smart_mu", "lr",
                                           "dropout", "batch_size"}, method
        for split in ("val", "dev"):
            assert 1 / 3 < selected[split] < 1, (method, split, selected)  # STS r > -1
            assert 0 < selected[f"{split}_se"] < 0.2
    # the project's pick scored here agrees with what its own summary says of it
    project = peer_runs["project"]["selected"]
    assert project["val"] == pytest.approx(project["summary_val"], abs=1e-6)
    assert project["dev"] == pytest.approx(project["summary_dev"], abs=1e-6)
    # the figures of one seed: a ratio per peer, the dev rule decided
    runs = {m: {0: {**r, "wall_s": 10.0 if m == "project" else 40.0, "cpu_busy": 0.5,
                    "machine_busy": 0.9}} for m, r in peer_runs.items()}
    row = figures(runs)["0"]
    assert row["wall_ratio"] == {"plain_ray": 0.25, "hf_ray": 0.25, "hf_optuna": 0.25}
    assert row["best_peer_dev"] in ("plain_ray", "hf_ray", "hf_optuna")
    assert row["same_rows"] and row["same_space"]
    table = markdown_table(runs).splitlines()
    assert len(table) == 2 + 4 and table[2].startswith("| `project` | 0 | 0 min 10 s |  |")
    assert all("| 0 min 40 s | 0.25 |" in line for line in table[3:])


def test_the_methods_saw_the_same_rows_and_the_same_space(peer_runs, tiny_data_dir,
                                                          tiny_model_dir, tmp_path):
    from bench.peer_problem import canonical_space, driver_argv, load_problem, rows_digest

    rows = {json.dumps(t["rows"], sort_keys=True)
            for r in peer_runs.values() for t in r["trials"]}
    assert len(rows) == 1 and None not in rows
    digest = json.loads(rows.pop())
    assert set(digest) == {"train", "val", "dev"} and len(set(digest.values())) == 3
    spaces = {m: r["space"] for m, r in peer_runs.items()}
    from mtbert.tune.search.spaces import load_space
    expected = canonical_space(load_space("smart").params)
    assert expected["lr"] == {"loguniform": [1e-5, 2e-4]}
    assert expected["batch_size"] == {"choice": [8, 16, 32]}
    for method, space in spaces.items():
        assert space == expected, method
    # the digest tells rows apart: one label changed changes its split's digest alone
    problem = load_problem(driver_argv("smart", "smoke", 0, tiny_data_dir, tiny_model_dir,
                                       str(tmp_path / "storage"), "x"))
    assert rows_digest(problem.data) == digest
    problem.data.split("sts", "val").labels[0] += 0.5
    changed = rows_digest(problem.data)
    assert changed["val"] != digest["val"]
    assert (changed["train"], changed["dev"]) == (digest["train"], digest["dev"])


@pytest.mark.parametrize("argv, message", [
    (["--methods", "project,grid"], "--methods project,grid: unknown ['grid']"),
    (["--seeds", "0,x"], "--seeds 0,x: expected integers"),
    (["--budget", "huge"], "argument --budget: invalid choice: 'huge'"),
])
def test_bad_input_is_one_error_line_and_exit_2(argv, message, tmp_path, tiny_data_dir):
    proc = subprocess.run([sys.executable, "-m", "bench.peers", *argv, "--data-dir",
                           tiny_data_dir, "--out", str(tmp_path / "out"), "--json",
                           str(tmp_path / "peers.json")],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines
    assert not (tmp_path / "peers.json").exists()
