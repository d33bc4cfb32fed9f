"""What a reused worker saves by keeping its step graphs: ``python -m bench.trial_reuse``.

A Ray worker that Tune reuses trains trial after trial in one process.  This runs that
sequence in one process twice: *kept* (each trainer takes its predecessor's model, SMART
regulariser and task graphs, ``mtbert.run.graph_reuse``) and *fresh* (what was kept is dropped
before each trial, so each builds and captures its own).  The trials share a structure
(the trainer's defaults, SMART on every task, or ``--set``) and differ in seed, lr,
dropout and SMART's λ, ε, μ, as a search's trials do.  Per trial: the trainer's setup
seconds, the seconds of its first ``--first-steps`` schedule steps (where eager warm-up
steps and captures fall), the steady examples/s after them, and the graphs captured and
kept; then the mean setup + first steps per trial of each sequence, and what keeping saved.

    python -m bench.trial_reuse --device cuda --model <model> --trials 4

On a CPU the step runs eager and nothing is kept (both sequences build their own).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from bench.common import add_data_arguments, synchronize
from mtbert.run import graph_reuse
from mtbert.core.config import TrainConfig, parse_set_args
from mtbert.data import load_data, real_rows
from mtbert.step.trainer import Trainer

#: what varies from trial to trial (cycled): values of the ``smart`` space's ranges
VARIED = [dict(seed=0, lr=5e-5, dropout=0.1, smart_eps=1e-3, smart_mu=0.5, scale=1.0),
          dict(seed=1, lr=1e-4, dropout=0.2, smart_eps=1e-4, smart_mu=1.0, scale=0.5),
          dict(seed=2, lr=3e-5, dropout=0.05, smart_eps=1e-5, smart_mu=0.5, scale=2.0),
          dict(seed=3, lr=2e-4, dropout=0.3, smart_eps=5e-4, smart_mu=1.0, scale=5.0)]


def trial_config(base: dict, index: int) -> TrainConfig:
    varied = dict(VARIED[index % len(VARIED)])
    scale = varied.pop("scale")
    lambdas = {name: base.get(name, 1.0) * scale
               for name in ("smart_lambda_sst", "smart_lambda_qqp", "smart_lambda_sts")}
    return TrainConfig.from_dict({**base, **lambdas, **varied})


def run_trial(cfg: TrainConfig, data, first_steps: int, steps: int) -> dict:
    started = time.perf_counter()
    trainer = Trainer(cfg, data, tempfile.mkdtemp(prefix="mtbert-trial-reuse-"),
                      checkpoints=False)
    setup_s = time.perf_counter() - started
    plan = [g for epoch in range(1, cfg.epochs + 1) for g in trainer.epoch_plan(epoch)]
    plan = (plan * (1 + steps // max(len(plan), 1)))[:steps]
    marks, examples = [], 0
    for i, group in enumerate(plan):
        if i in (0, first_steps):
            synchronize(trainer.device)
            marks.append((time.perf_counter(), examples))
        batches = trainer.next_batches(group)
        examples += sum(real_rows(b) for b in batches.values())
        trainer.train_batches(batches)
    synchronize(trainer.device)
    marks.append((time.perf_counter(), examples))
    trainer.check_losses()
    trainer.leave_for_reuse()  # as fit() does where it ends
    stats = trainer.step_graphs.stats if trainer.step_graphs is not None else None
    (t0, _), (t1, e1), (t2, e2) = marks
    return {"setup_s": setup_s, "first_s": t1 - t0, "steady_ex_s": (e2 - e1) / (t2 - t1),
            "captured": stats.captured if stats else 0, "kept": stats.kept if stats else 0,
            "capture_s": stats.capture_s if stats else 0.0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_data_arguments(p)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--trials", type=int, default=4, help="trials in each sequence")
    p.add_argument("--first-steps", type=int, default=20,
                   help="schedule steps timed as a trial's start (warm-up and captures)")
    p.add_argument("--steps", type=int, default=120, help="schedule steps per trial")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a TrainConfig setting of every trial (repeatable)")
    args = p.parse_args()
    if not 0 < args.first_steps < args.steps:
        p.error("--first-steps must be above 0 and below --steps")
    base = dict(model=args.model, data_dir=args.data_dir, device=args.device,
                batch_size=args.batch_size, threads=args.threads, progress=False,
                eval_dev=False, **parse_set_args(args.set))
    data = load_data(trial_config(base, 0))
    rows = {}
    for sequence in ("fresh", "kept"):
        graph_reuse.forget()
        rows[sequence] = []
        for i in range(args.trials):
            if sequence == "fresh":
                graph_reuse.forget()
            rows[sequence].append(run_trial(trial_config(base, i), data, args.first_steps,
                                            args.steps))
    graph_reuse.forget()
    print(f"{args.trials} trials a sequence on {args.device}, batch {args.batch_size}, "
          f"{args.steps} schedule steps each{', ' + ' '.join(args.set) if args.set else ''}")
    print(f"{'sequence':>8} {'trial':>5} {'setup s':>8} {'first steps s':>13} {'steady ex/s':>11} "
          f"{'captured':>8} {'kept':>5} {'capture s':>9}")
    for sequence, trials in rows.items():
        for i, r in enumerate(trials):
            print(f"{sequence:>8} {i:>5} {r['setup_s']:8.2f} {r['first_s']:13.2f} "
                  f"{r['steady_ex_s']:11.1f} {r['captured']:8d} {r['kept']:5d} "
                  f"{r['capture_s']:9.2f}")
    start = {s: [r["setup_s"] + r["first_s"] for r in trials[1:] or trials]
             for s, trials in rows.items()}
    fresh, kept = statistics.mean(start["fresh"]), statistics.mean(start["kept"])
    print(f"setup + first {args.first_steps} steps per trial after the first: fresh "
          f"{fresh:.2f} s, kept {kept:.2f} s; keeping saved {fresh - kept:.2f} s a trial")
    if not any(r["kept"] for r in rows["kept"]):
        print("no task graph was kept (the step ran eager): the difference is run-to-run noise")


if __name__ == "__main__":
    main()
