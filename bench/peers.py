"""The search side by side with what a user would pick instead: ``tune_driver.py`` against
``transformers.Trainer.hyperparameter_search`` (backends ray and optuna) and a plain Ray
Tune script, the same search problem for each, over seeds (docs/bench/peers.md says how
each runs and what is compared).  Each (method, seed) runs in a process of its own;
runs are kept in ``OUT/runs.json`` and written with the figures to ``--json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import REPO, RESULTS, CpuMeter, add_data_arguments, shared_options
from bench.peer_problem import (OBJECTIVE, canonical_space, config_key, load_problem,
                                rows_digest, same_draws, score)

METHODS = {
    "project": "tune_driver.py, its defaults",
    "plain_ray": "a plain Ray Tune script: function trainable, ASHAScheduler, OptunaSearch",
    "hf_ray": "Trainer.hyperparameter_search(backend='ray'): ASHAScheduler, OptunaSearch",
    "hf_optuna": "Trainer.hyperparameter_search(backend='optuna'): TPE, "
                 "SuccessiveHalvingPruner",
}
#: the settings every run kept in one runs.json shares
SAME = ("space", "budget", "num_samples", "cpus_per_trial", "gpus_per_trial",
        "max_concurrent", "data_dir", "model", "same_draws")
#: the per-run figures compared in pairs over the seeds, and whether more is better
PAIRED = {"wall_s": False, "ex_per_s": True, "cpu_s": False, "val": True, "dev": True}


class BenchArgumentParser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    p = BenchArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--space", default="smart")
    p.add_argument("--budget", default="small")
    p.add_argument("--num-samples", type=int, help="trials per search (default: the budget's)")
    p.add_argument("--cpus-per-trial", type=float, default=1.0)
    p.add_argument("--gpus-per-trial", type=float, default=0.0,
                   help="each trial's share of a GPU (0: train on the CPU)")
    p.add_argument("--max-concurrent", type=int, default=2, help="trials at once")
    add_data_arguments(p)
    p.add_argument("--out", default=str(RESULTS / "peers"),
                   help="keeps runs.json and each run's folder (removed once recorded, "
                        "unless --keep-runs)")
    p.add_argument("--json", default=str(REPO / "docs" / "bench" / "peers_cpu.json"),
                   help="where the runs and figures are written")
    p.add_argument("--keep-runs", action="store_true",
                   help="keep each run's folder (Ray's trials, checkpoints) under OUT")
    p.add_argument("--report-only", action="store_true",
                   help="run nothing: write the figures of the runs in OUT/runs.json")
    p.add_argument("--same-draws", action="store_true",
                   help="draw the configurations once per seed (a seeded random sampler) "
                        "and give every method that list, in order")
    p.add_argument("--dry-run", action="store_true",
                   help="run nothing: write to --json the problem each seed's methods get "
                        "(space, budget, the rows' digests, --same-draws' draws)")
    p.add_argument("--one", choices=list(METHODS), help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    return p


def parse_args(argv: list[str] | None):
    p = build_parser()
    args = p.parse_args(argv)
    shared_options(p, args, METHODS)
    if args.num_samples is not None and args.num_samples < 1:
        p.error(f"--num-samples {args.num_samples}: must be >= 1")
    if args.max_concurrent < 1 or args.cpus_per_trial <= 0:
        p.error("--max-concurrent and --cpus-per-trial must be positive")
    return p, args


def problem_argv(args, seed: int, storage: Path, experiment: str) -> list[str]:
    """``tune_driver.py``'s arguments for the project's search (its defaults: scheduler,
    searcher, rung metric, ensemble) with this bench's settings and ``seed``."""
    argv = ["--space", args.space, "--budget", args.budget, "--seed", str(seed),
            "--data-dir", args.data_dir, "--model", args.model, "--storage-path", str(storage),
            "--experiment", experiment, "--cpus-per-trial", f"{args.cpus_per_trial:g}",
            "--gpus-per-trial", f"{args.gpus_per_trial:g}",
            "--max-concurrent", str(args.max_concurrent)]
    return argv + (["--num-samples", str(args.num_samples)] if args.num_samples else [])


