"""The search's settings: every CLI value checked, resolved and frozen before anything starts.

:func:`resolve_settings` turns the parsed arguments into one :class:`SearchSettings`
(the space file loaded and validated, the budget, the experiment's location, the MLflow
store, the base trial config) or raises one :class:`~mtbert.core.errors.ConfigError` naming
the flag; it writes nothing.  What ``--resume`` and ``--extend`` take from an earlier run
of the driver is read by :mod:`mtbert.tune.saved_settings`.  (The merge of the base config and a trial's sampled values is
:func:`mtbert.tune.trial.trial_config.trial_config`.)
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shlex
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mtbert.core.atomic import check_creatable
from mtbert.core.config import TrainConfig, default_cache_dir
from mtbert.core.errors import ConfigError
from mtbert.core.pretrained import check_model
from mtbert.tune.infra import location as loc
from mtbert.tune.infra import mps
from mtbert.tune.search.budgets import Budget, get_budget
from mtbert.tune.infra.cluster import ResourcePlan, check_ray_address
from mtbert.tune.results.extension import (EarlierSearch, check_known_trials, earlier_search,
                                           measured_on)
from mtbert.tune.search.choices import (check_optional_packages, check_per_rung,
                                        default_rung_metric, resolve_scheduler, resolve_search_alg,
                                        scheduler_choice, searcher_choice)
from mtbert.tune.trial.objective import rung_metric_keys
from mtbert.tune.saved_settings import earlier_settings, merge_saved_settings
from mtbert.tune.search.spaces import SearchSpace, load_space, parse_space, read_points
from mtbert.tune.infra.outbox import flush_seconds
from mtbert.tune.infra.tracking import TrackingError, check_tracking_uri, default_tracking_uri

#: --fuse: the trials trained by trainer actors (mtbert.tune.trial.group_trainer), those of
#: one structure fused; auto: off until a GPU measures the fused path (docs/search.md)
FUSE_CHOICES = ("auto", "on", "off")

_EXPERIMENT_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,120}$")


@dataclass(frozen=True)
class SearchSettings:
    """Everything a search needs, validated; ``budget`` is resolved once the data is loaded
    (:meth:`resolved_for`)."""
    space: SearchSpace
    space_arg: str
    budget: Budget
    num_samples: int
    top_k: int
    location: loc.ExperimentLocation
    storage_arg: str                 # --storage-path as given (for the --resume hint)
    mlflow_uri: str
    mlflow_fallback: str | None      # the unreachable --mlflow-uri replaced by local SQLite
    base: dict[str, Any]             # TrainConfig fields every trial gets
    resume: bool
    search_alg: str
    scheduler: str
    rung_metric: str                 # --rung-metric: objective.rung_metric_keys
    seed: int
    cpus_per_trial: float
    gpus_per_trial: float | None    # None: chosen from the cluster (with_resources)
    max_concurrent: int | None
    ensemble: str
    keep_checkpoints: str            # best | all | none (retention.py)
    max_failures: int
    address: str | None
    mlflow_fallback_local: bool
    mps: str = "auto"                # --mps: auto | on | off (mps.py)
    trial_threads: str = "grow"      # --trial-threads: grow | fixed (trial/thread_share.py)
    fuse: str = "auto"               # --fuse: auto | on | off (FUSE_CHOICES)
    fused: bool = False              # the trials train fused (fuses(), set once Ray is up)
    resources: ResourcePlan | None = None   # set once Ray is up
    extend: str | None = None        # --extend: the earlier search's experiment name
    extend_trials: dict[str, Any] | None = None   # its parsed trials.json
    extends: EarlierSearch | None = None  # its trials, classified (resolved_for)
    points: tuple[dict[str, Any], ...] = ()  # --points: proposed first, in order

    @property
    def experiment(self) -> str:
        return self.location.experiment

    def resolved_for(self, total_train_rows: int) -> "SearchSettings":
        """The settings with the budget's ``max_examples`` fixed by the loaded data."""
        budget = self.budget.resolved(total_train_rows)
        base = {**self.base, **run_fields(budget, self.scheduler)}
        extends = None
        if self.extend_trials is not None:  # ranked together only where measured alike
            extends = earlier_search(self.extend_trials, measured_on(budget, base),
                                     list(self.space.searched))
        return dataclasses.replace(self, budget=budget, base=base, extends=extends)

    def measured_on(self) -> dict[str, Any]:
        """What this search's trial scores are measured on (extension.measured_on)."""
        return measured_on(self.budget, self.base)

    def with_resources(self, plan: ResourcePlan) -> "SearchSettings":
        """The settings with each trial's resources fixed for the connected cluster."""
        return dataclasses.replace(
            self, resources=plan, cpus_per_trial=plan.cpus_per_trial,
            gpus_per_trial=plan.gpus_per_trial,
            base={**self.base, "device": "auto" if plan.gpus_per_trial > 0 else "cpu"})

    def fuses(self, have_gpu: bool) -> bool:
        """Whether the trials train in trainer actors (``--fuse``).  ``auto`` is off
        everywhere for now, ``have_gpu`` included: the fused step is eager, while a GPU
        trial's default step is captured graphs, and no GPU has measured the two."""
        del have_gpu  # what auto decides by, once a GPU bench has measured the two
        return self.fuse == "on"

    def send_mlflow_command(self) -> str:
        """The command that sends the MLflow writes this search left unsent."""
        return (f"python tune_driver.py --send-mlflow --experiment {self.experiment} "
                f"--storage-path {shlex.quote(self.storage_arg)}")

    def saved(self) -> dict[str, Any]:
        """What ``mtbert_search.json`` holds: the effective CLI values and the space, so that
        ``--resume`` (from any machine that reaches the storage) repeats this search."""
        args = {"space": self.space_arg, "list_spaces": False,
                "data_dir": self.base["data_dir"], "model": self.base["model"],
                "budget": self.budget.name, "num_samples": self.num_samples,
                "max_concurrent": self.max_concurrent, "cpus_per_trial": self.cpus_per_trial,
                "gpus_per_trial": self.gpus_per_trial, "search_alg": self.search_alg,
                "scheduler": self.scheduler, "rung_metric": self.rung_metric,
                "seed": self.seed, "storage_path": self.location.ray_storage,
                "experiment": self.experiment,
                "mlflow_uri": self.mlflow_uri, "mlflow_fallback_local": self.mlflow_fallback_local,
                "ensemble_top_k": self.top_k, "ensemble": self.ensemble,
                "keep_checkpoints": self.keep_checkpoints,
                "max_failures": self.max_failures, "address": self.address,
                "mps": self.mps, "trial_threads": self.trial_threads,
                "fuse": self.fuse, "resume": self.resume, "extend": self.extend}
        return {"args": args, "space": self.space.to_dict(), "space_path": self.space.path,
                "budget": self.budget.to_dict(), "base": self.base,
                "num_samples": self.num_samples, "experiment": self.experiment,
                "mlflow_uri": self.mlflow_uri, "points": list(self.points)}


