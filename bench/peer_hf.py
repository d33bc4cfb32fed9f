"""The ``transformers.Trainer.hyperparameter_search`` peers of ``bench/peers.py`` (backends
ray and optuna), written as a user of the HF Trainer would write them for the project's
MultitaskModel (docs/bench/peers.md says how, and where they cannot do what it does).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

from bench.peer_problem import OBJECTIVE, ROWS_FILE, Problem, canonical_space, rows_digest, score
from mtbert.data import collate, encoding_for, real_rows
from mtbert.techniques.losses import batch_loss, build_loss_combiner
from mtbert.model.model import MultitaskModel
from mtbert.techniques.smart import build_regulariser
from mtbert.core.tasks import TASK_NAMES

#: the space's keys that are TrainingArguments fields, under the names HF gives them
HF_NAMES = {"lr": "learning_rate", "batch_size": "per_device_train_batch_size"}
PROJECT_NAMES = {v: k for k, v in HF_NAMES.items()}


class MixedTaskRows(torch.utils.data.Dataset):
    """Item ``i``: the index of row ``i`` of each task's ``split`` (mod its size)."""

    def __init__(self, data, split: str = "train"):
        self.sizes = {t: len(data.split(t, split)) for t in TASK_NAMES}

    def __len__(self) -> int:
        return max(self.sizes.values())

    def __getitem__(self, i: int) -> dict[str, int]:
        return {t: i % n for t, n in self.sizes.items()}


class MixedTaskCollator:
    """Items -> ``{task: padded batch}`` with the project's ``collate``."""

    def __init__(self, data, pair_encoding: str):
        self.data = data
        self.encodings = {t: encoding_for(t, pair_encoding) for t in TASK_NAMES}

    def __call__(self, items: list[dict[str, int]]) -> dict[str, dict[str, torch.Tensor]]:
        return {t: collate(self.data.split(t, "train"), np.array([it[t] for it in items]),
                           self.encodings[t], self.data.pad_id) for t in TASK_NAMES}


def sampled(trial) -> dict[str, Any]:
    """A trial's sampled values under the project's names (an Optuna trial or Ray's dict)."""
    params = trial.params if hasattr(trial, "params") else dict(trial or {})
    return {PROJECT_NAMES.get(k, k): v for k, v in params.items()}


class MultitaskTrainer(Trainer):
    """The HF Trainer for the multitask model: the summed loss, the project's val score."""

    def __init__(self, *args, problem: Problem, **kwargs):
        self.problem = problem
        self.examples_seen = 0
        self.loss_combiner = self.regulariser = self.rows = self.trained = None
        super().__init__(*args, **kwargs)

    def start_trial(self, model) -> None:
        """A trial begins: its counters, loss combiner and SMART regulariser."""
        cfg = model.trial_config
        self.examples_seen = 0
        self.loss_combiner = build_loss_combiner(cfg).to(self.args.device)
        self.regulariser = build_regulariser(cfg, model)
        self.rows = rows_digest(self.problem.data)  # what this trial trains and is scored on
        self.trained = None  # set by the trial's first step

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        cfg = model.trial_config
        if self.trained is None:  # the searched values of the model the trial trains
            self.trained = {k: getattr(cfg, k) for k in self.problem.space.searched}
        losses = {t: batch_loss(model, t, batch, cfg, self.regulariser)
                  for t, batch in inputs.items()}
        loss = sum(self.loss_combiner.weighted(losses).values())
        self.examples_seen += sum(real_rows(b) for b in inputs.values())
        return (loss, None) if return_outputs else loss

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix="eval"):
        metrics = score(self.model, self.model.trial_config, self.problem.data, "val")
        metrics["examples_seen"] = self.examples_seen
        folder = Path(self._get_output_dir(self._trial))
        folder.mkdir(parents=True, exist_ok=True)
        (folder / ROWS_FILE).write_text(json.dumps({"rows": self.rows,
                                                    "trained_config": self.trained,
                                                    "examples": self.examples_seen}),
                                        encoding="utf-8")
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control,
                                                         metrics)
        return metrics