# ---------------------------------------------------------------------- one run
def run_method(method: str, argv: list[str], out: Path, cpus_per_trial: float = 1.0,
               gpus_per_trial: float = 0.0, max_concurrent: int = 2,
               draws: bool = False) -> dict[str, Any]:
    """Run ``method`` on the problem of ``tune_driver.py argv`` in this process (inside a
    Ray already started, if one is), writing under ``out``; then score its selected trial
    on val and dev.  ``draws``: every trial is one of the seed's ``same_draws``, in order.
    Returns the run's record (no wall or CPU figures: the caller's)."""
    out.mkdir(parents=True, exist_ok=True)
    problem = load_problem(argv)
    points = same_draws(problem.space, problem.num_samples, problem.seed) if draws else None
    if method == "project":
        if points:
            given = out / "points.json"
            given.write_text(json.dumps(points, indent=1), encoding="utf-8")
            argv = argv + ["--points", str(given)]
        record = _run_project(argv)
    elif method == "plain_ray":
        from bench.peer_ray import run_plain_ray
        record = run_plain_ray(problem, out, cpus_per_trial, gpus_per_trial, max_concurrent,
                               points=points)
    elif method == "hf_ray":
        from bench.peer_hf import run_hf_ray
        record = run_hf_ray(problem, out, cpus_per_trial, gpus_per_trial, max_concurrent,
                            points=points)
    else:
        from bench.peer_hf import run_hf_optuna
        record = run_hf_optuna(problem, out, threads=max(1, int(cpus_per_trial
                                                                * max_concurrent)),
                               points=points)
    if points:
        record["draws"] = points
    selected = record["selected"]
    cfg, model = _selected_model(problem, selected)
    for split in ("val", "dev"):
        metrics = score(model, cfg, problem.data, split)
        selected[split] = metrics[f"{split}/overall"]
        selected[f"{split}_se"] = metrics[f"{split}/overall_se"]
    end = problem.budget.max_examples
    record.update(method=method, seed=problem.seed, problem_rows=rows_digest(problem.data),
                  examples=sum(t["examples"] for t in record["trials"]),
                  trials_at_end=sum(t["examples"] >= end for t in record["trials"]),
                  num_trials=len(record["trials"]), max_examples=end,
                  eval_points=problem.eval_points(), rungs=problem.budget.rungs())
    return record


def _run_project(argv: list[str]) -> dict[str, Any]:
    """``tune_driver.py argv`` (its command-line entry, in this process) and what its
    summary.json records."""
    from mtbert.core.config import TrainConfig
    from mtbert.data import load_data
    from mtbert.tune.cli import main

    rc = main(argv)
    if rc != 0:
        raise RuntimeError(f"tune_driver.py exited {rc}")
    storage = Path(argv[argv.index("--storage-path") + 1])
    summary = json.loads((storage / argv[argv.index("--experiment") + 1]
                          / "summary.json").read_text(encoding="utf-8"))
    best = summary["best_trial"]
    # the rows the project's trials trained on: what the selected trial's recorded config loads
    rows = rows_digest(load_data(TrainConfig.from_dict(best["config"], source="summary.json")))
    trials = [{"trial_id": t["trial_id"], "state": t["status"],
               "config": t["searched"], "examples": int(t.get("examples_seen") or 0),
               "examples_trained_own_count": t.get("examples_trained"), "rows": rows}
              for t in summary["trials"]]
    return {"trials": trials, "space": canonical_space(summary["space"]["params"]),
            "examples_trained_own_count": summary.get("examples_trained"),
            "selected": {"trial_id": best["trial_id"], "config": best["searched"],
                         # --keep-checkpoints best (the default) keeps its weights there
                         "checkpoint": str(Path(summary["experiment_dir"]) / "models"
                                           / best["trial_id"]), "loader": "exported",
                         "summary_val": best["val"].get("val/overall"),
                         "summary_dev": best["dev"].get("dev/overall")}}


def _selected_model(problem, selected: dict):
    """The selected trial's model: a project checkpoint folder, an exported model (the
    project's kept models) or an HF checkpoint folder."""
    if selected["loader"] == "hf":
        from bench.peer_hf import load_hf_checkpoint
        return load_hf_checkpoint(problem, selected["config"], selected["checkpoint"])
    if selected["loader"] == "exported":
        from mtbert.run.model_files import load_model
        return load_model(selected["checkpoint"])
    from mtbert.run.inference import load_checkpoint_model
    return load_checkpoint_model(selected["checkpoint"])


# ---------------------------------------------------------------------- the bench
def _one(args) -> int:
    """``--one METHOD``: one run, its record written to ``--result``."""
    from mtbert.tune.infra import cluster

    cluster.quiet_environment()
    seed = args.seed_list[0]
    folder = Path(args.out) / f"{args.one}-seed{seed}"
    shutil.rmtree(folder, ignore_errors=True)
    argv = problem_argv(args, seed, folder / "project", f"peers-seed{seed}")
    record = run_method(args.one, argv, folder, args.cpus_per_trial, args.gpus_per_trial,
                        args.max_concurrent, draws=args.same_draws)
    Path(args.result).write_text(json.dumps(record, indent=1, default=str), encoding="utf-8")
    return 0


