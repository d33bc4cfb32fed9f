"""What the methods of ``bench/peers.py`` share: the search problem, read through the
project's own command line and loader (:func:`load_problem`), the checks that every
method saw it alike, and a model scored with the project's evaluation code.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from mtbert.core.tasks import TASK_NAMES

#: what every method selects on (and maximises)
OBJECTIVE = "val/overall"
#: the splits a method's rows are checked on: trained on, selected on, scored on
DIGESTED = ("train", "val", "dev")
#: written into each trial's folder by a peer: the rows it trained and was scored on
ROWS_FILE = "peer_rows.json"


@dataclass
class Problem:
    """One search problem: the driver's settings (budget resolved) and the loaded data."""
    settings: Any   # mtbert.tune.settings.SearchSettings
    data: Any       # mtbert.data.MultitaskData

    @property
    def base(self) -> dict[str, Any]:
        """The TrainConfig fields every trial gets (the space's fixed values included)."""
        return {**self.settings.base, **self.settings.space.fixed}

    def __getattr__(self, name: str):
        """``space``, ``budget``, ``num_samples`` and ``seed``: the settings'."""
        if name in ("space", "budget", "num_samples", "seed"):
            return getattr(self.settings, name)
        raise AttributeError(name)

    def config(self, sampled: dict[str, Any]):
        """A trial's TrainConfig, as the project's trainable builds it."""
        from mtbert.tune.trial.trial_config import trial_config
        return trial_config(self.base, sampled)

    def eval_points(self) -> list[int]:
        """The examples at which a trial is scored on val: the trainer's points
        (``eval_every · eval_growth^k``) below the budget, then the budget's end."""
        from mtbert.loop.trainer import next_eval_point  # deferred: torch
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
    from mtbert.core.devices import resolve_device, uses_bf16
    from mtbert.run.inference import as_label, predict_split
    from mtbert.run.metrics import scalar_metrics, split_metrics, task_metrics

    device = resolve_device(cfg.device)
    model = model.to(device)
    per_task = {}
    for task in TASK_NAMES:
        split = data.split(task, split_name)
        scores = predict_split(model, split, encoding_for(task, cfg.pair_encoding), data.pad_id,
                               eval_rows(cfg.eval_batch_size, device.type), device,
                               uses_bf16(cfg.precision, device), sst_probabilities=True,
                               max_tokens=eval_token_cap(cfg.eval_batch_tokens, device.type))
        pred = scores.argmax(-1) if task == "sst" else scores
        per_task[task] = task_metrics(task, as_label(task, pred), split.labels,
                                      probabilities=None if task == "sts" else scores)
    return scalar_metrics(split_metrics(split_name, per_task), finite=True)
