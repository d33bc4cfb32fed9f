"""What the methods of ``bench/peers.py`` share: the search problem, read through the
project's own command line and loader, and the checks that every method saw it alike.

* :func:`load_problem`: the driver's settings for ``tune_driver.py``'s arguments
  (:func:`driver_argv`) and the data its trials train on, read and tokenised once
  (``mtbert.tune.driver.load_search_data``): the space, the budget (examples per trial,
  evaluation points, ASHA's rungs), the number of trials, the base TrainConfig;
* :func:`rows_digest`: a SHA-256 of each split's row ids and labels (train, val, dev):
  what a method trained on, selected on and was scored on;
* :func:`canonical_space`: a space as the project's YAML writes it, from the project's
  parameters, Ray Tune domains or Optuna distributions -- what each method searched,
  read back from the form it was given;
* :func:`same_draws`: the configurations of ``--same-draws``, drawn once per seed by a
  seeded Optuna ``RandomSampler`` over the space, that every method tries in that order;
  :func:`config_key`: a configuration as one comparable string (the check that every
  method tried the draws);
* :func:`score`: a model's metrics on a split with the project's evaluation code (the
  trainer's: ``predict_split``, ``task_metrics``, ``split_metrics``);
* :class:`TreeCPU`: the CPU seconds of a process and all its descendants (Ray's workers).
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from dataclasses import dataclass
from typing import Any

from mtbert.core.tasks import TASK_NAMES

#: what every method selects on (and maximises)
OBJECTIVE = "val/overall"
#: the splits a method's rows are checked on: trained on, selected on, scored on
DIGESTED = ("train", "val", "dev")


def driver_argv(space: str, budget: str, seed: int, data_dir: str, model: str,
                storage: str, experiment: str, num_samples: int | None = None,
                cpus_per_trial: float = 1.0, gpus_per_trial: float | None = None,
                max_concurrent: int | None = None) -> list[str]:
    """``tune_driver.py``'s arguments for the project's search: its defaults (scheduler,
    searcher, rung metric, ensemble) with these values."""
    argv = ["--space", space, "--budget", budget, "--seed", str(seed), "--data-dir", data_dir,
            "--model", model, "--storage-path", storage, "--experiment", experiment,
            "--cpus-per-trial", f"{cpus_per_trial:g}"]
    if num_samples is not None:
        argv += ["--num-samples", str(num_samples)]
    if gpus_per_trial is not None:
        argv += ["--gpus-per-trial", f"{gpus_per_trial:g}"]
    if max_concurrent is not None:
        argv += ["--max-concurrent", str(max_concurrent)]
    return argv


@dataclass
class Problem:
    """One search problem: the driver's settings (budget resolved) and the loaded data."""
    settings: Any   # mtbert.tune.settings.SearchSettings
    data: Any       # mtbert.data.MultitaskData

    @property
    def base(self) -> dict[str, Any]:
        """The TrainConfig fields every trial gets (the space's fixed values included)."""
        return {**self.settings.base, **self.settings.space.fixed}

    @property
    def space(self):
        return self.settings.space

    @property
    def budget(self):
        return self.settings.budget

    @property
    def num_samples(self) -> int:
        return self.settings.num_samples

    @property
    def seed(self) -> int:
        return self.settings.seed

    def config(self, sampled: dict[str, Any]):
        """A trial's TrainConfig, as the project's trainable builds it."""
        from mtbert.tune.trial.trial_config import trial_config
        return trial_config(self.base, sampled)

    def eval_points(self) -> list[int]:
        """The examples at which a trial is scored on val: the trainer's points
        (``eval_every · eval_growth^k``) below the budget, then the budget's end."""
        from mtbert.step.trainer import next_eval_point  # deferred: torch
        b, points = self.budget, []
        point = next_eval_point(0, b.eval_every, b.eval_growth)
        while point < b.max_examples:
            points.append(point)
            point = next_eval_point(point, b.eval_every, b.eval_growth)
        return points + [b.max_examples]


def load_problem(argv: list[str]) -> Problem:
    """The settings ``tune_driver.py argv`` resolves to and the data its trials get;
    ConfigError / DataError for bad input (nothing is written)."""
    from mtbert.tune.cli import build_parser
    from mtbert.tune.driver import load_search_data  # deferred: ray, mlflow, torch
    from mtbert.tune.settings import resolve_settings

    args = build_parser().parse_args(argv)
    args.given = frozenset()
    settings = resolve_settings(args)
    data = load_search_data(settings)
    return Problem(settings.resolved_for(sum(data.train_sizes().values())), data)


def rows_digest(data) -> dict[str, str]:
    """{split: SHA-256 of every task's row ids and labels} for the train, val and dev
    splits of ``data`` (a MultitaskData)."""
    out = {}
    for name in DIGESTED:
        h = hashlib.sha256()
        for task in TASK_NAMES:
            split = data.split(task, name)
            h.update(f"{task}/{name}/{len(split)}\n".encode())
            h.update("\n".join(split.ids).encode())
            if split.labels is not None:
                h.update(split.labels.astype("float64").tobytes())
        out[name] = h.hexdigest()
    return out


def canonical_space(params: dict[str, Any]) -> dict[str, Any]:
    """Each searched key as the project's space file writes it (``{"choice": [...]}``,
    ``{"loguniform": [low, high]}``, ...), from a project ``Param``, a Ray Tune domain, an
    Optuna distribution or the YAML form itself; fixed values are left out."""
    out = {}
    for key, spec in params.items():
        form = _canonical(spec)
        if form is not None:
            out[key] = form
    return dict(sorted(out.items()))