def measure(method: str, seed: int, args, out: Path) -> dict[str, Any]:
    """Run ``method`` for ``seed`` in a process of its own; its record with wall time, the
    CPU seconds of its process tree and the machine's load."""
    result = out / f"{method}-seed{seed}.json"
    result.unlink(missing_ok=True)
    log = out / f"{method}-seed{seed}.log"
    cmd = [sys.executable, "-m", "bench.peers", "--one", method, "--seeds", str(seed),
           "--result", str(result)] + [f"--{k.replace('_', '-')}={getattr(args, k)}"
                                       for k in SAME if getattr(args, k) is not None
                                       and k != "same_draws"]
    cmd += ["--same-draws"] if args.same_draws else []
    cmd += ["--out", str(out)]
    load_before = os.getloadavg()
    started = time.time()
    with open(log, "w", encoding="utf-8") as fh:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=fh, stderr=subprocess.STDOUT)
        meter = CpuMeter(proc.pid)
        rc = proc.wait()
    cpu_s, cores = meter.stop(), os.cpu_count() or 1
    figures = {"wall_s": meter.wall_s, "cpu_s": cpu_s,
               "cpu_busy": cpu_s / (meter.wall_s * cores), "cores": cores,
               "machine_busy": meter.machine_busy, "load_before": load_before,
               "load_after": os.getloadavg(), "started_at": started, "rc": rc,
               "log": str(log)}
    if rc != 0 or not result.is_file():
        return {"method": method, "seed": seed, "failed": True, **figures}
    record = json.loads(result.read_text(encoding="utf-8"))
    if not args.keep_runs:
        shutil.rmtree(out / f"{method}-seed{seed}", ignore_errors=True)
    return {**record, **figures}


def run_figures(r: dict) -> dict[str, Any]:
    """One run's figures: examples trained, wall, examples per second over the wall, CPU
    seconds of its process tree, trials to the end, val and dev of its pick (± se)."""
    s = r["selected"]
    return {"examples": r["examples"], "wall_s": r["wall_s"],
            "ex_per_s": r["examples"] / r["wall_s"], "cpu_s": r["cpu_s"],
            "trials_at_end": r["trials_at_end"], "num_trials": r["num_trials"],
            "val": s["val"], "val_se": s["val_se"], "dev": s["dev"], "dev_se": s["dev_se"]}


def tried_the_draws(r: dict) -> bool | None:
    """Whether a run's trials tried exactly its seed's draws (None: no draws given): the
    configurations their models trained with where a trial records them (the HF peers'
    ``trained_config``), else the ones their searcher gave."""
    if not r.get("draws"):
        return None
    tried = sorted(config_key(t.get("trained_config") or t["config"])
                   for t in r["trials"] if t.get("config"))
    return tried == sorted(config_key(d) for d in r["draws"])


def figures(runs: dict[str, dict[int, dict]]) -> dict[str, Any]:
    """Per seed: each method's figures (:func:`run_figures`); this project's wall over
    each peer's and its examples per second over each peer's; whether its dev is within
    one standard error of the best peer's; whether every method saw the same rows and
    space, and (``--same-draws``) tried the same configurations."""
    seeds = sorted({s for by_seed in runs.values() for s in by_seed})
    per_seed = {}
    for seed in seeds:
        done = {m: r[seed] for m, r in runs.items() if seed in r and not r[seed].get("failed")}
        row: dict[str, Any] = {"methods": {m: run_figures(r) for m, r in done.items()}}
        project = done.get("project")
        peers = {m: r for m, r in done.items() if m != "project"}
        if project and peers:
            row["wall_ratio"] = {m: project["wall_s"] / r["wall_s"] for m, r in peers.items()}
            mine = row["methods"]["project"]["ex_per_s"]
            row["ex_per_s_ratio"] = {m: mine / row["methods"][m]["ex_per_s"] for m in peers}
            best = max(peers, key=lambda m: peers[m]["selected"]["dev"])
            gap = project["selected"]["dev"] - peers[best]["selected"]["dev"]
            row["best_peer_dev"] = best
            row["dev_minus_best_peer"] = gap
            row["dev_within_one_se"] = gap >= -project["selected"]["dev_se"]
        digests = {json.dumps(t["rows"], sort_keys=True) for r in done.values()
                   for t in r["trials"] if t.get("rows")}
        digests |= {json.dumps(r["problem_rows"], sort_keys=True) for r in done.values()}
        row["same_rows"] = len(digests) == 1
        row["same_space"] = len({json.dumps(r["space"], sort_keys=True)
                                 for r in done.values()}) == 1
        tried = {m: tried_the_draws(r) for m, r in done.items()}
        if any(v is not None for v in tried.values()):
            draws = {json.dumps(r.get("draws"), sort_keys=True) for r in done.values()}
            row["same_draws"] = len(draws) == 1 and all(tried.values())
            row["tried_the_draws"] = tried
        per_seed[str(seed)] = row
    return per_seed


