"""Attention of the fused encoder where ``vmap`` has no batching rule for SDPA's kernel.

Under ``vmap`` an op without a batching rule runs once per trial.  On CUDA the SDPA
kernels (flash, memory-efficient, cuDNN) have rules that fold the trial axis into the
attention batch, so the fused encoder keeps ``sdpa`` there.  The CPU's kernel
(``_scaled_dot_product_flash_attention_for_cpu``, torch 2.13) has none, and
transformers' ``eager`` attention cannot run under ``vmap``.  This is the same arithmetic
written with ops that do batch: ``softmax(q kᵀ · scale + mask) v`` (Vaswani et al. 2017,
eq. 1), whose two matmuls become one batched matmul over trials × rows × heads.

Measured on one CPU thread (MiniLM's shapes: 2 trials × 32 rows × 12 heads × 40 tokens
× 32, forward and backward of one layer's attention): SDPA once per trial 32.7 ms,
SDPA on the folded batch 26.9 ms, this 21.1 ms.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.masking_utils import sdpa_mask

from mtbert.model.model import BATCHED_ATTENTION  # the name it is registered under


def batched_math_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                           value: torch.Tensor, attention_mask: torch.Tensor | None,
                           scaling: float | None = None, dropout: float = 0.0, **_kwargs):
    """transformers' attention-function interface: ``query``/``key``/``value`` are
    ``[rows, heads, tokens, head size]``, ``attention_mask`` SDPA's (boolean, True =
    attend, or additive); returns ``([rows, tokens, heads, head size], None)``."""
    if scaling is None:
        scaling = query.size(-1) ** -0.5
    scores = torch.matmul(query, key.transpose(-1, -2)) * scaling
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attention_mask, torch.finfo(scores.dtype).min)
        else:
            scores = scores + attention_mask
    probs = F.dropout(scores.softmax(-1), p=dropout, training=module.training)
    return torch.matmul(probs, value).transpose(1, 2).contiguous(), None


AttentionInterface.register(BATCHED_ATTENTION, batched_math_attention)
AttentionMaskInterface.register(BATCHED_ATTENTION, sdpa_mask)


def use_batched_attention(model: nn.Module, device: torch.device) -> None:
    """Give ``model``'s encoder the attention that ``vmap`` batches on ``device``: this
    module's on the CPU, SDPA (whose CUDA kernels batch) elsewhere."""
    if device.type == "cpu":
        model.encoder.set_attn_implementation(BATCHED_ATTENTION)
