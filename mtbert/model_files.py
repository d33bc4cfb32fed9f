"""A trained model as files a user keeps: the encoder as a Hugging Face folder, the heads
beside it, the config that built them.

    FOLDER/encoder/          AutoModel.from_pretrained(FOLDER/encoder) + its tokenizer
    FOLDER/heads.safetensors everything outside the encoder (task heads, pair layer, maps)
    FOLDER/config.yaml       the TrainConfig it was trained with

:func:`export_model` writes it from a training checkpoint; :func:`load_model` builds the
trainer's :class:`~mtbert.model.MultitaskModel` from it (what ``predict_split`` takes).
"""

from __future__ import annotations

from pathlib import Path

import torch

from mtbert.config import TrainConfig
from mtbert.errors import ConfigError
from mtbert.model import MultitaskModel

ENCODER_DIR = "encoder"
HEADS_FILE = "heads.safetensors"
CONFIG_FILE = "config.yaml"


def export_model(model: MultitaskModel, cfg: TrainConfig, folder: str | Path) -> Path:
    """Write ``model`` (trained under ``cfg``) to ``folder`` as described above."""
    from safetensors.torch import save_file

    from mtbert.pretrained import load_tokenizer
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model.encoder.save_pretrained(folder / ENCODER_DIR)  # safetensors
    load_tokenizer(cfg.model).save_pretrained(folder / ENCODER_DIR)
    heads = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()
             if not k.startswith("encoder.")}
    save_file(heads, str(folder / HEADS_FILE))
    (folder / CONFIG_FILE).write_text(cfg.to_yaml(), encoding="utf-8")
    return folder


def load_model(folder: str | Path, device: str = "cpu") -> tuple[TrainConfig, MultitaskModel]:
    """The config and model of an exported folder, in eval mode on ``device``."""
    from safetensors.torch import load_file
    folder = Path(folder)
    if not (folder / HEADS_FILE).is_file():
        raise ConfigError(f"{folder}: not an exported model (no {HEADS_FILE})")
    saved = TrainConfig.from_yaml(folder / CONFIG_FILE)
    cfg = TrainConfig.from_dict({**saved.to_dict(), "model": str(folder / ENCODER_DIR)},
                                source=str(folder / CONFIG_FILE))
    model = MultitaskModel.from_config(cfg)
    missing, unexpected = model.load_state_dict(load_file(str(folder / HEADS_FILE)),
                                                strict=False)
    if unexpected or any(not k.startswith("encoder.") for k in missing):
        raise ConfigError(f"{folder / HEADS_FILE}: does not fit the model of "
                          f"{folder / CONFIG_FILE} (missing {missing[:3]}, unexpected "
                          f"{unexpected[:3]})")
    return saved, model.to(torch.device(device)).eval()
