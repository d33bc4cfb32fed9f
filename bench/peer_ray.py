"""The plain Ray Tune peer of ``bench/peers.py``: what the Ray Tune docs teach, around the
project's Trainer (a function trainable, ``ASHAScheduler``, ``OptunaSearch``, one trial a
worker; docs/bench/peers.md says how it is written and what it picks).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench.peer_problem import OBJECTIVE, ROWS_FILE, Problem, canonical_space, rows_digest


def train_fn(config: dict[str, Any], data=None, base: dict[str, Any] | None = None) -> None:
    """The function trainable: one Trainer run, each evaluation reported to Tune."""
    from ray import tune

    from mtbert.run.metrics import scalar_metrics
    from mtbert.loop.trainer import Trainer
    from mtbert.tune.trial.trial_config import trial_config

    trial_dir = Path(tune.get_context().get_trial_dir())
    trial_dir.mkdir(parents=True, exist_ok=True)
    (trial_dir / ROWS_FILE).write_text(json.dumps(rows_digest(data)), encoding="utf-8")
    cfg = trial_config(base, config)

    def report(metrics: dict, checkpoint_dir: str | None) -> None:
        tune.report(scalar_metrics(metrics, finite=True),
                    checkpoint=(tune.Checkpoint.from_directory(checkpoint_dir)
                                if checkpoint_dir else None))

    Trainer(cfg, data, trial_dir / "work", report=report).fit()


def run_plain_ray(problem: Problem, out: Path, cpus_per_trial: float = 1.0,
                  gpus_per_trial: float = 0.0, max_concurrent: int = 2,
                  points: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Run the search; returns what :mod:`bench.peers` records of it (``selected``: the
    trial, its config and the folder of its kept checkpoint)."""
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler
    from ray.tune.search.optuna import OptunaSearch

    budget = problem.budget
    param_space = problem.space.param_space()
    trainable = tune.with_resources(
        tune.with_parameters(train_fn, data=problem.data, base=problem.base),
        {"cpu": cpus_per_trial, "gpu": gpus_per_trial})
    tuner = tune.Tuner(
        trainable, param_space=param_space,
        tune_config=tune.TuneConfig(
            metric=OBJECTIVE, mode="max", num_samples=problem.num_samples,
            max_concurrent_trials=max_concurrent, reuse_actors=False,
            search_alg=OptunaSearch(seed=problem.seed, points_to_evaluate=points),
            scheduler=ASHAScheduler(time_attr="examples_seen", max_t=budget.max_examples,
                                    grace_period=budget.grace_period,
                                    reduction_factor=budget.reduction_factor)),
        run_config=tune.RunConfig(
            name="plain_ray", storage_path=str(out.resolve()), verbose=0,
            checkpoint_config=tune.CheckpointConfig(
                num_to_keep=1, checkpoint_score_attribute=OBJECTIVE,
                checkpoint_score_order="max")))
    results = tuner.fit()
    trials = []
    for result in results:
        frame = result.metrics_dataframe
        examples = (int(frame["examples_seen"].max())
                    if frame is not None and "examples_seen" in frame else 0)
        rows_file = Path(result.path) / ROWS_FILE
        trials.append({"trial_id": result.metrics.get("trial_id"), "examples": examples,
                       "config": {k: result.config[k] for k in problem.space.searched},
                       "error": None if result.error is None else str(result.error)[:300],
                       "rows": (json.loads(rows_file.read_text(encoding="utf-8"))
                                if rows_file.is_file() else None)})
    best = results.get_best_result(metric=OBJECTIVE, mode="max", scope="all")
    checkpoint = best.get_best_checkpoint(OBJECTIVE, "max")
    return {"trials": trials, "space": canonical_space(param_space),
            "selected": {"trial_id": best.metrics.get("trial_id"),
                         "config": {k: best.config[k] for k in problem.space.searched},
                         "checkpoint": checkpoint.path if checkpoint else None,
                         "loader": "checkpoint"}}
