"""One shared BERT encoder with a head per task.

* SST: dropout + linear on the pooled sentence vector (``pooling``: cls | mean).
* QQP / STS, ``pair_encoding``:
  - ``cross``: one sequence ``[CLS] a [SEP] b [SEP]``; features = pooled vector.
    The sentence vectors u, v (for cosine heads/losses) are the masked means of
    segment A and segment B of that sequence.
  - ``siamese``: a and b encoded separately into u, v; features =
    [u, v, |u - v|, u * v, cos(u, v)] (report 002; Reimers & Gurevych 2019).
* ``shared_pair_layer``: QQP and STS share one hidden layer (linear + GELU) before
  their own output layers (report 002).
* STS score in 0..5: ``regression`` (linear output; with ``sts_loss=ce_bins`` six
  logits and the score is the expectation Σ_k k·softmax_k) or ``cosine``
  (score = 2.5·(cos(u, v) + 1)).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mtbert.config import TrainConfig
from mtbert.data import encoding_for
from mtbert.pretrained import load_encoder
from mtbert.tasks import TASKS

STS_BINS = 6  # rounded similarity scores 0, 1, ..., 5


@dataclass
class TaskOutput:
    """What a task head returns. ``logits``: SST [B, 5]; QQP [B]; STS [B, 6] (ce_bins) or None.
    ``score``: STS prediction in 0..5 (unclamped while training). ``u``, ``v``: pair vectors."""
    logits: torch.Tensor | None = None
    score: torch.Tensor | None = None
    u: torch.Tensor | None = None
    v: torch.Tensor | None = None


def masked_mean(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    weights = mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9)


class MultitaskModel(nn.Module):
    def __init__(self, encoder: nn.Module, cfg: TrainConfig):
        super().__init__()
        self.encoder = encoder
        self.pooling = cfg.pooling
        self.pair_encoding = cfg.pair_encoding
        self.sts_head = cfg.sts_head
        self.sts_bins = cfg.sts_loss == "ce_bins"
        hidden = encoder.config.hidden_size
        self.dropout = nn.Dropout(cfg.dropout)
        self.sst_out = nn.Linear(hidden, TASKS["sst"].num_classes)
        features = hidden if cfg.pair_encoding == "cross" else 4 * hidden + 1
        if cfg.shared_pair_layer:
            self.pair_shared: nn.Module = nn.Sequential(nn.Linear(features, hidden), nn.GELU(),
                                                        nn.Dropout(cfg.dropout))
            features = hidden
        else:
            self.pair_shared = nn.Identity()
        self.qqp_out = nn.Linear(features, 1)
        self.sts_out = (nn.Linear(features, STS_BINS if self.sts_bins else 1)
                        if cfg.sts_head == "regression" else None)

    @classmethod
    def from_config(cls, cfg: TrainConfig) -> "MultitaskModel":
        return cls(load_encoder(cfg.model, cfg.dropout), cfg)

    # ---------------------------------------------------------------- encoding
    def shared_parameters(self) -> list[nn.Parameter]:
        """Parameters every task's loss reaches (the encoder): what PCGrad projects."""
        return [p for p in self.encoder.parameters() if p.requires_grad]

    def embed_inputs(self, task: str, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Word embeddings of each input sequence of ``batch`` (SMART perturbs these).
        Keys: ``input`` (single / cross) or ``a`` and ``b`` (siamese)."""
        embed = self.encoder.get_input_embeddings()
        if encoding_for(task, self.pair_encoding) == "siamese":
            return {"a": embed(batch["input_ids_a"]), "b": embed(batch["input_ids_b"])}
        return {"input": embed(batch["input_ids"])}

    def _hidden(self, ids: torch.Tensor, mask: torch.Tensor, types: torch.Tensor | None,
                embeds: torch.Tensor | None) -> torch.Tensor:
        if getattr(self.encoder.config, "_attn_implementation", None) == "sdpa":
            # SDPA takes a 4-D boolean mask (True = attend) as it is; from a 2-D one
            # transformers first tests `mask.all()` on the host: a GPU sync every forward
            mask = mask[:, None, None, :].bool()
        if embeds is not None:
            out = self.encoder(inputs_embeds=embeds, attention_mask=mask, token_type_ids=types)
        else:
            out = self.encoder(input_ids=ids, attention_mask=mask, token_type_ids=types)
        return out.last_hidden_state

    def _pool(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return hidden[:, 0] if self.pooling == "cls" else masked_mean(hidden, mask)

    # ---------------------------------------------------------------- forward
    def forward(self, task: str, batch: dict[str, torch.Tensor],
                embeds: dict[str, torch.Tensor] | None = None) -> TaskOutput:
        embeds = embeds or {}
        encoding = encoding_for(task, self.pair_encoding)
        if encoding == "siamese":
            mask_a, mask_b = batch["attention_mask_a"], batch["attention_mask_b"]
            u = self._pool(self._hidden(batch["input_ids_a"], mask_a, None, embeds.get("a")), mask_a)
            v = self._pool(self._hidden(batch["input_ids_b"], mask_b, None, embeds.get("b")), mask_b)
            cos = F.cosine_similarity(u, v, dim=-1)
            features = torch.cat([u, v, (u - v).abs(), u * v, cos.unsqueeze(-1)], dim=-1)
        else:
            mask = batch["attention_mask"]
            types = batch.get("token_type_ids")
            hidden = self._hidden(batch["input_ids"], mask, types, embeds.get("input"))
            features = self._pool(hidden, mask)
            if encoding == "single":
                return TaskOutput(logits=self.sst_out(self.dropout(features)))
            seg_b = types.bool() & mask.bool()
            seg_a = ~types.bool() & mask.bool()
            u, v = masked_mean(hidden, seg_a), masked_mean(hidden, seg_b)
        pair = self.pair_shared(self.dropout(features))
        if task == "qqp":
            return TaskOutput(logits=self.qqp_out(pair).squeeze(-1), u=u, v=v)
        return self._sts(pair, u, v)

    def _sts(self, pair: torch.Tensor, u: torch.Tensor, v: torch.Tensor) -> TaskOutput:
        if self.sts_head == "cosine":
            score = 2.5 * (F.cosine_similarity(u, v, dim=-1) + 1.0)
            # ce_bins on a cosine score: Gaussian-kernel logits -(score - k)^2 over k = 0..5
            logits = (-(score.unsqueeze(-1) - torch.arange(STS_BINS, device=score.device)) ** 2
                      if self.sts_bins else None)
            return TaskOutput(logits=logits, score=score, u=u, v=v)
        out = self.sts_out(pair)
        if self.sts_bins:
            bins = torch.arange(STS_BINS, device=out.device, dtype=out.dtype)
            return TaskOutput(logits=out, score=(out.softmax(-1) * bins).sum(-1), u=u, v=v)
        return TaskOutput(score=out.squeeze(-1), u=u, v=v)

    @torch.no_grad()
    def predict(self, task: str, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """SST class, QQP probability of duplicate, STS score clamped to 0..5."""
        out = self(task, batch)
        if task == "sst":
            return out.logits.argmax(-1)
        if task == "qqp":
            return torch.sigmoid(out.logits.float())
        return out.score.float().clamp(0.0, 5.0)
