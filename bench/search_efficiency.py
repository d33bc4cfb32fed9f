"""Search efficiency over seeds: report 004's hand grid vs random vs the automatic searches.

    python -m bench.search_efficiency [--seeds 0,1,2] [--methods grid,asha_tpe,...]
        [--full-examples 2000] [--train-rows 1000] [--eval-rows 300] [--workers 2]
        [--out bench_results/search_efficiency] [--docs docs]

Same data (``--train-rows`` training and ``--eval-rows`` validation / dev rows per task),
model (the packaged MiniLM), budget unit (training examples seen; one full-budget
training = ``--full-examples``), LR schedule (warm-up-stable-decay, the warm-up
``--warmup-examples`` long, as the driver's budgets train), trainable (mtbert's Ray Tune
trainable) and workers (``--workers`` trials at once, one CPU each) for every search
over report 004's two knobs -- hidden dropout and the SMART weight lambda_s on SST:

* ``grid``   -- report 004's way: dropout 0.1 ... 0.5 x lambda_s 1, 5 = 10 configurations,
  each trained to the full budget and scored once at the end;
* ``random`` -- 10 random configurations in the same ranges, no early stopping;
* the searcher/scheduler pairs of ``mtbert.tune.search.choices`` (``METHODS`` below): ASHA with
  Optuna TPE (independent or multivariate), BOHB, PBT, PB2 -- ``--trials`` configurations,
  ASHA/BOHB rungs at full/9, full/3 and full (``asha_tpe_late``: full/3 and full);
  ``asha_tpe_indep_steps`` samples the same ranges in steps (``SPACES``);
  ``asha_tpe_indep_soft`` decides at the rungs on val/overall_soft (the driver's
  ``--rung-metric overall_soft``) rather than val/overall, ``*_cls`` on val/classes_soft;
  ``asha_promote_*`` is the driver's ``--scheduler asha-promote`` (trials pause at the
  rungs and are promoted).

Each (method, seed) run is kept in ``OUT/runs.json``; later calls add to it (the
settings must match), so methods and seeds can be measured in several sittings. From
all runs the bench computes, per method over the seeds (mean +- sd): the best
validation overall; the compute -- training examples, trial-seconds -- to first reach
the same seed's grid best, as a share of the grid's whole compute (target <= 1/3); the
whole search's wall time over one full training at the same workers (the median grid
trial, target <= 2); the dev overall of the trial the method selects (its best
checkpoint), against the grid's selected trial's dev overall and its standard error.
It prints the table and writes ``DOCS/search_efficiency.json`` and ``.png``.

This file is the command line and ``runs.json``; its siblings hold the rest, one job each:
``search_methods.py`` (the methods and what their runs share), ``search_runs.py`` (a run
on Ray, from the driver's builders), ``search_stats.py`` (the figures and the ranking),
``search_grid.py`` (what decides the grid), ``search_report.py`` (the table, JSON,
Markdown and plot).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench.common import REPO, RESULTS, add_data_arguments
from bench.search_methods import METHODS, SAME, SAME_DEFAULTS
from bench.search_report import write_figures
from bench.search_runs import run_all


def build_parser(description: str = __doc__.split("\n\n")[0]) -> argparse.ArgumentParser:
    """The bench's settings (bench/rung_signal.py adds its own to them)."""
    p = argparse.ArgumentParser(description=description)
    add_data_arguments(p)
    p.add_argument("--full-examples", type=int, default=2000,
                   help="one full-budget training, in training examples")
    p.add_argument("--train-rows", type=int, default=1000, help="training rows per task")
    p.add_argument("--eval-rows", type=int, default=300, help="validation/dev rows per task")
    p.add_argument("--trials", type=int, default=9,
                   help="configurations per automatic search (9, 3, 1 over the 3 rungs)")
    p.add_argument("--population", type=int, default=4, help="PBT's population")
    p.add_argument("--lr", type=float, default=1.5e-4,
                   help="fixed for every trial (the small search's best lr: at the default "
                        "5e-5 a 2,000-example budget barely moves MiniLM off chance)")
    p.add_argument("--batch-size", type=int, default=16, help="fixed for every trial")
    p.add_argument("--warmup-examples", type=int, default=96,
                   help="LR warm-up (wsd schedule), before ASHA's first rung (full / 9)")
    p.add_argument("--workers", type=int, default=2, help="trials at once (1 CPU each)")
    p.add_argument("--gpus-per-trial", type=float, default=0.0,
                   help="each trial's share of a GPU (0 = train on the CPU); on one GPU, "
                        "e.g. --gpus-per-trial 0.125 --workers 8, and the driver's full "
                        "budget: --full-examples 75846 --train-rows 0 --eval-rows 0")
    p.add_argument("--methods", default=",".join(k for k, m in METHODS.items()
                                                 if not m.superseded))
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--out", default=str(RESULTS / "search_efficiency"),
                   help="keeps runs.json (every run so far) and Ray's trial folders")
    p.add_argument("--docs", default=str(REPO / "docs"),
                   help="where search_efficiency.json and .png go")
    p.add_argument("--keep-trials", action="store_true",
                   help="keep each run's Ray trial folders (checkpoints) under OUT; by "
                        "default they are removed once the run's figures are in runs.json "
                        "(a failed run's are kept)")
    p.add_argument("--no-dashboard", action="store_true",
                   help="start Ray without its dashboard (the bench needs none; Ray refuses "
                        "to start one where the dashboard's packages, ray[default], are "
                        "missing, e.g. a GPU machine given only the wheels a search needs)")
    p.add_argument("--report-only", action="store_true",
                   help="run nothing: the figures of the runs kept in OUT/runs.json")
    p.add_argument("--carry-figures", metavar="JSON",
                   help="a search_efficiency.json written earlier (e.g. docs/'s): the figures "
                        "of its methods that OUT/runs.json lacks (runs of an earlier machine, "
                        "not kept) are written and ranked beside the runs', marked carried")
    return p


