"""A tiny random BERT saved with a model folder's tokenizer (its vocabulary, so token ids
are real): the tests' model, and the GPU evidence's dry-run model (``python -m
bench.gpu_evidence tiny-model`` builds it with this)."""

from __future__ import annotations

import shutil
from pathlib import Path

#: the tokenizer files a model folder carries (any one of the first two is enough)
TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "tokenizer_config.json",
                   "special_tokens_map.json")


def tiny_model(folder: Path, tokenizer_from: Path, hidden: int = 32, layers: int = 2,
               seed: int = 0) -> Path:
    """A random BERT (hidden ``hidden``, ``layers`` layers, 2 heads; weights from ``seed``)
    with the tokenizer of ``tokenizer_from`` (its vocabulary size), saved to ``folder``."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertModel

    vocab = len(AutoTokenizer.from_pretrained(str(tokenizer_from)))
    torch.manual_seed(seed)
    config = BertConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                        num_attention_heads=2, intermediate_size=2 * hidden,
                        max_position_embeddings=128)
    BertModel(config).save_pretrained(folder)
    for name in TOKENIZER_FILES:
        if (tokenizer_from / name).is_file():
            shutil.copy(tokenizer_from / name, folder / name)
    return folder
