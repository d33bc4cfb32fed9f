"""``python tune_driver.py --space NAME ...``: distributed hyperparameter search.

Flow: validate every argument and the space file (exit 2 with one ``error: ...`` line,
nothing written) -> load and tokenise the data once -> start (or join) Ray -> MLflow
parent run -> ``Tuner.fit()`` (Optuna TPE or random search, ASHA on examples seen,
one function trainable per trial fed from Ray's object store) -> rank trials by their
best validation overall -> ensemble of the top-k best checkpoints -> summary.json,
summary.md, report plots, MLflow ensemble run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mtbert.config import EMBEDDED_MODEL, TrainConfig
from mtbert.errors import ConfigError, MtbertError
from mtbert.tune.budgets import BUDGETS, Budget, get_budget
from mtbert.tune import storage as st
from mtbert.tune.spaces import SearchSpace, list_spaces, load_space, parse_space

OBJECTIVE = "val/overall"
MODE = "max"
SETTINGS_FILE = "mtbert_search.json"
STAGED_CHECKPOINTS = "_checkpoints"  # local copies of a URI storage's best checkpoints
_EXPERIMENT_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,120}$")


class DriverArgumentParser(argparse.ArgumentParser):
    def error(self, message: str):  # one clear line, exit 2
        print(f"error: {message} (see --help)", file=sys.stderr)
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    budgets = "; ".join(f"{b.name}: {b.description}" for b in BUDGETS.values())
    p = DriverArgumentParser(
        prog="python tune_driver.py",
        description="Hyperparameter search for multitask BERT (SST-5, QQP, STS-B) with Ray "
                    "Tune (ASHA + Optuna TPE), MLflow tracking and a top-k ensemble.")
    p.add_argument("--space", help="search space: a name from search_spaces/ or a YAML path")
    p.add_argument("--list-spaces", action="store_true", help="list the search spaces and exit")
    p.add_argument("--data-dir", default=os.environ.get("MTBERT_DATA", "../shared/data"),
                   help="folder with the CS 224N files (default ../shared/data or $MTBERT_DATA)")
    p.add_argument("--model", default=EMBEDDED_MODEL,
                   help=f"encoder: local folder or hub name (default {EMBEDDED_MODEL}, packaged)")
    p.add_argument("--budget", default="small", choices=list(BUDGETS), help=budgets)
    p.add_argument("--num-samples", type=int, help="trials (default: the budget's)")
    p.add_argument("--max-concurrent", type=int,
                   help="trials at once (default: cluster CPUs / --cpus-per-trial)")
    p.add_argument("--cpus-per-trial", type=float, default=1.0, help="CPUs per trial (default 1)")
    p.add_argument("--gpus-per-trial", type=float, default=0.0,
                   help="GPUs per trial, fractions allowed (default 0)")
    p.add_argument("--search-alg", default="optuna", choices=["optuna", "random"],
                   help="Optuna TPE (seeded) or random search (baseline)")
    p.add_argument("--scheduler", default="asha", choices=["asha", "fifo"],
                   help="asha: stop weak trials at the budget's rungs (default); fifo: every "
                        "trial trains its whole budget (a baseline without early stopping)")
    p.add_argument("--seed", type=int, default=0, help="seed of the search and the trials")
    p.add_argument("--storage-path", default="ray_results",
                   help="Ray results: a local folder (default ./ray_results) or, for a "
                        "multi-node cluster, a shared folder or a URI every node reaches "
                        "(s3://BUCKET/PREFIX, gs://BUCKET/PREFIX, file:///PATH; a URI "
                        "needs --mlflow-uri)")
    p.add_argument("--experiment", help="experiment name (default SPACE-BUDGET-TIMESTAMP)")
    p.add_argument("--mlflow-uri",
                   help="MLflow tracking URI (default sqlite:///STORAGE/mlflow.db, no server)")
    p.add_argument("--mlflow-fallback-local", action="store_true",
                   help="if the --mlflow-uri server is unreachable at start, log to the "
                        "local SQLite store instead of stopping (a warning says so)")
    p.add_argument("--ensemble-top-k", type=int, help="ensemble size (default: the budget's)")
    p.add_argument("--ensemble", default="greedy", choices=["greedy", "vote"],
                   help="greedy (default): Caruana selection with replacement on val of the "
                        "top-k, combined by weighted mode (SST, QQP) / median (STS); vote: "
                        "all top-k with equal weight")
    p.add_argument("--max-failures", type=int, default=2,
                   help="retries of a trial whose worker died, from its last checkpoint")
    p.add_argument("--address",
                   help="join this running Ray cluster: auto (the one on this machine), "
                        "HOST:PORT (its GCS, e.g. HEAD:6379) or ray://HOST:10001")
    p.add_argument("--resume", action="store_true",
                   help="continue --experiment after a crash (Tuner.restore)")
    return p


@dataclass
class Plan:
    """Everything validated before anything starts."""
    args: argparse.Namespace
    space: SearchSpace
    budget: Budget
    num_samples: int
    top_k: int
    storage: Path            # local root: the storage folder, or the staging folder of a URI
    experiment: str
    exp_dir: Path            # local: the experiment folder (or its staging copy for a URI)
    mlflow_uri: str
    base: dict[str, Any]
    resume: bool
    storage_uri: str | None = None   # --storage-path as a URI (s3://, gs://, file://, ...)
    mlflow_fallback: str | None = None  # the unreachable --mlflow-uri replaced by local SQLite

    @property
    def exp_uri(self) -> str | None:
        return st.join(self.storage_uri, self.experiment) if self.storage_uri else None

    @property
    def ray_storage(self) -> str:
        """``RunConfig(storage_path=...)``."""
        return self.storage_uri or str(self.storage)

    @property
    def ray_experiment(self) -> str:
        """The experiment's location for Ray (``Tuner.restore``) and for users."""
        return self.exp_uri or str(self.exp_dir)

    def public(self, path: str | Path | None) -> str | None:
        """A path under the local experiment folder as users find it (the URI copy)."""
        if path is None or not self.exp_uri:
            return None if path is None else str(path)
        try:
            rel = Path(path).resolve().relative_to(self.exp_dir.resolve())
        except ValueError:
            return str(path)
        return st.join(self.exp_uri, *rel.parts) if rel.parts else self.exp_uri


