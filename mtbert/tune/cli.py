"""``python tune_driver.py``: the command line of a search and its exit codes.

Exit codes: 0 the search ran and its summary is written; 1 no trial produced a
checkpoint; 2 bad input (one ``error: ...`` line on stderr, nothing written); 130 the
search was interrupted (Ctrl-C: the summary covers what ran; ``--resume`` continues).
``--send-mlflow`` (send_mlflow.py): 0 every MLflow write of the search sent, 1 its server
still away, 2 bad input.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

from mtbert.core.config import EMBEDDED_MODEL
from mtbert.core.errors import ConfigError, MtbertError
from mtbert.tune.search.budgets import BUDGETS
from mtbert.tune.infra.cluster import quiet_environment
from mtbert.tune.search.choices import (DEFAULT_SCHEDULER, DEFAULT_SEARCHER, KEEP_CHOICES,
                                        SCHEDULERS, SEARCHERS)
from mtbert.tune.infra.mps import CHOICES as MPS_CHOICES
from mtbert.tune.trial.objective import DEFAULT_RUNG_METRIC, RUNG_METRICS, rung_metric_keys
from mtbert.tune.send_mlflow import send
from mtbert.tune.settings import FUSE_CHOICES, resolve_settings, resume_command
from mtbert.tune.search.spaces import default_spaces_dir, list_spaces


class DriverArgumentParser(argparse.ArgumentParser):
    def error(self, message: str):  # one clear line, exit 2
        print(f"error: {message} (see --help)", file=sys.stderr)
        raise SystemExit(2)


def finite_float(text: str) -> float:
    """A float flag's value: a finite number (nan or inf would reach Ray and hang it)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def rung_metric_arg(text: str) -> str:
    """``--rung-metric``: a name of RUNG_METRICS, or names joined by commas (one per rung)."""
    try:
        rung_metric_keys(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc).split(": ", 1)[1]) from None
    return text


def searcher_help() -> str:
    """``--search-alg``'s help: each choice's line and the defaults (choices.py)."""
    by_searcher: dict[str, list[str]] = {}
    for name, s in SCHEDULERS.items():
        if s.default_searcher != DEFAULT_SEARCHER:
            by_searcher.setdefault(s.default_searcher, []).append(name)
    paired = "".join(f"{searcher} for --scheduler {' / '.join(names)}, "
                     for searcher, names in by_searcher.items())
    return ("; ".join(c.help_line() for c in SEARCHERS.values())
            + f". Default: {paired}else {DEFAULT_SEARCHER}")


def scheduler_help() -> str:
    """``--scheduler``'s help: each choice's line and the defaults (choices.py)."""
    paired = ", ".join(f"{c.default_scheduler} with --search-alg {name}"
                       for name, c in SEARCHERS.items() if c.default_scheduler)
    return ("; ".join(c.help_line() for c in SCHEDULERS.values())
            + f". Default {DEFAULT_SCHEDULER} ({paired})")


#: ``--extend``'s help (extension.py)
EXTEND_HELP = ("grow the finished search EXPERIMENT (in --storage-path): a new search "
               "(--experiment) whose searcher is first told EXPERIMENT's trials, then "
               "samples --num-samples more; nothing old is trained again, and old and "
               "new trials are ranked and ensembled together (an old trial where its "
               "weights were kept). Unless given, the space, budget, data, model, "
               "searcher, scheduler, rung metric, seed, ensemble, --keep-checkpoints "
               "and MLflow store are EXPERIMENT's; another --budget (or model or data) "
               "tells its trials to the searcher as prior information only, never "
               "ranked with the new ones")