def parse_args(argv, p: argparse.ArgumentParser | None = None):
    p = p or build_parser()
    args = p.parse_args(argv)
    args.method_list = [m.strip() for m in args.methods.split(",") if m.strip()]
    current = [k for k, m in METHODS.items() if not m.superseded]
    unknown = sorted(set(args.method_list) - set(current))
    if unknown or not args.method_list:
        p.error(f"--methods: unknown or superseded (kept as measured, not run again) "
                f"{unknown}; choose from {', '.join(current)}")
    try:
        args.seed_list = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        p.error(f"--seeds {args.seeds}: expected integers separated by commas")
    if not 0 <= args.gpus_per_trial <= 1:
        p.error(f"--gpus-per-trial {args.gpus_per_trial}: expected a share of one GPU, 0 to 1")
    if args.gpus_per_trial and not args.report_only:
        import torch
        if not torch.cuda.is_available():
            p.error(f"--gpus-per-trial {args.gpus_per_trial}: this machine has no CUDA GPU "
                    "(torch.cuda.is_available() is False); use 0 to train on the CPU")
    if args.full_examples < 9 or args.warmup_examples >= args.full_examples // 9:
        p.error("--warmup-examples must end before ASHA's first rung (--full-examples / 9)")
    return p, args


def load_runs(path: Path, args, p) -> dict[str, dict[int, dict]]:
    if not path.is_file():
        return {}
    kept = json.loads(path.read_text(encoding="utf-8"))
    differ = [k for k in SAME if kept["args"].get(k, SAME_DEFAULTS.get(k)) != getattr(args, k)]
    if differ:
        p.error(f"{path}: its runs used other settings ({', '.join(differ)}); "
                "pass another --out")
    return {m: {int(s): r for s, r in by_seed.items()} for m, by_seed in kept["runs"].items()}


def open_runs(args, p) -> tuple[Path, Path, Path, dict[str, dict[int, dict]]]:
    """A bench's output folders and the runs kept so far: (OUT, DOCS, OUT/runs.json, runs)
    (the quiet environment of the driver set first)."""
    from mtbert.tune.infra import cluster

    cluster.quiet_environment()
    out, docs = Path(args.out).resolve(), Path(args.docs).resolve()
    out.mkdir(parents=True, exist_ok=True)
    runs_file = out / "runs.json"
    return out, docs, runs_file, load_runs(runs_file, args, p)


def main(argv: list[str] | None = None) -> int:
    p, args = parse_args(argv)
    out, docs, runs_file, runs = open_runs(args, p)
    if not args.report_only:
        runs = run_all(args, runs, runs_file, out,
                       "python -m bench.search_efficiency " + " ".join(argv or sys.argv[1:]))
    write_figures(args, runs, docs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