def resume_command(settings: SearchSettings) -> str:
    """The command that continues this search (printed after Ctrl-C)."""
    return (f"python tune_driver.py --resume --experiment {settings.experiment} "
            f"--storage-path {settings.storage_arg}")


def run_fields(budget: Budget, scheduler: str) -> dict[str, Any]:
    """The budget's run-length fields of every trial; PBT / PB2 perturb every
    ``eval_every`` examples, so their trials evaluate there (``eval_growth`` 1)."""
    growth = {"eval_growth": 1} if scheduler_choice(scheduler).population else {}
    return {**budget.trial_fields(), **growth}


# ---------------------------------------------------------------------- resolving
def resolve_settings(args: argparse.Namespace) -> SearchSettings:
    """Check every CLI value and the space; raises ConfigError; writes nothing."""
    args = argparse.Namespace(**vars(args))  # the caller's namespace stays as parsed
    if args.resume and getattr(args, "extend", None):
        raise ConfigError("--extend starts a new search and --resume continues one: give "
                          "one of them (a search started with --extend resumes with "
                          "--resume --experiment NAME)")
    storage, storage_uri = _storage(args.storage_path)
    saved = merge_saved_settings(args, storage, storage_uri) if args.resume else None
    extended = (earlier_settings(args, storage, storage_uri) if getattr(args, "extend", None)
                else None)
    if storage_uri and not args.mlflow_uri:
        raise ConfigError(f"--storage-path {args.storage_path}: a URI storage needs "
                          "--mlflow-uri (an MLflow server http://HOST:5000, or "
                          "sqlite:///PATH.db): the default SQLite store lives in a local "
                          "storage folder")
    if args.space is None:
        raise ConfigError("--space is required (see --list-spaces)")
    space = (parse_space(saved["space"], saved["space_path"]) if saved
             else extended.space if extended else load_space(args.space))
    budget = get_budget(args.budget)
    args.scheduler = resolve_scheduler(args.scheduler, args.search_alg)
    search_alg = resolve_search_alg(args.scheduler, args.search_alg)
    check_optional_packages(args.scheduler, search_alg)
    rung_metric = getattr(args, "rung_metric", None) or default_rung_metric(args.scheduler)
    check_per_rung(rung_metric_keys(rung_metric), args.scheduler, rung_metric)
    scheduler_choice(args.scheduler).check_space(space)  # e.g. PBT: something to perturb
    num_samples = args.num_samples if args.num_samples is not None else budget.num_samples
    _check_numbers(args, num_samples)
    top_k = args.ensemble_top_k if args.ensemble_top_k is not None else budget.ensemble_top_k
    if top_k < 1:
        raise ConfigError(f"--ensemble-top-k {top_k}: must be >= 1")
    # an extension's candidates are the earlier trials too
    pool = num_samples + (len(extended.trials["trials"]) if extended else 0)
    if args.ensemble_top_k is not None and top_k > pool:
        raise ConfigError(f"--ensemble-top-k {top_k}: more than --num-samples {num_samples}"
                          + (" and the earlier search's trials" if extended else ""))
    experiment = args.experiment or f"{space.name}-{budget.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    if not _EXPERIMENT_RE.match(experiment):
        raise ConfigError(f"--experiment {experiment!r}: use letters, digits, '.', '_' and '-' "
                          "(it names a folder)")
    location = loc.ExperimentLocation(storage, experiment, storage_uri)
    if not args.resume and location.taken():
        raise ConfigError(f"--experiment {experiment}: {location.ray_experiment} already "
                          "exists; pass --resume to continue it or choose another name")
    data_dir = Path(args.data_dir).expanduser()
    if not data_dir.is_dir():
        raise ConfigError(f"--data-dir {args.data_dir}: folder not found (expected the CS 224N "
                          "files)")
    model = _model(args.model)
    mlflow_uri, mlflow_fallback = _tracking_uri(args, storage)
    if args.address is not None:
        check_ray_address(args.address)
    base = _base_config(args, budget, space, data_dir, model)
    if extended:  # what the searcher is told must be points of the space (Optuna's add_trial)
        check_known_trials(extended.trials, space, base, extended.trials_name,
                           searcher_choice(search_alg).learns_from_earlier)
    if not args.address:
        _check_compile_modes(space, args.gpus_per_trial)
        _check_precisions(space, args.gpus_per_trial)
    points = read_points(args.points, space) if getattr(args, "points", None) else ()
    if len(points) > num_samples:
        raise ConfigError(f"--points {args.points}: {len(points)} points, more than "
                          f"--num-samples {num_samples}")
    return SearchSettings(
        space=space, space_arg=args.space, budget=budget, num_samples=num_samples,
        top_k=min(top_k, pool), location=location, storage_arg=args.storage_path,
        mlflow_uri=mlflow_uri, mlflow_fallback=mlflow_fallback, base=base,
        resume=bool(args.resume), search_alg=search_alg, scheduler=args.scheduler,
        rung_metric=rung_metric, seed=args.seed,
        cpus_per_trial=args.cpus_per_trial, gpus_per_trial=args.gpus_per_trial,
        max_concurrent=args.max_concurrent, ensemble=args.ensemble,
        keep_checkpoints=getattr(args, "keep_checkpoints", "best"),
        max_failures=args.max_failures, address=args.address,
        mlflow_fallback_local=bool(args.mlflow_fallback_local), mps=getattr(args, "mps", "auto"),
        trial_threads=getattr(args, "trial_threads", "grow"),
        fuse=getattr(args, "fuse", "auto"),
        extend=getattr(args, "extend", None), extend_trials=extended.trials if extended else None,
        points=points)