# ---------------------------------------------------------------------- validation
def validate(args: argparse.Namespace) -> Plan:
    """Check every CLI value and the space; raises MtbertError; writes nothing."""
    from mtbert.tune.tracking import TrackingError, check_tracking_uri, default_tracking_uri

    storage_uri: str | None = None
    if st.is_uri(args.storage_path):
        storage_uri = st.check_uri(args.storage_path)
        folder = st.local_path_of(storage_uri)
        if folder is not None:  # file:// -- a (shared) local filesystem: same checks
            if folder.exists() and not folder.is_dir():
                raise ConfigError(f"--storage-path {args.storage_path}: exists and is not a "
                                  "folder")
            _check_creatable(folder, f"--storage-path {args.storage_path}")
        storage = st.staging_root(storage_uri)
    else:
        storage = Path(args.storage_path).expanduser().resolve()
        if storage.exists() and not storage.is_dir():
            raise ConfigError(f"--storage-path {args.storage_path}: exists and is not a folder")
        _check_creatable(storage, f"--storage-path {args.storage_path}")
    resume = bool(args.resume)
    saved: dict[str, Any] | None = None
    if resume:
        if not args.experiment:
            raise ConfigError("--resume needs --experiment NAME (the search to continue)")
        if storage_uri:
            where = st.join(storage_uri, args.experiment)
            text = st.read_text(st.join(where, SETTINGS_FILE))
        else:
            where = storage / args.experiment
            saved_file = where / SETTINGS_FILE
            text = saved_file.read_text(encoding="utf-8") if saved_file.is_file() else None
        if text is None:
            raise ConfigError(f"--resume: no search to resume in {where} (no {SETTINGS_FILE})")
        saved = json.loads(text)
        # the original settings win: the data, space and budget must not drift
        for key, value in saved["args"].items():
            if key not in ("resume", "address", "mlflow_fallback_local"):
                setattr(args, key, value)
    if storage_uri and not args.mlflow_uri:
        raise ConfigError(f"--storage-path {args.storage_path}: a URI storage needs "
                          "--mlflow-uri (an MLflow server http://HOST:5000, or "
                          "sqlite:///PATH.db): the default SQLite store lives in a local "
                          "storage folder")
    if args.space is None:
        raise ConfigError("--space is required (see --list-spaces)")
    space = parse_space(saved["space"], saved["space_path"]) if saved else load_space(args.space)
    budget = get_budget(args.budget)
    num_samples = args.num_samples if args.num_samples is not None else budget.num_samples
    if num_samples < 1:
        raise ConfigError(f"--num-samples {num_samples}: must be >= 1")
    if args.max_concurrent is not None and args.max_concurrent < 1:
        raise ConfigError(f"--max-concurrent {args.max_concurrent}: must be >= 1")
    if not args.cpus_per_trial > 0:
        raise ConfigError(f"--cpus-per-trial {args.cpus_per_trial:g}: must be > 0")
    if not args.address and args.cpus_per_trial > (os.cpu_count() or 1):
        raise ConfigError(f"--cpus-per-trial {args.cpus_per_trial:g}: this machine has only "
                          f"{os.cpu_count()} CPUs")
    if args.gpus_per_trial < 0:
        raise ConfigError(f"--gpus-per-trial {args.gpus_per_trial:g}: must be >= 0")
    if args.gpus_per_trial > 1 and not float(args.gpus_per_trial).is_integer():
        raise ConfigError(f"--gpus-per-trial {args.gpus_per_trial:g}: above 1 it must be a "
                          "whole number of GPUs")
    if args.gpus_per_trial > 0 and not args.address:
        import torch
        if not torch.cuda.is_available():
            raise ConfigError(f"--gpus-per-trial {args.gpus_per_trial:g}: no CUDA GPU on this "
                              "machine (use --address to run on a cluster with GPUs)")
    if args.seed < 0:
        raise ConfigError(f"--seed {args.seed}: must be >= 0")
    if args.max_failures < 0:
        raise ConfigError(f"--max-failures {args.max_failures}: must be >= 0")
    top_k = args.ensemble_top_k if args.ensemble_top_k is not None else budget.ensemble_top_k
    if top_k < 1:
        raise ConfigError(f"--ensemble-top-k {top_k}: must be >= 1")
    if args.ensemble_top_k is not None and top_k > num_samples:
        raise ConfigError(f"--ensemble-top-k {top_k}: more than --num-samples {num_samples}")
    top_k = min(top_k, num_samples)
    experiment = args.experiment or f"{space.name}-{budget.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    if not _EXPERIMENT_RE.match(experiment):
        raise ConfigError(f"--experiment {experiment!r}: use letters, digits, '.', '_' and '-' "
                          "(it names a folder)")
    exp_dir = storage / experiment
    if not resume:
        where = st.join(storage_uri, experiment) if storage_uri else exp_dir
        taken = st.exists(where) if storage_uri else exp_dir.exists()
        if taken:
            raise ConfigError(f"--experiment {experiment}: {where} already exists; pass "
                              "--resume to continue it or choose another name")
    data_dir = Path(args.data_dir).expanduser()
    if not data_dir.is_dir():
        raise ConfigError(f"--data-dir {args.data_dir}: folder not found (expected the CS 224N "
                          "files)")
    from mtbert.pretrained import resolve_model_path
    model = args.model
    if Path(model).expanduser().exists() or model.startswith((".", "/", "~")):
        resolve_model_path(model)  # raises a ConfigError naming the problem
        model = str(Path(model).expanduser().resolve())
    mlflow_uri = args.mlflow_uri or default_tracking_uri(storage)
    mlflow_fallback = None
    try:
        check_tracking_uri(mlflow_uri)
    except TrackingError as exc:
        if not (args.mlflow_fallback_local and mlflow_uri.startswith(("http://", "https://"))):
            raise
        mlflow_fallback, mlflow_uri = mlflow_uri, default_tracking_uri(storage)
        check_tracking_uri(mlflow_uri)
        print(f"warning: {exc}; --mlflow-fallback-local: logging to {mlflow_uri} instead",
              file=sys.stderr, flush=True)
    if args.address is not None:
        check_ray_address(args.address)

    from mtbert.data import default_cache_dir
    base = {
        "model": model, "data_dir": str(data_dir.resolve()),
        "cache_dir": str(default_cache_dir("").resolve()),
        **budget.data_fields(), **budget.trial_fields(),
        "seed": args.seed, "progress": False, "eval_dev": False,
        "threads": max(1, int(args.cpus_per_trial)),
        "device": "auto" if args.gpus_per_trial > 0 else "cpu",
    }
    # the trial config (base + every value the space can produce) must be valid
    try:
        TrainConfig.from_dict({**base, **space.fixed}, source="base config")
    except ConfigError as exc:
        raise ConfigError(f"{exc} (from the driver's arguments and the space's fixed values)",
                          key=exc.key) from None
    return Plan(args, space, budget, num_samples, top_k, storage, experiment, exp_dir,
                mlflow_uri, base, resume, storage_uri, mlflow_fallback)