def add_resource_arguments(p: argparse.ArgumentParser) -> None:
    """What each trial runs on: CPUs, GPUs, threads, CUDA MPS, fused trainers."""
    p.add_argument("--max-concurrent", type=int,
                   help="trials at once (default: cluster CPUs / --cpus-per-trial)")
    p.add_argument("--cpus-per-trial", type=finite_float, default=1.0,
                   help="CPUs per trial (default 1)")
    p.add_argument("--gpus-per-trial", type=finite_float, default=None,
                   help="GPUs per trial, fractions allowed; default: where the Ray cluster "
                        "has GPUs, several trials share each (the share from the model's "
                        "size and the GPU's memory, printed); 0 forces the CPUs")
    p.add_argument("--trial-threads", default="grow", choices=["grow", "fixed"],
                   help="a CPU trial's torch threads: grow (default): its CPUs, plus its "
                        "share of its node's CPUs that no trial holds and no other process "
                        "keeps busy, checked every 2 s (a trial whose partners ended trains "
                        "on their cores too, and gives them back when a trial starts there); "
                        "fixed: its CPUs. GPU trials: fixed")
    add_gpu_sharing(p)


def build_parser() -> argparse.ArgumentParser:
    budgets = "; ".join(f"{b.name}: {b.description}" for b in BUDGETS.values())
    p = DriverArgumentParser(
        prog="python tune_driver.py",
        description="Hyperparameter search for multitask BERT (SST-5, QQP, STS-B) with Ray "
                    "Tune (default: ASHA + Optuna TPE), MLflow tracking and a top-k ensemble.")
    p.add_argument("--space", help="search space: a name from search_spaces/ or a YAML path")
    p.add_argument("--list-spaces", action="store_true", help="list the search spaces and exit")
    p.add_argument("--data-dir", default=os.environ.get("MTBERT_DATA", "../shared/data"),
                   help="folder with the CS 224N files (default ../shared/data or $MTBERT_DATA)")
    p.add_argument("--model", default=EMBEDDED_MODEL,
                   help=f"encoder: local folder or hub name (default {EMBEDDED_MODEL}, packaged)")
    p.add_argument("--budget", default="small", choices=list(BUDGETS), help=budgets)
    p.add_argument("--num-samples", type=int,
                   help="trials (default: the budget's); every one is sampled, under every "
                        "scheduler")
    p.add_argument("--points", metavar="FILE.json",
                   help="configurations the searcher proposes first, in order: a JSON list "
                        "of {key: value} for every key the space searches (Ray's "
                        "points_to_evaluate; bench.peers --same-draws gives every method "
                        "the same list)")
    add_resource_arguments(p)
    p.add_argument("--search-alg", default=None, choices=list(SEARCHERS),
                   help=searcher_help())
    p.add_argument("--scheduler", default=None, choices=list(SCHEDULERS),
                   help=scheduler_help())
    p.add_argument("--rung-metric", default=None, type=rung_metric_arg,
                   metavar="{" + ",".join(RUNG_METRICS) + "}[,...]",
                   help="what the scheduler compares trials on at its rungs (PBT / PB2: at "
                        "each interval): overall, the objective (val/overall); overall_soft "
                        "(val/overall_soft), each accuracy replaced by the mean probability "
                        "of the gold class -- smooth where early accuracies all sit on the "
                        "majority class; classes_soft (val/classes_soft), the mean of the SST "
                        "and QQP gold-class probabilities, leaving out the STS r that is "
                        "noise in the first steps; several joined by commas, one per rung "
                        "from the first, the last for the later rungs (asha-promote only: "
                        "classes_soft,overall_soft). The searcher and the selection always "
                        "use val/overall. Default: "
                        + "; ".join(f"{c.default_rung_metric} with --scheduler {s}"
                                    for s, c in SCHEDULERS.items()
                                    if c.default_rung_metric != DEFAULT_RUNG_METRIC)
                        + f"; {DEFAULT_RUNG_METRIC} with the others")
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
    p.add_argument("--keep-checkpoints", default="best", choices=KEEP_CHOICES,
                   help="what a finished search keeps: best (default): the weights of the "
                        "best trial and the ensemble members in EXPERIMENT/models (safetensors), "
                        "no training states; all: every trial's 2 best checkpoints and its "
                        "latest, as training states; none: no weights. An interrupted search "
                        "keeps everything --resume needs")
    p.add_argument("--max-failures", type=int, default=2,
                   help="retries of a trial whose worker died, from its last checkpoint")
    p.add_argument("--address",
                   help="join this running Ray cluster: auto (the one on this machine), "
                        "HOST:PORT (its GCS, e.g. HEAD:6379) or ray://HOST:10001")
    p.add_argument("--resume", action="store_true",
                   help="continue --experiment after a crash (Tuner.restore)")
    p.add_argument("--extend", metavar="EXPERIMENT", help=EXTEND_HELP)
    p.add_argument("--send-mlflow", action="store_true",
                   help="send the MLflow writes that search --experiment (in --storage-path) "
                        "left unsent, its server away when it ended (its summary names "
                        "them): exit 0 once all are in MLflow, 1 while the server still "
                        "does not take them")
    return p