def _storage(storage_path: str) -> tuple[Path, str | None]:
    """(local root, URI or None) of ``--storage-path``, checked writable."""
    what = f"--storage-path {storage_path}"
    if loc.is_uri(storage_path):
        storage_uri = loc.check_uri(storage_path)
        folder = loc.local_path_of(storage_uri)
        if folder is not None:  # file:// -- a (shared) local filesystem: same checks
            if folder.exists() and not folder.is_dir():
                raise ConfigError(f"{what}: exists and is not a folder")
            check_creatable(folder, what)
        return loc.staging_root(storage_uri), storage_uri
    storage = Path(storage_path).expanduser().resolve()
    if storage.exists() and not storage.is_dir():
        raise ConfigError(f"{what}: exists and is not a folder")
    check_creatable(storage, what)
    return storage, None


def _check_numbers(args: argparse.Namespace, num_samples: int) -> None:
    if num_samples < 1:
        raise ConfigError(f"--num-samples {num_samples}: must be >= 1")
    if args.max_concurrent is not None and args.max_concurrent < 1:
        raise ConfigError(f"--max-concurrent {args.max_concurrent}: must be >= 1")
    if not args.cpus_per_trial > 0:
        raise ConfigError(f"--cpus-per-trial {args.cpus_per_trial:g}: must be > 0")
    if not args.address and args.cpus_per_trial > (os.cpu_count() or 1):
        raise ConfigError(f"--cpus-per-trial {args.cpus_per_trial:g}: this machine has only "
                          f"{os.cpu_count()} CPUs")
    gpus = args.gpus_per_trial
    if gpus is not None and gpus < 0:
        raise ConfigError(f"--gpus-per-trial {gpus:g}: must be >= 0")
    if gpus is not None and gpus > 1 and not float(gpus).is_integer():
        raise ConfigError(f"--gpus-per-trial {gpus:g}: above 1 it must be a "
                          "whole number of GPUs")
    if gpus is not None and gpus > 0 and not args.address:
        import torch
        if not torch.cuda.is_available():
            raise ConfigError(f"--gpus-per-trial {args.gpus_per_trial:g}: no CUDA GPU on this "
                              "machine (use --address to run on a cluster with GPUs)")
    if getattr(args, "mps", "auto") == "on" and not os.environ.get(mps.PIPE_ENV):
        mps.mps_reason_off("on", args.address, gpus, mps.local_gpu(args.address),
                           shutil.which(mps.CONTROL))
    if args.seed < 0:
        raise ConfigError(f"--seed {args.seed}: must be >= 0")
    if args.max_failures < 0:
        raise ConfigError(f"--max-failures {args.max_failures}: must be >= 0")