def check_ray_address(address: str, timeout: float = 3.0) -> str:
    """Fail fast on a Ray cluster that is not there (``ray.init`` would retry for minutes).

    ``auto``: the cluster ``ray start`` left on this machine (or ``$RAY_ADDRESS``);
    ``HOST:PORT`` / ``ray://HOST:PORT``: a TCP connection to it within ``timeout``
    seconds.  Returns ``HOST:PORT``; raises :class:`ConfigError`."""
    text = address.strip()
    if not text:
        raise ConfigError("--address: empty (use auto, HOST:PORT or ray://HOST:PORT)")
    if text == "auto":
        from ray._private.services import canonicalize_bootstrap_address
        try:
            target = canonicalize_bootstrap_address("auto")
        except (ConnectionError, ValueError) as exc:
            raise ConfigError(f"--address auto: no running Ray cluster found on this machine "
                              f"({exc}); start one with `ray start --head` or give "
                              "--address HOST:PORT") from None
        if not target:
            raise ConfigError("--address auto: no running Ray cluster found on this machine")
    else:
        target = text[len("ray://"):] if text.startswith("ray://") else text
    host, sep, port = target.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or "/" in target or not port.isdigit() \
            or not 0 < int(port) < 65536:
        raise ConfigError(f"--address {address}: expected auto, HOST:PORT (the head's GCS "
                          "port, e.g. 10.0.0.5:6379) or ray://HOST:PORT")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            pass
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise ConfigError(f"--address {address}: no Ray cluster reachable at {host}:{port} "
                          f"({reason} within {timeout:g} s); start it (ray start --head "
                          f"--port={port}) or fix the address") from None
    return f"{host}:{port}"


def _check_creatable(folder: Path, what: str) -> None:
    probe = folder
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir() or not os.access(probe, os.W_OK) or not _can_mkdir(probe):
        raise ConfigError(f"{what}: cannot create a folder under {probe}")


def _can_mkdir(folder: Path) -> bool:
    """Really try (and undo): ``os.access`` says yes to root even on /proc or a read-only
    mount."""
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".mtbert-probe-", dir=folder))
    except OSError:
        return False
    return True


