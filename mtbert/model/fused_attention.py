"""Attention of the fused encoder where ``vmap`` has no batching rule for SDPA's kernel.

Under ``vmap`` an op without a batching rule runs once per trial.  On CUDA the SDPA
kernels (flash, memory-efficient, cuDNN) have rules that fold the trial axis into the
attention batch, so the fused encoder keeps ``sdpa`` there.  The CPU's kernel
(``_scaled_dot_product_flash_attention_for_cpu``, torch 2.13) has none, and
transformers' ``eager`` attention cannot run under ``vmap``.  This is the same arithmetic
written with ops that do batch: ``softmax(q kᵀ · scale + mask) v`` (Vaswani et al. 2017,
eq. 1), run once over every trial's rows folded together
(:func:`mtbert.model.trial_axis.fold_trials`): each matmul one batched matmul over trials
× rows × heads, in the solo step's ops.

Measured on one CPU thread (MiniLM's shapes: 2 trials × 32 rows × 12 heads × 40 tokens
× 32, forward and backward of one layer's attention): SDPA once per trial 32.7 ms,
SDPA on the folded batch 26.9 ms, this 21.1 ms.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from mtbert.model.dropout_rate import DropoutRate, RateDropout
from mtbert.model.model import BATCHED_ATTENTION, STREAM_ATTENTION  # registered names
from mtbert.model.trial_axis import fold_trials


def batched_math_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                           value: torch.Tensor, attention_mask: torch.Tensor | None,
                           scaling: float | None = None, dropout: float = 0.0, **_kwargs):
    """transformers' attention-function interface: ``query``/``key``/``value`` are
    ``[rows, heads, tokens, head size]``, ``attention_mask`` SDPA's (boolean, True =
    attend, or additive); returns ``([rows, tokens, heads, head size], None)``."""
    if scaling is None:
        scaling = query.size(-1) ** -0.5

    def attend(query, key, value, mask=None):
        scores = torch.matmul(query, key.transpose(-1, -2)) * scaling
        if mask is not None:
            if mask.dtype == torch.bool:
                scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
            else:
                scores = scores + mask
        probs = scores.softmax(-1)
        if isinstance(module.dropout, RateDropout):  # the trials' masks
            probs = module.dropout(probs) if dropout > 0 else probs
        else:
            probs = F.dropout(probs, p=dropout, training=module.training)
        return torch.matmul(probs, value).transpose(1, 2).contiguous()

    # under vmap (the fused skeleton) once over every trial's rows; the probabilities'
    # dropout is then one mask over them all, each trial's rows with its own seed
    masks = () if attention_mask is None else (attention_mask,)
    return fold_trials(attend, query, key, value, *masks), None


def stream_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                     value: torch.Tensor, attention_mask: torch.Tensor | None, **kwargs):
    """One trial's attention: SDPA, or where probabilities are dropped (training) the
    batched math above, its dropout the trial's masks (SDPA draws its own;
    one CPU thread, MiniLM's shapes, forward and backward: 27.7 ms against SDPA's 30.6)."""
    if module.training and kwargs.get("dropout", 0.0) > 0:
        return batched_math_attention(module, query, key, value, attention_mask, **kwargs)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register(BATCHED_ATTENTION, batched_math_attention)
AttentionMaskInterface.register(BATCHED_ATTENTION, sdpa_mask)
AttentionInterface.register(STREAM_ATTENTION, stream_attention)
AttentionMaskInterface.register(STREAM_ATTENTION, sdpa_mask)


def attention_dropouts(model: nn.Module) -> list[nn.Module]:
    """The attention modules whose own dropout (of the probabilities) is an ``nn.Dropout``
    (a :class:`RateDropout` is one)."""
    return [m for m in model.modules() if type(m).__name__.endswith("Attention")
            and isinstance(getattr(m, "dropout", None), nn.Dropout)]


def draw_attention_from(model: nn.Module, masks, device: torch.device,
                        trials: int | None = None) -> None:
    """The attention-probability dropouts of ``model`` take their masks from ``masks`` (a
    :class:`~mtbert.core.trial_streams.MaskStream`: a trial's, or ``trials`` stacked ones'
    in the fused skeleton), at their rate.  A one-trial CPU model takes
    :func:`stream_attention` (SDPA's dropout would draw from torch's global generator)."""
    for module in attention_dropouts(model):
        p = float(module.dropout.p)
        rate = DropoutRate(p, device)  # one rate for every trial (the encoder's config)
        rate.masks = masks
        module.dropout = RateDropout(rate, number=p)
    if trials is None and device.type == "cpu":
        model.encoder.set_attn_implementation(STREAM_ATTENTION)


def use_batched_attention(model: nn.Module, device: torch.device) -> None:
    """Give ``model``'s encoder the attention that ``vmap`` batches on ``device``: this
    module's on the CPU, SDPA (whose CUDA kernels batch) elsewhere."""
    if device.type == "cpu":
        model.encoder.set_attn_implementation(BATCHED_ATTENTION)
