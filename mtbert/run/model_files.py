"""A trained model as files a user keeps: the encoder as a Hugging Face folder, the heads
beside it, the config that built them.

    FOLDER/encoder/          AutoModel.from_pretrained(FOLDER/encoder) + its tokenizer
    FOLDER/heads.safetensors everything outside the encoder (task heads, pair layer, maps)
    FOLDER/config.yaml       the TrainConfig it was trained with

:func:`export_model` writes it from a model in memory, :func:`export_checkpoint` from a
training checkpoint, whose weight files have this layout (:mod:`mtbert.run.training_state`):
a file copy; :func:`load_model` builds the trainer's :class:`~mtbert.model.model.MultitaskModel`
from it (what ``predict_split`` takes).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from mtbert.core.config import TrainConfig
from mtbert.core.errors import ConfigError
from mtbert.model.model import MultitaskModel
from mtbert.core.pretrained import load_tokenizer
from mtbert.run.training_state import (ENCODER_DIR, HEADS_FILE, WEIGHT_FILES, encoder_config_json,
                                   load_tensors, write_weights)

CONFIG_FILE = "config.yaml"


def export_model(model: MultitaskModel, cfg: TrainConfig, folder: str | Path) -> Path:
    """Write ``model`` (trained under ``cfg``) to ``folder`` as described above."""
    folder = Path(folder)
    write_weights(folder, model.state_dict(), encoder_config_json(model.encoder))
    return _add_tokenizer_and_config(folder, cfg)


def export_checkpoint(checkpoint_dir: str | Path, folder: str | Path) -> Path:
    """Copy the weights of a training checkpoint (what a Trainer writes at an evaluation) to
    ``folder`` as described above: its weight files as they are, no optimizer state."""
    checkpoint_dir, folder = Path(checkpoint_dir), Path(folder)
    cfg = TrainConfig.from_yaml(checkpoint_dir / CONFIG_FILE)
    for name in WEIGHT_FILES:
        if not (checkpoint_dir / name).is_file():
            load_tensors(checkpoint_dir / name)  # the DataError naming the missing file
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(checkpoint_dir / name, folder / name)
    return _add_tokenizer_and_config(folder, cfg)


def _add_tokenizer_and_config(folder: Path, cfg: TrainConfig) -> Path:
    load_tokenizer(cfg.model).save_pretrained(folder / ENCODER_DIR)
    (folder / CONFIG_FILE).write_text(cfg.to_yaml(), encoding="utf-8")
    return folder


def load_model(folder: str | Path, device: str = "cpu") -> tuple[TrainConfig, MultitaskModel]:
    """The config and model of an exported folder, in eval mode on ``device``."""
    folder = Path(folder)
    if not (folder / HEADS_FILE).is_file():
        raise ConfigError(f"{folder}: not an exported model (no {HEADS_FILE})")
    saved = TrainConfig.from_yaml(folder / CONFIG_FILE)
    cfg = TrainConfig.from_dict({**saved.to_dict(), "model": str(folder / ENCODER_DIR)},
                                source=str(folder / CONFIG_FILE))
    model = MultitaskModel.from_config(cfg)
    heads = load_tensors(folder / HEADS_FILE, expected="expected an exported model's heads")
    missing, unexpected = model.load_state_dict(heads, strict=False)
    if unexpected or any(not k.startswith("encoder.") for k in missing):
        raise ConfigError(f"{folder / HEADS_FILE}: does not fit the model of "
                          f"{folder / CONFIG_FILE} (missing {missing[:3]}, unexpected "
                          f"{unexpected[:3]})")
    return saved, model.to(torch.device(device)).eval()
