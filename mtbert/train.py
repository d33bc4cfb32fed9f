"""``python -m mtbert.train --data-dir DIR --out DIR [--config FILE.yaml] [--set key=value ...]``

Trains one run and writes ``OUT/metrics.json``, ``OUT/config.yaml``,
``OUT/predictions/`` and ``OUT/checkpoint/``. Exit 0 on success, 2 on bad input
(one message on stderr naming the file or field); on bad input nothing is written.

``--fuse-seeds 0,1,2`` trains the configuration once per seed, the runs fused into one
model (:mod:`mtbert.loop.training_group`), each into ``OUT/seed-<seed>/`` with a solo run's files.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from mtbert.core.atomic import check_creatable
from mtbert.core.config import TrainConfig, cache_dir_source, default_cache_dir, parse_set_args
from mtbert.core.errors import MtbertError
from mtbert.core.pretrained import check_model


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m mtbert.train", description=__doc__.split("\n\n")[0])
    p.add_argument("--data-dir", required=True, help="folder with the CS 224N files")
    p.add_argument("--out", required=True, help="output folder (metrics, predictions, checkpoint)")
    p.add_argument("--config", help="YAML file of TrainConfig fields")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one TrainConfig field (repeatable)")
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint")
    p.add_argument("--fuse-seeds", metavar="S1,S2,...",
                   help="train one run per seed, fused into one model, into OUT/seed-S")
    return p


def parse_seeds(text: str) -> list[int]:
    """``--fuse-seeds``: distinct non-negative integers, comma-separated."""
    try:
        seeds = [int(part) for part in text.split(",")]
    except ValueError:
        raise MtbertError(f"--fuse-seeds {text!r}: expected integers separated by commas "
                          "(e.g. 0,1,2)") from None
    if len(set(seeds)) != len(seeds) or any(s < 0 for s in seeds):
        raise MtbertError(f"--fuse-seeds {text!r}: seeds must be distinct and >= 0")
    return seeds


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[%(name)s] %(message)s", stream=sys.stderr)
    out = Path(args.out)
    try:
        overrides = parse_set_args(args.overrides)
        overrides["data_dir"] = args.data_dir
        cfg = (TrainConfig.from_yaml(args.config, overrides) if args.config
               else TrainConfig.from_dict(overrides, source="--set"))
        if out.exists() and not out.is_dir():
            raise MtbertError(f"--out {out}: exists and is not a folder")
        check_creatable(out, f"--out {out}")
        check_creatable(default_cache_dir(cfg.cache_dir), cache_dir_source(cfg.cache_dir))
        seeds = parse_seeds(args.fuse_seeds) if args.fuse_seeds is not None else None
        if seeds is not None and args.resume:
            raise MtbertError("--fuse-seeds trains fresh runs; --resume resumes one run")
        resume_from = None
        if args.resume:
            resume_from = out / "checkpoint"
            if not (resume_from / "state.pt").is_file():  # training_state.STATE_FILE
                raise MtbertError(f"--resume: no checkpoint in {resume_from}")
        # deferred: torch, transformers (heavy imports after the cheap checks)
        from mtbert.data import load_data
        from mtbert.loop.trainer import Trainer
        from mtbert.run.training_state import check_checkpoint
        if resume_from is not None:
            check_checkpoint(resume_from)
        check_model(cfg.model)
        data = load_data(cfg)
        if seeds is not None:
            return _train_fused(cfg, data, out, seeds)
        trainer = Trainer(cfg, data, out, resume_from=resume_from)
    except MtbertError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(cfg.to_yaml(), encoding="utf-8")
    metrics = trainer.fit()
    summary = {k: metrics[k] for k in ("val/overall", "dev/overall") if k in metrics}
    print(" ".join(f"{k}={v:.4f}" for k, v in summary.items()))
    return 0


def _train_fused(cfg, data, out: Path, seeds: list[int]) -> int:
    from mtbert.loop.trainer import train_fused  # deferred: torch

    cfgs = [cfg.replace(seed=seed) for seed in seeds]
    outs = [out / f"seed-{seed}" for seed in seeds]
    for run_cfg, run_out in zip(cfgs, outs):
        run_out.mkdir(parents=True, exist_ok=True)
        (run_out / "config.yaml").write_text(run_cfg.to_yaml(), encoding="utf-8")
    results = train_fused(cfgs, data, outs, log=lambda line: print(line, file=sys.stderr))
    failed = 0
    for seed, result in zip(seeds, results):
        if isinstance(result, BaseException):
            failed += 1
            print(f"seed {seed}: {result}", file=sys.stderr)
            continue
        summary = {k: result[k] for k in ("val/overall", "dev/overall") if k in result}
        print(f"seed {seed}: " + " ".join(f"{k}={v:.4f}" for k, v in summary.items()))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