def paired(runs: dict[str, dict[int, dict]], level: float = 0.95) -> dict[str, Any]:
    """Each peer against the project over the seeds both ran: for each figure of
    :data:`PAIRED`, the differences project - peer (one per seed), their mean, its ``level``
    t interval (scipy; None with fewer than 2 seeds) and the project's wins, ties and
    losses.  A tie in val or dev is a difference within one standard error of the
    difference (the two picks' standard errors in quadrature); wall, CPU seconds and
    examples per second have none per run, so they tie only when equal."""
    import numpy as np
    from scipy import stats

    project = {s: r for s, r in runs.get("project", {}).items() if not r.get("failed")}
    out: dict[str, Any] = {}
    for peer, by_seed in runs.items():
        if peer == "project":
            continue
        seeds = sorted(s for s, r in by_seed.items() if s in project and not r.get("failed"))
        if not seeds:
            continue
        mine = [run_figures(project[s]) for s in seeds]
        theirs = [run_figures(by_seed[s]) for s in seeds]
        row: dict[str, Any] = {"seeds": seeds}
        for key, more_is_better in PAIRED.items():
            diffs = np.array([a[key] - b[key] for a, b in zip(mine, theirs)])
            margins = [float(np.hypot(a[f"{key}_se"], b[f"{key}_se"])) if f"{key}_se" in a
                       else 0.0 for a, b in zip(mine, theirs)]
            wins = sum((d > m) if more_is_better else (d < -m) for d, m in zip(diffs, margins))
            losses = sum((d < -m) if more_is_better else (d > m)
                         for d, m in zip(diffs, margins))
            interval = None
            if len(diffs) > 1:
                sem = stats.sem(diffs)
                interval = ([float(diffs.mean())] * 2 if sem == 0 else
                            [float(x) for x in stats.t.interval(level, len(diffs) - 1,
                                                                loc=diffs.mean(), scale=sem)])
            row[key] = {"diffs": [float(d) for d in diffs], "mean": float(diffs.mean()),
                        f"ci{round(level * 100)}": interval, "win": int(wins),
                        "tie": len(diffs) - int(wins) - int(losses), "loss": int(losses)}
        out[peer] = row
    return out


def paired_table(pairs: dict[str, Any]) -> str:
    """:func:`paired` as the page's table: one row per peer and figure."""
    lines = ["| peer | figure | project - peer, per seed | mean | 95 % interval | "
             "project wins / ties / losses |", "| --- | --- | --- | --- | --- | --- |"]
    for peer, row in pairs.items():
        for key in PAIRED:
            f = row[key]
            fmt = "{:+.4f}" if key in ("val", "dev") else "{:+.1f}"
            ci = f["ci95"]
            lines.append(f"| `{peer}` | {key} | {', '.join(fmt.format(d) for d in f['diffs'])} "
                         f"| {fmt.format(f['mean'])} | "
                         f"{'-' if ci is None else f'{fmt.format(ci[0])} to {fmt.format(ci[1])}'}"
                         f" | {f['win']} / {f['tie']} / {f['loss']} |")
    return "\n".join(lines)