class TrialHooks(TrainerCallback):
    """A trial's start (counters, regulariser), SMART's teacher after each
    step, an evaluation with a checkpoint at each of the budget's points, the end of
    training at the last (``num_train_epochs`` rounds up to whole steps per pass)."""

    def __init__(self, trainer: MultitaskTrainer, points: list[int]):
        self.trainer = trainer
        self.points = points  # the last: the budget's end, where training stops

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.trainer.start_trial(model)
        self.next = 0

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if self.trainer.regulariser is not None:
            self.trainer.regulariser.after_step(model)
        seen = self.trainer.examples_seen
        if self.next < len(self.points) and seen >= self.points[self.next]:
            while self.next < len(self.points) and seen >= self.points[self.next]:
                self.next += 1
            control.should_evaluate = control.should_save = True
        if seen >= self.points[-1]:
            control.should_training_stop = True
        return control


def build_trainer(problem: Problem, out: Path, threads: int = 0) -> MultitaskTrainer:
    """The HF Trainer a user would set up for the search (``threads``: torch's, 0 = its
    default)."""
    if threads:
        torch.set_num_threads(threads)
    budget, base_cfg = problem.budget, problem.config({})
    per_pass = len(TASK_NAMES) * max(problem.data.train_sizes().values())
    epochs = math.ceil(budget.max_examples / per_pass * 100) / 100  # the callback stops it

    hp_space = optuna_space(problem)

    def model_init(trial=None):
        # HF's Trainer.train calls model_init(trial) before its own hp_space(trial): a
        # live Optuna trial has no params yet, so ask it for them (Optuna gives a name
        # already suggested, or enqueued, the same value again).
        cfg = problem.config(sampled(hp_space(trial) if hasattr(trial, "suggest_float")
                                     else trial))
        model = MultitaskModel.from_config(cfg)
        model.trial_config = cfg
        return model

    args = TrainingArguments(
        output_dir=str(out), seed=problem.seed, report_to="none", disable_tqdm=True,
        use_cpu=base_cfg.device == "cpu", num_train_epochs=epochs,
        learning_rate=base_cfg.lr, per_device_train_batch_size=base_cfg.batch_size,
        weight_decay=base_cfg.weight_decay, max_grad_norm=base_cfg.max_grad_norm,
        warmup_steps=budget.warmup_examples / budget.max_examples,
        do_eval=True, eval_strategy="steps", eval_steps=10**9, eval_on_start=True,
        save_strategy="steps", save_steps=10**9, save_total_limit=1, save_only_model=True,
        remove_unused_columns=False, dataloader_num_workers=0, logging_strategy="no")
    trainer = MultitaskTrainer(model_init=model_init, args=args,
                               train_dataset=MixedTaskRows(problem.data),
                               eval_dataset=MixedTaskRows(problem.data, "val"),
                               data_collator=MixedTaskCollator(problem.data,
                                                               base_cfg.pair_encoding),
                               problem=problem)
    trainer.add_callback(TrialHooks(trainer, problem.eval_points()))
    return trainer


def optuna_space(problem: Problem):
    """The space as an ``hp_space`` for the optuna backend (HF names)."""
    distributions = problem.space.optuna_distributions()

    def hp_space(trial):
        out = {}
        for key, dist in distributions.items():
            name = HF_NAMES.get(key, key)
            if type(dist).__name__ == "CategoricalDistribution":
                out[name] = trial.suggest_categorical(name, list(dist.choices))
            elif type(dist).__name__ == "IntDistribution":
                out[name] = trial.suggest_int(name, dist.low, dist.high, log=dist.log)
            else:
                out[name] = trial.suggest_float(name, dist.low, dist.high, log=dist.log,
                                                step=dist.step)
        return out
    return hp_space


def ray_space(problem: Problem):
    """The space as an ``hp_space`` for the ray backend (Ray Tune domains, HF names)."""
    domains = {HF_NAMES.get(k, k): p.to_tune() for k, p in problem.space.searched.items()}
    return lambda trial: dict(domains)


