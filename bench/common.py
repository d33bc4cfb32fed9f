"""What the bench scripts share: the repository's root, where their results go, the data
folder and model arguments, and a device synchronize."""

from __future__ import annotations

import argparse
from pathlib import Path

from mtbert.core.config import EMBEDDED_MODEL

#: the repository's root
REPO = Path(__file__).resolve().parents[1]
#: where a bench writes unless told (``--out``): a folder of its own in here
RESULTS = REPO / "bench_results"
#: the CS 224N data folder beside the repository, as TrainConfig's ``data_dir`` has it
DATA_DIR = REPO.parent / "shared" / "data"


def add_data_arguments(parser: argparse.ArgumentParser, *, model: bool = True) -> None:
    """``--data-dir`` (default :data:`DATA_DIR`) and, with ``model``, ``--model`` (default
    the packaged MiniLM)."""
    parser.add_argument("--data-dir", default=str(DATA_DIR))
    if model:
        parser.add_argument("--model", default=EMBEDDED_MODEL)


def synchronize(device) -> None:
    """Wait for the kernels queued on a CUDA ``device`` (a clock read after it times
    them); nothing on a CPU."""
    if device.type == "cuda":
        import torch
        torch.cuda.synchronize(device)
