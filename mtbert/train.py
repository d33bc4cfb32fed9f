"""``python -m mtbert.train --data-dir DIR --out DIR [--config FILE.yaml] [--set key=value ...]``

Trains one run and writes ``OUT/metrics.json``, ``OUT/config.yaml``,
``OUT/predictions/`` and ``OUT/checkpoint/``. Exit 0 on success, 2 on bad input
(one message on stderr naming the file or field); on bad input nothing is written.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from mtbert.atomic import check_creatable
from mtbert.config import TrainConfig, cache_dir_source, default_cache_dir, parse_set_args
from mtbert.errors import MtbertError
from mtbert.pretrained import check_model


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m mtbert.train", description=__doc__.split("\n\n")[0])
    p.add_argument("--data-dir", required=True, help="folder with the CS 224N files")
    p.add_argument("--out", required=True, help="output folder (metrics, predictions, checkpoint)")
    p.add_argument("--config", help="YAML file of TrainConfig fields")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one TrainConfig field (repeatable)")
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint")
    return p


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
        resume_from = None
        if args.resume:
            resume_from = out / "checkpoint"
            if not (resume_from / "state.pt").is_file():  # training_state.STATE_FILE
                raise MtbertError(f"--resume: no checkpoint in {resume_from}")
        # deferred: torch, transformers (heavy imports after the cheap checks)
        from mtbert.data import load_data
        from mtbert.trainer import Trainer
        from mtbert.training_state import check_checkpoint
        if resume_from is not None:
            check_checkpoint(resume_from)
        check_model(cfg.model)
        data = load_data(cfg)
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


if __name__ == "__main__":
    sys.exit(main())