def _tracking_uri(args: argparse.Namespace, storage: Path) -> tuple[str, str | None]:
    """(MLflow tracking URI, the unreachable one it replaces or None), checked."""
    flush_seconds()  # MTBERT_MLFLOW_FLUSH_S, read at the search's end: checked now
    uri = args.mlflow_uri or default_tracking_uri(storage)
    try:
        check_tracking_uri(uri)
    except TrackingError as exc:
        if not (args.mlflow_fallback_local and uri.startswith(("http://", "https://"))):
            raise
        local = default_tracking_uri(storage)
        check_tracking_uri(local)
        print(f"warning: {exc}; --mlflow-fallback-local: logging to {local} instead",
              file=sys.stderr, flush=True)
        return local, uri
    return uri, None


def _check_compile_modes(space: SearchSpace, gpus_per_trial: float | None) -> None:
    """Every ``compile`` mode the space can give a trial runs on this machine's trials'
    device: CUDA where there is one (unless ``--gpus-per-trial 0``), else the CPU.  (On a
    remote cluster the workers' machines decide; a trial whose mode cannot run there
    fails with the reason.)"""
    param = space.params.get("compile")
    if param is None:
        return
    import torch

    from mtbert.core.devices import check_compile_mode  # deferred: torch
    modes = set(param.choices) if param.searched else {param.value}
    cuda = gpus_per_trial != 0 and torch.cuda.is_available()
    for mode in sorted(modes):
        check_compile_mode(mode, torch.device("cuda" if cuda else "cpu"))


def _check_precisions(space: SearchSpace, gpus_per_trial: float | None) -> None:
    """Every ``precision`` the space can give a trial runs on this machine's trials'
    device, as :func:`_check_compile_modes` checks ``compile``: bf16 where it is not
    native is one error before anything starts."""
    precisions = space_precisions(space, None)
    if not precisions:
        return
    import torch

    from mtbert.core.devices import uses_bf16  # deferred: torch
    cuda = gpus_per_trial != 0 and torch.cuda.is_available()
    for precision in precisions:
        uses_bf16(precision, torch.device("cuda" if cuda else "cpu"))


def space_precisions(space: SearchSpace, default: str | None) -> list[str]:
    """The ``precision`` values the space gives its trials: its fixed value, its choices,
    or ``[default]`` where it names none."""
    param = space.params.get("precision")
    if param is None:
        return [default] if default else []
    return sorted(set(param.choices)) if param.searched else [param.value]


def _model(model: str) -> str:
    """``--model``, checked before Ray starts (its config, tokenizer and weights file, not
    the weights: a bad one is one error naming the file); a local folder made absolute
    for the workers."""
    check_model(model)
    if Path(model).expanduser().exists() or model.startswith((".", "/", "~")):
        return str(Path(model).expanduser().resolve())
    return model


def _base_config(args: argparse.Namespace, budget: Budget, space: SearchSpace,
                 data_dir: Path, model: str) -> dict[str, Any]:
    """The TrainConfig fields every trial gets; checked valid with the space's fixed values."""
    base = {
        "model": model, "data_dir": str(data_dir.resolve()),
        "cache_dir": str(default_cache_dir("").resolve()),
        **budget.data_fields(), **run_fields(budget, args.scheduler),
        "seed": args.seed, "progress": False, "eval_dev": False,
        "threads": max(1, int(args.cpus_per_trial)),
        "device": "auto" if args.gpus_per_trial != 0 else "cpu",  # fixed by with_resources
    }
    try:
        TrainConfig.from_dict({**base, **space.fixed}, source="base config")
    except ConfigError as exc:
        raise ConfigError(f"{exc} (from the driver's arguments and the space's fixed values)",
                          key=exc.key) from None
    return base
