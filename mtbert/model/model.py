"""One shared BERT encoder with a head per task.

* SST: dropout + linear on the pooled sentence vector (``pooling``: cls | mean).
* QQP / STS, ``pair_encoding``:
  - ``cross``: one sequence ``[CLS] a [SEP] b [SEP]``; features = pooled vector.
    The sentence vectors u, v (for cosine heads/losses) are the masked means of
    segment A and segment B of that sequence.
  - ``siamese``: a and b encoded separately into u, v; features =
    [u, v, |u - v|, u * v, cos(u, v)] (report 002; Reimers & Gurevych 2019).
    With ``pair_head_init=cosine`` the QQP logit is a·cos(u, v) + b + W·features with
    W zero-initialised and (a, b) a logistic fit on training rows (the trainer calls
    :func:`mtbert.model.cosine_init.fit_qqp_cosine`), so QQP starts at the cosine-threshold
    classifier of the pre-trained encoder instead of a random one.
* ``shared_pair_layer``: QQP and STS share one hidden layer (linear + GELU) before
  their own output layers (report 002).
* STS score in 0..5: ``regression`` (linear output; with ``sts_loss=ce_bins`` six
  logits and the score is the expectation Σ_k k·softmax_k) or ``cosine``: score =
  s·cos(u, v) + t with ``sts_cosine_map``: ``affine`` (s, t learned from (5, 0)),
  ``scaled`` (5, 0: cos = label / 5, Reimers & Gurevych 2019) or ``report002``
  (2.5, 2.5: label 0 asks cos = -1, which a sentence encoder gives almost no pair).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mtbert.core.config import TrainConfig
from mtbert.data import encoding_for
from mtbert.core.pretrained import load_encoder
from mtbert.core.tasks import TASKS

#: the name :mod:`mtbert.model.fused_attention` registers the fused encoder's CPU attention under
BATCHED_ATTENTION = "mtbert_batched_math"
#: attention implementations handed the 4-D boolean mask as it is (the fused encoder's
#: on the CPU takes SDPA's)
#: a trial's own attention: SDPA, or in training with dropout the batched math whose
#: probability dropout draws from the trial's stream (:mod:`mtbert.model.fused_attention`)
STREAM_ATTENTION = "mtbert_stream"
FOUR_D_MASK = ("sdpa", BATCHED_ATTENTION, STREAM_ATTENTION)
STS_BINS = 6  # rounded similarity scores 0, 1, ..., 5
#: sts_cosine_map -> (s, t) of score = s·cos + t at the start
COSINE_MAPS = {"affine": (5.0, 0.0), "scaled": (5.0, 0.0), "report002": (2.5, 2.5)}


@dataclass
class TaskOutput:
    """What a task head returns. ``logits``: SST [B, 5]; QQP [B]; STS [B, 6] (ce_bins) or None.
    ``score``: STS prediction in 0..5 (unclamped while training). ``u``, ``v``: pair vectors.
    ``cos_score``: s·cos(u, v) + t, the cosine mapped to 0..5 (what ``cosine_mse`` fits)."""
    logits: torch.Tensor | None = None
    score: torch.Tensor | None = None
    u: torch.Tensor | None = None
    v: torch.Tensor | None = None
    cos_score: torch.Tensor | None = None


def masked_mean(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    weights = mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9)


def _scalar(value: float, learned: bool) -> torch.Tensor:
    """A 0-d parameter (learned) or buffer (fixed; kept in the state dict all the same)."""
    t = torch.tensor(float(value))
    return nn.Parameter(t) if learned else nn.Buffer(t)


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
        # STS cosine map score = s·cos + t: learned with sts_cosine_map=affine where a loss
        # reaches it (cosine head or cosine_mse), a fixed buffer otherwise
        scale, shift = COSINE_MAPS[cfg.sts_cosine_map]
        learned = cfg.sts_cosine_map == "affine" and (cfg.sts_head == "cosine"
                                                      or cfg.sts_loss == "cosine_mse")
        self.sts_cos_scale = _scalar(scale, learned)
        self.sts_cos_shift = _scalar(shift, learned)
        # siamese QQP: logit = a·cos + b + qqp_out(features), qqp_out starting at 0
        self.qqp_cosine_start = cfg.pair_encoding == "siamese" and cfg.pair_head_init == "cosine"
        if self.qqp_cosine_start:
            nn.init.zeros_(self.qqp_out.weight)
            nn.init.zeros_(self.qqp_out.bias)
            self.qqp_cos_scale = nn.Parameter(torch.tensor(1.0))  # set by fit_qqp_cosine
            self.qqp_cos_shift = nn.Parameter(torch.tensor(0.0))

    @classmethod
    def from_config(cls, cfg: TrainConfig) -> "MultitaskModel":
        return cls(load_encoder(cfg.model, cfg.dropout), cfg)

    def complete_legacy_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A state dict saved before the cosine maps existed (2026-11) lacks them: fill in
        the values that reproduce its predictions exactly (STS 2.5·(cos + 1); no QQP cosine
        term)."""
        legacy = {"sts_cos_scale": 2.5, "sts_cos_shift": 2.5,
                  "qqp_cos_scale": 0.0, "qqp_cos_shift": 0.0}
        own = self.state_dict()
        return {**{k: torch.tensor(v) for k, v in legacy.items()
                   if k in own and k not in state}, **state}

    # ---------------------------------------------------------------- encoding
    def head_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """(name, parameter) of everything outside the encoder: the task heads, the
        shared pair layer and the cosine maps (the ``head_lr_multiplier`` group)."""
        return [(n, p) for n, p in self.named_parameters()
                if p.requires_grad and not n.startswith("encoder.")]

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
        if getattr(self.encoder.config, "_attn_implementation", None) in FOUR_D_MASK:
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
            vectors = self.dropout(torch.cat([u, v, (u - v).abs(), u * v], dim=-1))
            # the cosine feature is not dropped: the cosine start depends on it
            pair = self.pair_shared(torch.cat([vectors, cos.unsqueeze(-1)], dim=-1))
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
            cos = F.cosine_similarity(u, v, dim=-1)
            pair = self.pair_shared(self.dropout(features))
        if task == "qqp":
            logits = self.qqp_out(pair).squeeze(-1)
            if self.qqp_cosine_start and encoding == "siamese":
                logits = logits + self.qqp_cos_scale * cos + self.qqp_cos_shift
            return TaskOutput(logits=logits, u=u, v=v)
        return self._sts(pair, u, v, cos)

    def cosine_score(self, cos: torch.Tensor) -> torch.Tensor:
        """The STS cosine map: score = s·cos + t (``sts_cosine_map``)."""
        return self.sts_cos_scale * cos + self.sts_cos_shift

    def _sts(self, pair: torch.Tensor, u: torch.Tensor, v: torch.Tensor,
             cos: torch.Tensor) -> TaskOutput:
        cos_score = self.cosine_score(cos)
        if self.sts_head == "cosine":
            # ce_bins on a cosine score: Gaussian-kernel logits -(score - k)^2 over k = 0..5
            logits = (-(cos_score.unsqueeze(-1) - torch.arange(STS_BINS, device=cos.device)) ** 2
                      if self.sts_bins else None)
            return TaskOutput(logits=logits, score=cos_score, u=u, v=v, cos_score=cos_score)
        out = self.sts_out(pair)
        if self.sts_bins:
            bins = torch.arange(STS_BINS, device=out.device, dtype=out.dtype)
            return TaskOutput(logits=out, score=(out.softmax(-1) * bins).sum(-1), u=u, v=v,
                              cos_score=cos_score)
        return TaskOutput(score=out.squeeze(-1), u=u, v=v, cos_score=cos_score)

    @torch.no_grad()
    def predict(self, task: str, batch: dict[str, torch.Tensor],
                sst_probabilities: bool = False) -> torch.Tensor:
        """SST class (its 5 class probabilities with ``sst_probabilities``), QQP probability
        of duplicate, STS score clamped to 0..5."""
        out = self(task, batch)
        if task == "sst":
            return out.logits.float().softmax(-1) if sst_probabilities else out.logits.argmax(-1)
        if task == "qqp":
            return torch.sigmoid(out.logits.float())
        return out.score.float().clamp(0.0, 5.0)