def hf_named(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Configurations under the names HF gives the TrainingArguments fields."""
    return [{HF_NAMES.get(k, k): v for k, v in p.items()} for p in points]


def run_hf_optuna(problem: Problem, out: Path, threads: int = 0,
                  points: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """``hyperparameter_search(backend="optuna")`` with a successive-halving pruner."""
    import optuna

    trainer = build_trainer(problem, out, threads)
    storage = f"sqlite:///{(out / 'optuna.db').resolve()}"
    if points:  # the study hyperparameter_search creates, with the points enqueued
        study = optuna.create_study(storage=storage, study_name="hf_optuna",
                                    direction="maximize")
        for point in hf_named(points):
            study.enqueue_trial(point)
    best = trainer.hyperparameter_search(
        hp_space=optuna_space(problem), compute_objective=lambda m: m[OBJECTIVE],
        n_trials=problem.num_samples, direction="maximize", backend="optuna",
        sampler=optuna.samplers.TPESampler(seed=problem.seed),
        pruner=optuna.pruners.SuccessiveHalvingPruner(reduction_factor=round(
            problem.budget.reduction_factor)),
        storage=storage, study_name="hf_optuna", load_if_exists=bool(points))
    study = optuna.load_study(study_name="hf_optuna", storage=storage)
    trials = [{"trial_id": str(t.number), "state": t.state.name, "config": sampled(t),
               **trial_progress(out / f"run-{t.number}")} for t in study.trials]
    checkpoints = sorted((out / f"run-{best.run_id}").glob("checkpoint-*"),
                         key=lambda p: int(p.name.split("-")[1]))
    return {"trials": trials,
            "space": canonical_space({PROJECT_NAMES.get(k, k): v for k, v in (
                study.trials[0].distributions if study.trials else {}).items()}),
            "selected": {"trial_id": best.run_id, "config": sampled(best.hyperparameters),
                         "checkpoint": str(checkpoints[-1]) if checkpoints else None,
                         "loader": "hf"}}


def run_hf_ray(problem: Problem, out: Path, cpus_per_trial: float = 1.0,
               gpus_per_trial: float = 0.0, max_concurrent: int = 2,
               points: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """``hyperparameter_search(backend="ray")`` with ASHA and Optuna's TPE."""
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler
    from ray.tune.search.optuna import OptunaSearch

    budget = problem.budget
    trainer = build_trainer(problem, out / "hf")
    hp_space = ray_space(problem)
    best = trainer.hyperparameter_search(
        hp_space=hp_space, compute_objective=lambda m: m[OBJECTIVE],
        n_trials=problem.num_samples, direction="maximize", backend="ray",
        resources_per_trial={"cpu": cpus_per_trial, "gpu": gpus_per_trial},
        max_concurrent_trials=max_concurrent,
        search_alg=OptunaSearch(metric="objective", mode="max", seed=problem.seed,
                                points_to_evaluate=hf_named(points) if points else None),
        scheduler=ASHAScheduler(metric="objective", mode="max", time_attr="examples_seen",
                                max_t=budget.max_examples, grace_period=budget.grace_period,
                                reduction_factor=budget.reduction_factor),
        storage_path=str(out.resolve()), name="hf_ray", verbose=0,
        checkpoint_config=tune.CheckpointConfig(num_to_keep=1,
                                                checkpoint_score_attribute="objective",
                                                checkpoint_score_order="max"))
    analysis = best.run_summary
    trials, selected_checkpoint = [], None
    for trial in analysis.trials:
        trials.append({"trial_id": trial.trial_id, "state": trial.status,
                       "config": {k: v for k, v in sampled(trial.config).items()
                                  if k in problem.space.searched},
                       **trial_progress(out / "hf" / f"run-{trial.trial_id}")})
        if trial.trial_id == best.run_id:
            checkpoint = analysis.get_best_checkpoint(trial, metric="objective", mode="max")
            if checkpoint is not None:
                inner = sorted(Path(checkpoint.path).glob("checkpoint-*"))
                selected_checkpoint = str(inner[-1] if inner else checkpoint.path)
    return {"trials": trials,
            "space": canonical_space({PROJECT_NAMES.get(k, k): v
                                      for k, v in hp_space(None).items()}),
            "selected": {"trial_id": best.run_id, "config": sampled(best.hyperparameters),
                         "checkpoint": selected_checkpoint, "loader": "hf"}}


def trial_progress(folder: Path) -> dict[str, Any]:
    """A trial's rows digest, the searched values its model trained with and the examples
    it had trained at its last evaluation."""
    path = folder / ROWS_FILE
    if not path.is_file():
        return {"rows": None, "examples": 0}
    return json.loads(path.read_text(encoding="utf-8"))


def load_hf_checkpoint(problem: Problem, config: dict[str, Any], folder: str):
    """The model an HF checkpoint folder holds, for the trial config ``config``."""
    from safetensors.torch import load_file

    cfg = problem.config(config)
    model = MultitaskModel.from_config(cfg)
    path = Path(folder)
    weights = (load_file(str(path / "model.safetensors")) if (path / "model.safetensors").is_file()
               else torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True))
    model.load_state_dict(weights)
    return cfg, model.eval()