# ---------------------------------------------------------------------- main
def _quiet_environment() -> None:
    """Settings inherited by the local Ray workers: no tokenizer threads, no progress bars,
    no warning each time a checkpoint forces an experiment-state snapshot."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TUNE_WARN_EXCESSIVE_EXPERIMENT_CHECKPOINT_SYNC_THRESHOLD_S", "0")
    # snapshot Tune's experiment state every second (Ray's "auto" waits >= 10 s): what
    # --resume restores after a driver crash is then at most a second or so old, so it
    # rarely names a trial's checkpoint that num_to_keep has deleted since (such a trial
    # cannot be restored) or misses a trial that ended or started meanwhile
    os.environ.setdefault("TUNE_GLOBAL_CHECKPOINT_S", "1")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _quiet_environment()
    if args.list_spaces:
        for name, description in list_spaces():
            print(f"{name:<10} {description}")
        return 0
    try:
        plan = validate(args)
        from mtbert.data import load_data
        print(f"[tune] loading and tokenising {plan.base['data_dir']} once "
              f"(model {plan.base['model']}) ...", flush=True)
        data = load_data(TrainConfig.from_dict(plan.base, source="driver"))
    except MtbertError as exc:
        print(f"error: {one_line(str(exc))}", file=sys.stderr)
        return 2
    budget = plan.budget.resolved(sum(data.train_sizes().values()))
    plan.base.update(budget.trial_fields())
    try:
        return run_search(plan, budget, data)
    except KeyboardInterrupt:  # a second Ctrl-C while Tune was winding down after the first
        print(f"error: interrupted twice: stopped without a summary; Ray's last experiment "
              f"snapshot is kept. Continue with: python tune_driver.py --resume --experiment "
              f"{plan.experiment} --storage-path {args.storage_path}", file=sys.stderr)
        return 130


def one_line(message: str) -> str:
    """The CLI's contract is one ``error:`` line: fold a multi-line message (a YAML
    parser's, with its source excerpt and ``^`` marker) into one."""
    parts = [ln.strip() for ln in message.splitlines()]
    parts = [p for p in parts if p and set(p) != {"^"}]
    return "; ".join(p.rstrip(":") if i < len(parts) - 1 else p for i, p in enumerate(parts))


def _trial_name(trial) -> str:
    return f"trial_{trial.trial_id}"


def run_search(plan: Plan, budget: Budget, data) -> int:
    import ray
    from ray import tune

    from mtbert.tune.callback import MlflowTrialCallback
    from mtbert.tune.trainable import train_trial
    from mtbert.tune.tracking import SearchTracker

    args = plan.args
    started_ray = False
    if not ray.is_initialized():
        if args.address:
            ray.init(address=args.address, log_to_driver=True)
        else:
            start_local_ray()
        started_ray = True
    try:
        url = _dashboard_url()
        print(f"[tune] Ray dashboard: {url}" if url else "[tune] Ray dashboard: not running",
              flush=True)
        resources = ray.cluster_resources()
        cpus, gpus = resources.get("CPU", 0.0), resources.get("GPU", 0.0)
        if args.cpus_per_trial > cpus:
            print(f"error: --cpus-per-trial {args.cpus_per_trial:g}: the Ray cluster has "
                  f"{cpus:g} CPUs", file=sys.stderr)
            return 2
        if args.gpus_per_trial > 0 and args.gpus_per_trial > gpus:
            if not (args.address and args.max_concurrent):
                print(f"error: --gpus-per-trial {args.gpus_per_trial:g}: the Ray cluster has "
                      f"{gpus:g} GPUs (on an autoscaling cluster whose GPU workers start at 0, "
                      "also give --max-concurrent N: trials then wait for the autoscaler)",
                      file=sys.stderr)
                return 2
            print(f"[tune] the Ray cluster has {gpus:g} GPUs now: the {args.max_concurrent} "
                  "trials at once wait for the autoscaler to add GPU nodes", flush=True)
        max_concurrent = args.max_concurrent or _auto_concurrency(cpus, gpus, args)

        if plan.storage_uri and not plan.resume:
            st.reset_staging(plan.exp_dir)  # a stale staging copy of an earlier search
        plan.exp_dir.mkdir(parents=True, exist_ok=True)
        if not plan.resume:
            _write_settings(plan, budget)
        elif plan.storage_uri:
            settings = st.read_text(st.join(plan.exp_uri, SETTINGS_FILE))
            (plan.exp_dir / SETTINGS_FILE).write_text(settings, encoding="utf-8")
        tracker = SearchTracker(plan.mlflow_uri, f"mtbert/{plan.space.name}",
                                plan.exp_uri or plan.exp_dir, fresh=not plan.resume)
        tags = {"space": plan.space.name, "budget": budget.name,
                "ray_experiment": plan.ray_experiment}
        if plan.mlflow_fallback:
            tags["mlflow_fallback_from"] = plan.mlflow_fallback
        parent = tracker.start_parent(plan.experiment, _parent_params(plan, budget,
                                                                      max_concurrent), tags)
        tracker.log_artifact(parent, plan.exp_dir / SETTINGS_FILE)
        print(f"[tune] experiment {plan.ray_experiment}  |  MLflow {plan.mlflow_uri} "
              f"(experiment mtbert/{plan.space.name}, parent run {parent})", flush=True)
        print(f"[tune] space {plan.space.name}: {', '.join(plan.space.searched)}; budget "
              f"{budget.name}: {budget.max_examples} examples/trial, {_eval_points(budget)}, "
              f"ASHA grace {budget.grace_period} rf {budget.reduction_factor:g}; "
              f"{plan.num_samples} trials, {max_concurrent} at once",
              flush=True)

        # on resume: trials that had ended before the driver died must not train again;
        # Ray replays them from its snapshot, where such a trial may have no result yet
        ended = tracker.freeze_ended() if plan.resume else {}
        if ended:
            os.environ["TUNE_DISABLE_STRICT_METRIC_CHECKING"] = "1"
        trainable = tune.with_resources(
            tune.with_parameters(train_trial, data=data, base=plan.base, ended=ended),
            {"cpu": args.cpus_per_trial, "gpu": args.gpus_per_trial})
        callback = MlflowTrialCallback(tracker, plan.base, budget.max_examples,
                                       budget.rungs())
        if plan.resume and tune.Tuner.can_restore(plan.ray_experiment):
            print(f"[tune] resuming {plan.ray_experiment} (Tuner.restore)", flush=True)
            tuner = tune.Tuner.restore(plan.ray_experiment, trainable=trainable,
                                       resume_unfinished=True, resume_errored=False,
                                       param_space=plan.space.param_space())
        else:
            tuner = tune.Tuner(
                trainable, param_space=plan.space.param_space(),
                tune_config=tune.TuneConfig(
                    metric=OBJECTIVE, mode=MODE, num_samples=plan.num_samples,
                    search_alg=_search_alg(args.search_alg, args.seed, max_concurrent,
                                           plan.num_samples),
                    scheduler=_scheduler(args.scheduler, budget),
                    trial_name_creator=_trial_name, trial_dirname_creator=_trial_name),
                run_config=tune.RunConfig(
                    name=plan.experiment, storage_path=plan.ray_storage,
                    checkpoint_config=tune.CheckpointConfig(
                        num_to_keep=2, checkpoint_score_attribute=OBJECTIVE,
                        checkpoint_score_order=MODE),
                    failure_config=tune.FailureConfig(max_failures=args.max_failures),
                    callbacks=[callback]))
        with InterruptWatch() as watch:
            grid = tuner.fit()
        return finalize_search(plan, budget, data, grid, tracker, parent,
                               interrupted=watch.interrupted)
    finally:
        if started_ray:
            ray.shutdown()