def add_gpu_sharing(p: argparse.ArgumentParser) -> None:
    """--mps and --fuse: how trials share a GPU."""
    p.add_argument("--mps", default="auto", choices=list(MPS_CHOICES),
                   help="CUDA MPS for trials sharing a local GPU: auto starts the search's "
                        "own daemon where it helps; on: or fails; off (docs/search.md)")
    p.add_argument("--fuse", default="auto", choices=list(FUSE_CHOICES),
                   help="train the trials in one long-lived trainer per GPU, those of one "
                        "structure fused: on | off | auto (off until measured on a GPU) "
                        "(one Ray worker per trial; docs/search.md)")


def given_flags(argv: list[str] | None) -> frozenset[str]:
    """The options given on the command line (their ``dest``), told apart from defaults:
    ``--extend`` takes the earlier search's value for those left out."""
    probe = build_parser()
    for action in probe._actions:
        action.default = argparse.SUPPRESS
    return frozenset(vars(probe.parse_args(argv)))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)  # before the imports below: --help stays fast
    args.given = given_flags(argv)
    if args.send_mlflow:  # (MLflow only: no Ray, no torch)
        return send_mlflow(args)
    if args.list_spaces:  # (the YAML files only)
        spaces = list_spaces()
        if not spaces:
            print(f"error: --list-spaces: no search space found (no *.yaml in "
                  f"{default_spaces_dir()}; the package was installed without its spaces)",
                  file=sys.stderr)
            return 2
        for name, description in spaces:
            print(f"{name:<10} {description}")
        return 0
    from mtbert.tune.driver import run  # deferred: ray, mlflow, optuna, torch (~2 s)

    quiet_environment()
    settings = None
    try:
        settings = resolve_settings(args)
        return run(settings)
    except MtbertError as exc:
        print(f"error: {one_line(str(exc))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if settings is None or not settings.location.exp_dir.exists():
            print("error: interrupted before the search started; nothing was written",
                  file=sys.stderr)
            return 130
        # a second Ctrl-C while Tune was winding down after the first
        print(f"error: interrupted twice: stopped without a summary; Ray's last experiment "
              f"snapshot is kept. Continue with: {resume_command(settings)}", file=sys.stderr)
        return 130


#: the options ``--send-mlflow`` takes (the others belong to a search)
SEND_OPTIONS = frozenset({"send_mlflow", "experiment", "storage_path"})


def send_mlflow(args: argparse.Namespace) -> int:
    """``--send-mlflow``: the exit code of send_mlflow.send; bad input is one ``error:``
    line, exit 2."""
    extra = sorted(f"--{name.replace('_', '-')}" for name in args.given - SEND_OPTIONS)
    try:
        if extra:
            raise ConfigError(f"--send-mlflow takes --experiment and --storage-path only, "
                              f"not {', '.join(extra)}")
        return send(args.experiment, args.storage_path)
    except MtbertError as exc:
        print(f"error: {one_line(str(exc))}", file=sys.stderr)
        return 2


def one_line(message: str) -> str:
    """The CLI's contract is one ``error:`` line: fold a multi-line message (a YAML
    parser's, with its source excerpt and ``^`` marker) into one."""
    parts = [ln.strip() for ln in message.splitlines()]
    parts = [p for p in parts if p and set(p) != {"^"}]
    return "; ".join(p.rstrip(":") if i < len(parts) - 1 else p for i, p in enumerate(parts))