def dry_run(args) -> int:
    """``--dry-run``: each seed's problem, as :func:`run_method` gives it to every method."""
    problems = {}
    for seed in args.seed_list:
        problem = load_problem(problem_argv(args, seed, Path(args.out) / "dry-run", "dry-run"))
        problems[str(seed)] = {
            "space": canonical_space(problem.space.params), "rows": rows_digest(problem.data),
            "num_trials": problem.num_samples, "max_examples": problem.budget.max_examples,
            "eval_points": problem.eval_points(), "rungs": problem.budget.rungs(),
            "draws": same_draws(problem.space, problem.num_samples, seed)
            if args.same_draws else None}
    Path(args.json).write_text(json.dumps(problems, indent=1) + "\n", encoding="utf-8")
    print(f"[peers] the problems of seeds {args.seed_list} in {args.json}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p, args = parse_args(argv)
    if args.one:
        return _one(args)
    if args.dry_run:
        return dry_run(args)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    runs_file = out / "runs.json"
    kept = json.loads(runs_file.read_text(encoding="utf-8")) if runs_file.is_file() else None
    settings = {k: getattr(args, k) for k in SAME}
    if kept and kept["settings"] != settings:
        p.error(f"{runs_file}: its runs used other settings; pass another --out")
    runs = {m: {int(s): r for s, r in by_seed.items()}
            for m, by_seed in (kept or {}).get("runs", {}).items()}
    if not args.report_only:
        _check_problem(args, p, out)
        command = "python -m bench.peers " + " ".join(argv if argv is not None else sys.argv[1:])
        for seed in args.seed_list:
            for method in args.method_list:
                record = measure(method, seed, args, out)
                record["command"] = command
                runs.setdefault(method, {})[seed] = record
                print("[peers]", table_row(method, seed, record, runs.get("project", {}).get(seed)),
                      f"(log {record['log']})" if record.get("failed") else "", flush=True)
                _write(runs_file, args, settings, runs)
    _write(runs_file, args, settings, runs)
    print(markdown_table(runs))
    pairs = paired(runs)
    if pairs:
        print(paired_table(pairs))
    return 0


def _check_problem(args, p, out: Path) -> None:
    """Bad input (a space, a budget, the data, the model) -> one ``error:`` line, exit 2,
    before any run starts."""
    import contextlib
    import io

    from mtbert.core.errors import MtbertError
    from mtbert.tune.cli import build_parser as driver_parser
    from mtbert.tune.settings import resolve_settings

    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):  # the driver's parser says its own error:
            driver = driver_parser().parse_args(problem_argv(args, args.seed_list[0],
                                                             out / "check", "check"))
        driver.given = frozenset()
        resolve_settings(driver)
    except MtbertError as exc:
        p.error(" ".join(str(exc).split()))
    except SystemExit:
        lines = [ln for ln in said.getvalue().splitlines() if ln.startswith("error: ")]
        p.error(lines[0][len("error: "):] if lines else "the driver refused these settings")


def table_row(method: str, seed: int, r: dict, project: dict | None = None) -> str:
    """One run as a row of :func:`markdown_table` (``project``: its seed's project run)."""
    if r.get("failed"):
        return f"| `{method}` | {seed} | failed (rc {r['rc']}) | | | | | | | | |"
    s, wall = r["selected"], r["wall_s"]
    ratio = (f"{project['wall_s'] / wall:.2f}" if project and method != "project"
             and not project.get("failed") else "")
    return (f"| `{method}` | {seed} | {int(wall // 60)} min {int(wall % 60)} s | {ratio} | "
            f"{r['examples']:,} | {r['examples'] / wall:.1f} | {r['cpu_s']:,.0f} | "
            f"{r['cpu_busy']:.2f} ({r['machine_busy']:.2f}) | "
            f"{s['val']:.4f} ± {s['val_se']:.4f} | {s['dev']:.4f} ± {s['dev_se']:.4f} | "
            f"{r['trials_at_end']} of {r['num_trials']} |")


def markdown_table(runs: dict[str, dict[int, dict]]) -> str:
    """The runs as the page's table: one row per method and seed."""
    return "\n".join(["| method | seed | wall | project wall / this wall | examples | ex/s over "
                      "the wall | CPU s | CPU busy (machine) | val overall | dev overall | "
                      "trials to the end |", "| --- " * 11 + "|"] + [
        table_row(method, seed, runs[method][seed], runs.get("project", {}).get(seed))
        for seed in sorted({s for by_seed in runs.values() for s in by_seed})
        for method in METHODS if seed in runs.get(method, {})])


def portable(text: str, args) -> str:
    """``text`` with this machine's folders as ``<out>``, ``<data>`` and ``<repo>``."""
    for folder, name in ((args.out, "<out>"), (args.data_dir, "<data>"), (REPO, "<repo>")):
        text = text.replace(str(Path(folder).resolve()), name)
    return text


def _write(runs_file: Path, args, settings: dict, runs: dict) -> None:
    doc = {"settings": settings, "objective": OBJECTIVE, "methods": METHODS,
           "runs": {m: {str(s): r for s, r in sorted(by.items())} for m, by in runs.items()},
           "figures": figures(runs), "paired": paired(runs)}
    runs_file.write_text(json.dumps(doc, indent=1, default=str), encoding="utf-8")
    target = Path(args.json)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(portable(json.dumps(doc, indent=1, default=str), args) + "\n",
                      encoding="utf-8")


if __name__ == "__main__":
    sys.exit(main())