def _canonical(spec: Any) -> dict[str, list] | None:
    kind = type(spec).__name__
    if kind == "Param":  # mtbert.tune.search.spaces.Param
        if not spec.searched:
            return None
        if spec.dist == "choice":
            return {"choice": list(spec.choices)}
        bounds = [spec.low, spec.high] + ([spec.step] if spec.step else [])
        return {spec.dist: bounds}
    if isinstance(spec, dict):  # the YAML form: {dist: args}; anything else is fixed
        return dict(spec) if len(spec) == 1 and isinstance(next(iter(spec.values())), list) \
            else None
    if kind == "Categorical" and hasattr(spec, "categories"):  # Ray Tune
        return {"choice": list(spec.categories)}
    if kind in ("Float", "Integer") and hasattr(spec, "lower"):  # Ray Tune
        sampler = type(spec.get_sampler()).__name__
        dist = ("loguniform" if "LogUniform" in sampler else
                "randint" if kind == "Integer" else "uniform")
        high = spec.upper - 1 if kind == "Integer" else spec.upper  # Ray's is exclusive
        return {dist: [spec.lower, high]}
    if kind == "CategoricalDistribution":  # Optuna
        return {"choice": list(spec.choices)}
    if kind in ("FloatDistribution", "IntDistribution"):  # Optuna
        dist = ("randint" if kind == "IntDistribution" else
                "loguniform" if spec.log else "quniform" if spec.step else "uniform")
        return {dist: [spec.low, spec.high] + ([spec.step] if dist == "quniform" else [])}
    return None  # a constant


def same_draws(space, n: int, seed: int) -> list[dict[str, Any]]:
    """``n`` configurations of ``space`` (a SearchSpace) drawn by Optuna's RandomSampler
    seeded with ``seed``: the same list for a space, ``n`` and seed on any machine."""
    import optuna

    distributions = space.optuna_distributions()
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=seed))
    return [study.ask(distributions).params for _ in range(n)]


def config_key(config: dict[str, Any]) -> str:
    """A configuration as a string that equal draws share whatever form a tool gave them
    back in (floats to 9 significant digits, ints as floats, keys sorted)."""
    return json.dumps({k: (float(f"{v:.9g}") if isinstance(v, (int, float))
                           and not isinstance(v, bool) else v)
                       for k, v in sorted(config.items())})


def score(model, cfg, data, split_name: str) -> dict[str, float]:
    """``model``'s metrics on ``split_name`` (val or dev) as the trainer scores val:
    ``{split/overall, split/overall_se, split/sst_acc, ...}``."""
    from mtbert.data import encoding_for, eval_rows, eval_token_cap  # deferred: torch
    from mtbert.core.devices import resolve_device
    from mtbert.run.inference import as_label, predict_split
    from mtbert.run.metrics import scalar_metrics, split_metrics, task_metrics

    device = resolve_device(cfg.device)
    model = model.to(device)
    per_task = {}
    for task in TASK_NAMES:
        split = data.split(task, split_name)
        scores = predict_split(model, split, encoding_for(task, cfg.pair_encoding), data.pad_id,
                               eval_rows(cfg.eval_batch_size, device.type), device,
                               device.type == "cuda", sst_probabilities=True,
                               max_tokens=eval_token_cap(cfg.eval_batch_tokens, device.type))
        pred = scores.argmax(-1) if task == "sst" else scores
        per_task[task] = task_metrics(task, as_label(task, pred), split.labels,
                                      probabilities=None if task == "sts" else scores)
    return scalar_metrics(split_metrics(split_name, per_task), finite=True)


class TreeCPU:
    """CPU seconds (user + system) of process ``pid`` and every descendant it ever had,
    sampled every ``interval`` s on a thread (a process's last figure is kept once it
    ends); the machine's CPU busy over the same time (everyone's work, for context)."""

    def __init__(self, pid: int, interval: float = 0.5):
        import psutil  # deferred: the bench's extra

        self._psutil = psutil
        self.root = psutil.Process(pid)
        self.interval = interval
        self.seen: dict[tuple[int, float], float] = {}  # (pid, create time) -> CPU s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._machine_start = psutil.cpu_times()
        self.started = time.monotonic()
        self.wall_s = 0.0
        self.machine_busy = 0.0
        self._thread.start()

    def _sample(self) -> None:
        psutil = self._psutil
        try:
            procs = [self.root] + self.root.children(recursive=True)
        except psutil.Error:
            return
        for proc in procs:
            try:
                times = proc.cpu_times()
                self.seen[(proc.pid, proc.create_time())] = times.user + times.system
            except psutil.Error:
                continue

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def stop(self) -> float:
        """Stop sampling (after one last sample); the CPU seconds of the tree."""
        self._sample()
        self._stop.set()
        self._thread.join()
        self.wall_s = time.monotonic() - self.started
        end, start = self._psutil.cpu_times(), self._machine_start
        busy = lambda t: t.user + t.system + getattr(t, "nice", 0.0)  # noqa: E731
        total = lambda t: busy(t) + t.idle + getattr(t, "iowait", 0.0)  # noqa: E731
        self.machine_busy = (busy(end) - busy(start)) / max(total(end) - total(start), 1e-9)
        return self.cpu_s

    @property
    def cpu_s(self) -> float:
        return sum(self.seen.values())