def _eval_points(budget: Budget) -> str:
    if budget.eval_growth > 1:
        return f"evaluated at {budget.eval_every} x {budget.eval_growth:g}^k and the end"
    return f"evaluated every {budget.eval_every}"


def start_local_ray(**kwargs):
    """A one-machine Ray whose dashboard listens on 127.0.0.1 only (reach it from another
    machine with an SSH port-forward)."""
    import ray
    return ray.init(include_dashboard=True, dashboard_host="127.0.0.1", log_to_driver=True,
                    **kwargs)


def _dashboard_url() -> str | None:
    try:
        from ray._private.worker import get_dashboard_url
        url = get_dashboard_url()
    except Exception:  # noqa: BLE001 -- the URL is informative only
        return None
    if not url:
        return None
    return url if url.startswith("http") else f"http://{url}"


def _auto_concurrency(cpus: float, gpus: float, args) -> int:
    n = max(1, int(cpus // args.cpus_per_trial))
    if args.gpus_per_trial > 0:
        n = min(n, max(1, int(gpus // args.gpus_per_trial)))
    return n


def _search_alg(name: str, seed: int, max_concurrent: int, num_samples: int):
    if name == "random":
        from ray.tune.search.basic_variant import BasicVariantGenerator
        return BasicVariantGenerator(random_state=seed, max_concurrent=max_concurrent)
    import optuna
    from ray.tune.search import ConcurrencyLimiter
    from ray.tune.search.optuna import OptunaSearch
    # TPE (Bergstra et al. 2011): random for the first trials, then model-based
    startup = max(2, min(10, num_samples // 3))
    sampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=startup)
    return ConcurrencyLimiter(OptunaSearch(sampler=sampler), max_concurrent=max_concurrent)


def _scheduler(name: str, budget: Budget):
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler
    if name == "fifo":
        return FIFOScheduler()
    return ASHAScheduler(time_attr="examples_seen", max_t=budget.max_examples,
                         grace_period=budget.grace_period,
                         reduction_factor=budget.reduction_factor)


def _write_settings(plan: Plan, budget: Budget) -> None:
    settings = {"args": {k: v for k, v in vars(plan.args).items()},
                "space": plan.space.to_dict(), "space_path": plan.space.path,
                "budget": budget.to_dict(), "base": plan.base, "num_samples": plan.num_samples,
                "experiment": plan.experiment, "mlflow_uri": plan.mlflow_uri}
    settings["args"].update(experiment=plan.experiment, mlflow_uri=plan.mlflow_uri,
                            storage_path=plan.storage_uri or str(plan.storage),
                            data_dir=plan.base["data_dir"],
                            model=plan.base["model"], num_samples=plan.num_samples,
                            ensemble_top_k=plan.top_k)
    text = json.dumps(settings, indent=2, default=str)
    (plan.exp_dir / SETTINGS_FILE).write_text(text, encoding="utf-8")
    if plan.exp_uri:
        st.write_text(st.join(plan.exp_uri, SETTINGS_FILE), text)


def _parent_params(plan: Plan, budget: Budget, max_concurrent: int) -> dict[str, Any]:
    a = plan.args
    params = {"space": plan.space.name, "budget": budget.name, "num_samples": plan.num_samples,
              "max_concurrent": max_concurrent, "cpus_per_trial": a.cpus_per_trial,
              "gpus_per_trial": a.gpus_per_trial, "search_alg": a.search_alg,
              "scheduler": a.scheduler, "seed": a.seed,
              "split_seed": plan.base.get("split_seed", 0), "model": plan.base["model"],
              "data_dir": plan.base["data_dir"], "ensemble": a.ensemble,
              "ensemble_top_k": plan.top_k, "max_failures": a.max_failures,
              "address": a.address or "local", "objective": OBJECTIVE,
              "storage": plan.ray_storage}
    params.update({f"budget.{k}": v for k, v in budget.to_dict().items() if k != "name"})
    for key, p in plan.space.params.items():
        params[f"space.{key}"] = p.describe()
    return params


# ---------------------------------------------------------------------- after the search
class InterruptWatch:
    """Whether ``Tuner.fit()`` ended on Ctrl-C (SIGINT) or SIGUSR1 rather than with the search done.

    Tune installs its own SIGINT handler for the run and, on the first stop signal, puts
    back the handler that was there before (``ray.tune.tune._setup_signal_catching``); the
    fit then returns normally.  This watch installs a marker handler first: finding the
    marker in place after the fit means Tune was stopped by a signal."""

    def __enter__(self) -> "InterruptWatch":
        import signal
        self._previous = signal.getsignal(signal.SIGINT)
        self.interrupted = False

        def marker(signum, frame):  # a second Ctrl-C while Tune winds down: stop hard
            raise KeyboardInterrupt
        self._marker = marker
        signal.signal(signal.SIGINT, marker)
        return self

    def __exit__(self, *exc) -> None:
        import signal
        self.interrupted = signal.getsignal(signal.SIGINT) is self._marker
        signal.signal(signal.SIGINT, self._previous)


def finalize_search(plan: Plan, budget: Budget, data, grid, tracker, parent_run: str,
                    interrupted: bool = False) -> int:
    from mtbert.tune import finalize as fz
    from mtbert.tune.callback import effective_config
    from mtbert.tune.report import write_report

    import transformers
    transformers.utils.logging.disable_progress_bar()
    exp_dir = plan.exp_dir
    records = fz.collect_trials(grid, budget.max_examples, budget.rungs(),
                                ended=set(tracker.ended_trials()))
    children = tracker.state.get("children", {})
    for r in records:
        r.mlflow_run_id = children.get(r.trial_id, {}).get("run_id")
    # a trial that started just before a driver crash, after Ray's last experiment snapshot:
    # the restored search does not know it (it samples another one instead); close its run
    known = {r.trial_id for r in records}
    for tid in sorted(set(children) - known):
        if children[tid].get("status") in (None, "RUNNING"):
            tracker.end_trial(tid, "KILLED", {
                "status": "orphaned", "error_reason": "started just before the driver "
                "crashed, after Ray's last experiment snapshot: not resumed"})
    ranked = fz.ranked(records)
    stored_checkpoint: dict[str, str] = {}  # trial id -> its best checkpoint's URI
    if plan.storage_uri:  # local copies: metrics + val predictions; the model for finalists
        finalist_ids = {r.trial_id for r in ranked[:plan.top_k]}
        for r in records:
            if r.best_checkpoint:
                stored_checkpoint[r.trial_id] = st.uri_of(plan.storage_uri, r.best_checkpoint)
                r.best_checkpoint = str(st.download_checkpoint(
                    plan.storage_uri, r.best_checkpoint,
                    exp_dir / STAGED_CHECKPOINTS / r.trial_id,
                    with_state=r.trial_id in finalist_ids))
    searched_keys = list(plan.space.searched)
    counts = {"trials": len(records),
              "completed": sum(r.status == "completed" for r in records),
              "stopped_early": sum(r.status == "stopped_early" for r in records),
              "errored": sum(r.status == "error" for r in records),
              "interrupted": sum(r.status == "interrupted" for r in records),
              # trials asked for that never ran: not sampled yet when the search was
              # interrupted (--resume runs them), or lost to a driver crash (below)
              "not_started": max(0, plan.num_samples - len(records))}
    interrupted = interrupted or counts["interrupted"] > 0
    for r in records:  # Ctrl-C: its MLflow run is closed as KILLED; --resume reopens it
        if r.status == "interrupted" and r.trial_id in children:
            tracker.end_trial(r.trial_id, "KILLED", {
                "status": "interrupted", "stopped_early": "false",
                "examples_seen": r.examples_seen})

    finalists = ranked[:plan.top_k]
    device = "cuda" if plan.args.gpus_per_trial > 0 and _cuda() else "cpu"
    preds: dict[str, Any] = {}
    for r in finalists:
        print(f"[tune] predicting val/dev/test with {r.trial_id}'s best checkpoint "
              f"(val overall {r.best_score:.4f})", flush=True)
        preds[r.trial_id] = fz.predict_member(r.best_checkpoint, data, device)
    ensemble = None
    if finalists:
        ids = [r.trial_id for r in finalists]
        ensemble = fz.build_ensemble(ids, preds, data, plan.args.ensemble)
        fz.write_ensemble_predictions(exp_dir / "ensemble" / "predictions", data, ensemble)
        fz.write_member_predictions(exp_dir / "best_trial" / "predictions", data, preds[ids[0]])

    dev_of: dict[str, dict[str, float]] = {}
    from mtbert.ensemble import task_labels
    for tid, p in preds.items():
        dev_of[tid] = fz.scalar(fz.score_split(data, "dev", {
            t: task_labels(t, v) for t, v in p["dev"].items()}))

    report = write_report(records, plan.space.optuna_distributions(), exp_dir,
                          rungs=budget.rungs())

    top = []
    for r in ranked[:max(plan.top_k, 5)]:
        d = fz.record_dict(r, searched_keys)
        top.append({"trial_id": r.trial_id, "status": r.status, "examples_seen": r.examples_seen,
                    "val": {k: v for k, v in r.best.items() if k.startswith("val/")},
                    "dev": dev_of.get(r.trial_id, {}), "searched": d["searched"],
                    "mlflow_run_id": r.mlflow_run_id})
    best = ranked[0] if ranked else None
    summary: dict[str, Any] = {
        "experiment": plan.experiment, "experiment_dir": str(exp_dir),
        "space": {"name": plan.space.name, "path": plan.space.path,
                  "description": plan.space.description, **plan.space.to_dict()},
        "budget": budget.to_dict(), "search_alg": plan.args.search_alg,
        "scheduler": plan.args.scheduler, "seed": plan.args.seed,
        "num_samples": plan.num_samples, "objective": OBJECTIVE, "mode": MODE,
        "counts": counts, "interrupted": interrupted,
        "best_trial": None if best is None else {
            "trial_id": best.trial_id, "name": best.name, "status": best.status,
            "searched": {k: best.config[k] for k in searched_keys if k in best.config},
            "config": effective_config(plan.base, best.config),
            "val": {k: v for k, v in best.best.items() if k.startswith("val/")},
            "dev": dev_of.get(best.trial_id, {}),
            "examples_seen_at_best": best.best.get("examples_seen"),
            "checkpoint": best.best_checkpoint, "mlflow_run_id": best.mlflow_run_id,
            "predictions": str(exp_dir / "best_trial" / "predictions")},
        "ensemble": None if ensemble is None else {
            "method": ensemble.method, "members": ensemble.selected,
            "candidates": ensemble.members, "weights": ensemble.weights_by_member(),
            "val": {k: v for k, v in fz.scalar(ensemble.metrics).items() if k.startswith("val/")},
            "dev": {k: v for k, v in fz.scalar(ensemble.metrics).items() if k.startswith("dev/")},
            "predictions": str(exp_dir / "ensemble" / "predictions")},
        "top_trials": top,
        "trials": [fz.record_dict(r, searched_keys) for r in records],
        "importances": report["importances"],
        "report_files": report["files"],
        "mlflow": {"tracking_uri": plan.mlflow_uri, "experiment_id": tracker.state.get(
            "experiment_id"), "parent_run_id": parent_run},
    }

    _log_to_mlflow(plan, tracker, parent_run, records, finalists, preds, data, ensemble,
                   summary, exp_dir)
    summary["mlflow"]["ensemble_run_id"] = tracker.state.get("ensemble_run_id")
    if plan.storage_uri:  # name where the files live for users: the URI, not the staging copy
        _public_paths(plan, summary, stored_checkpoint)
    (exp_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str),
                                          encoding="utf-8")
    (exp_dir / "summary.md").write_text(fz.summary_markdown(summary), encoding="utf-8")
    tracker.log_artifact(parent_run, exp_dir / "summary.json")
    tracker.log_artifact(parent_run, exp_dir / "summary.md")
    if plan.exp_uri:
        st.upload_tree(exp_dir, plan.exp_uri, skip=(STAGED_CHECKPOINTS,))
    # an interrupted search's parent run is KILLED until --resume reopens and finishes it
    tracker.finish(parent_run, "KILLED" if interrupted else "FINISHED" if finalists else "FAILED")

    print()
    print(fz.console_table(summary))
    print(f"[tune] summary: {plan.public(exp_dir / 'summary.json')}  |  "
          f"{plan.public(exp_dir / 'summary.md')}")
    print(f"[tune] compare runs: mlflow ui --backend-store-uri {plan.mlflow_uri} "
          "--host 127.0.0.1")
    if interrupted:
        print(f"[tune] the search was interrupted: {counts['interrupted']} trials did not "
              f"finish and {counts['not_started']} had not started; the summary covers what "
              f"ran. Continue it with: python tune_driver.py "
              f"--resume --experiment {plan.experiment} --storage-path "
              f"{plan.args.storage_path}", file=sys.stderr)
    if counts["not_started"] and not interrupted:
        # Ray snapshots its searcher apart from its trial list: a trial suggested in the
        # instant before a driver crash can be counted by the restored searcher and yet be
        # missing from the restored trials, so the resumed search ends that many short
        print(f"warning: {counts['not_started']} of the {plan.num_samples} trials asked for "
              f"never ran (a trial suggested just before the driver died is lost from Ray's "
              f"snapshot); start another search for more", file=sys.stderr)
    if not finalists:
        print(f"error: no trial produced a checkpoint ({counts['errored']} errored); see "
              f"{exp_dir / 'summary.md'}", file=sys.stderr)
        return 1
    return 130 if interrupted else 0


def _public_paths(plan: Plan, summary: dict[str, Any], stored: dict[str, str]) -> None:
    """Rewrite the summary's local staging paths to their URIs under --storage-path."""
    summary["experiment_dir"] = plan.exp_uri
    best = summary.get("best_trial")
    if best:
        best["checkpoint"] = stored.get(best["trial_id"], best["checkpoint"])
        best["predictions"] = plan.public(best["predictions"])
    if summary.get("ensemble"):
        summary["ensemble"]["predictions"] = plan.public(summary["ensemble"]["predictions"])
    for t in summary["trials"]:
        if t.get("best_checkpoint"):
            t["best_checkpoint"] = stored.get(t["trial_id"], t["best_checkpoint"])
    summary["report_files"] = {k: plan.public(v) for k, v in summary["report_files"].items()}


def _cuda() -> bool:
    import torch
    return torch.cuda.is_available()


def _log_to_mlflow(plan, tracker, parent_run, records, finalists, preds, data, ensemble,
                   summary, exp_dir: Path) -> None:
    """Per-trial artifacts, the ensemble run, the parent's metrics and report files."""
    import yaml

    from mtbert.tune import finalize as fz
    from mtbert.tune.callback import effective_config
    from mtbert.tune.report import confusion_plot

    with tempfile.TemporaryDirectory(prefix="mtbert-mlflow-") as tmp:
        tmp_dir = Path(tmp)
        for r in records:
            if not r.mlflow_run_id:
                continue
            run_dir = tmp_dir / r.trial_id
            run_dir.mkdir()
            config_file = run_dir / "config.yaml"
            config_file.write_text(yaml.safe_dump(effective_config(plan.base, r.config),
                                                  sort_keys=False), encoding="utf-8")
            tracker.log_artifact(r.mlflow_run_id, config_file)
            tracker.set_tags(r.mlflow_run_id, {"best_val_overall": f"{r.best_score:.6f}",
                                               "status": r.status})
            if r.best_checkpoint:
                ckpt = Path(r.best_checkpoint)
                for f in sorted((ckpt / "predictions").glob("val-*.parquet")):
                    tracker.log_artifact(r.mlflow_run_id, f, "predictions")
                metrics_file = ckpt / "metrics.json"
                if metrics_file.is_file():
                    m = json.loads(metrics_file.read_text(encoding="utf-8"))
                    if "val/sst_confusion" in m:
                        png = confusion_plot(m["val/sst_confusion"], run_dir / "sst_confusion.png",
                                             f"{r.trial_id}: val SST at {m.get('examples_seen')} ex.")
                        tracker.log_artifact(r.mlflow_run_id, png)
            if r.trial_id in preds:
                pred_dir = fz.write_member_predictions(run_dir / "finalist", data, preds[r.trial_id])
                for f in sorted(pred_dir.glob("*")):
                    tracker.log_artifact(r.mlflow_run_id, f, "finalist_predictions")
                dev = summary["top_trials"]
                for t in dev:
                    if t["trial_id"] == r.trial_id and t["dev"]:
                        tracker.log_metrics(r.mlflow_run_id, t["dev"], step=r.examples_seen)

        if ensemble is not None:
            run = tracker.ensemble_run(f"{plan.experiment}-ensemble", {
                "method": ensemble.method, "members": ",".join(ensemble.selected),
                "candidates": ",".join(ensemble.members),
                "weights": json.dumps(ensemble.weights_by_member()), "top_k": plan.top_k})
            tracker.log_metrics(run, fz.scalar(ensemble.metrics))
            tracker.log_metrics(run, {f"best_single/{k}": v
                                      for k, v in fz.scalar(ensemble.best_single).items()})
            folder = exp_dir / "ensemble" / "predictions"
            for f in sorted(folder.glob("*")):
                tracker.log_artifact(run, f, "predictions")
            if "sst" in ensemble.labels.get("val", {}):
                from mtbert.metrics import confusion_matrix
                cm = confusion_matrix(ensemble.labels["val"]["sst"],
                                      data.split("sst", "val").labels, 5)
                tracker.log_artifact(run, confusion_plot(cm, tmp_dir / "sst_confusion.png",
                                                         "ensemble: val SST"))
            tracker.finish(run)

        c = summary["counts"]
        metrics = {"trials_completed": c["completed"], "trials_stopped_early": c["stopped_early"],
                   "trials_errored": c["errored"]}
        if summary["best_trial"]:
            b = summary["best_trial"]
            metrics.update({f"best/{k}": v for k, v in {**b["val"], **b["dev"]}.items()})
        if summary["ensemble"]:
            e = summary["ensemble"]
            metrics.update({f"ensemble/{k}": v for k, v in {**e["val"], **e["dev"]}.items()})
        tracker.log_metrics(parent_run, metrics)
        if summary["best_trial"]:
            tracker.set_tags(parent_run, {"best_trial_id": summary["best_trial"]["trial_id"]})
        for path in summary["report_files"].values():
            tracker.log_artifact(parent_run, path, "report")


def cli() -> None:
    sys.exit(main())


if __name__ == "__main__":
    cli()
