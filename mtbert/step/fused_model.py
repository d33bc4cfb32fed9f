"""N trials of one structure as one model: their weights stacked on a leading trial axis.

HFTA's idea (Wang et al., MLSys 2021): trials that share an architecture train as one
model whose layers hold a trial dimension, so each kernel serves all N trials.  Here the
fusion is ``torch.func``'s: the N trials' :class:`~mtbert.model.model.MultitaskModel` s, each
built exactly as its solo run builds it, are stacked into one ``[N, ...]`` tensor per
parameter and buffer, and one trial's forward and loss (:func:`mtbert.techniques.losses.batch_loss`,
the function the solo steps run) is ``vmap``-ed over the trial axis of the weights and of
the batch.  The skeleton's linear layers, embeddings and LayerNorms take the batching
rules of :mod:`mtbert.model.trial_axis` (one ``baddbmm`` a linear layer for all N, one
lookup in the stacked tables, each trial's gains in one ``addcmul``: about the solo
step's ops), and attention folds the trial axis into its batch: on CUDA SDPA's kernels
have batching rules that do so; on the CPU, whose SDPA kernel has none in torch 2.13,
the skeleton's attention is :mod:`mtbert.model.fused_attention`'s (the same arithmetic,
run once over every trial's rows).  One
``backward`` of the sum of the trials' losses gives each trial its own gradient in its
slice (the trials share no weight, so no gradient crosses between slices).

Per-trial values read as tensors with the trial axis: the dropout rate
(:class:`~mtbert.model.dropout_rate.RateDropout` with ``[N]`` rate buffers, the module a solo
run on CUDA drops with at its 0-d rate) here; the learning rates, weight decay, clipping
and loss weights in :mod:`mtbert.loop.training_group`, :mod:`mtbert.techniques.trial_adamw` and
:mod:`mtbert.techniques.losses`, SMART's in
:meth:`mtbert.techniques.smart.SmartRegulariser.stacked` (which runs its forwards through
:meth:`FusedModel.map`).

Dropout masks: each trial's own (:class:`mtbert.core.trial_streams.MaskStream`: its step
seed hashed with the draw's place and each element's coordinates), one hash over the
stacked tensor with each trial's seed broadcast, so ops do not grow with N and a trial's
masks are its solo run's, its batch padded to the group's shapes or not
(``tests/test_trial_streams.py``, ``tests/test_fused.py``).

Batches: the trials' batches of a task are padded to one shape (the longest row and the
most rows across trials; filler rows hold one attended pad token and weigh 0 in the loss,
``ROW_WEIGHTS``), so fusing changes padding only, never which rows a trial sees or when.
A trial with no batch of that task in the step gets a batch of filler rows only, and its
loss is multiplied by 0 (``present``).
"""

from __future__ import annotations

import copy

import numpy as np
import torch
from torch import nn
from torch.func import functional_call, vmap

from mtbert.core.trial_streams import MaskStream
from mtbert.data import ROW_WEIGHTS
from mtbert.data.batching import HostBatch
from mtbert.model.dropout_rate import (DropoutRate, RateDropout, governed_dropouts,
                                       scale_dtype)
from mtbert.model.fused_attention import draw_attention_from, use_batched_attention
from mtbert.model.trial_axis import use_trial_axis_layers
from mtbert.techniques.losses import batch_loss, penalised_parameters

#: the encoders the fused step is built and checked for (``config.model_type``)
FUSABLE_MODEL_TYPES = ("bert",)


class _EmbedInputs(nn.Module):
    """``model.embed_inputs`` as a module's forward (what ``functional_call`` calls)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, task: str, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return self.model.embed_inputs(task, batch)


class _Bound:
    """The skeleton called with one trial's weights (inside ``vmap``): ``model(task, batch)``
    as :func:`mtbert.techniques.losses.batch_loss` calls a model, and ``embed_inputs`` as SMART does."""

    def __init__(self, skeleton: nn.Module, tensors: dict[str, torch.Tensor]):
        self.skeleton, self.tensors = skeleton, tensors

    def __call__(self, task: str, batch: dict[str, torch.Tensor],
                 embeds: dict[str, torch.Tensor] | None = None):
        return functional_call(self.skeleton, self.tensors, (task, batch), {"embeds": embeds})

    def embed_inputs(self, task: str, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        tensors = {f"model.{k}": v for k, v in self.tensors.items()}
        return functional_call(_EmbedInputs(self.skeleton), tensors, (task, batch))


class FusedModel:
    """The stacked weights of N trials' models and their fused loss.

    ``params``: name -> a leaf ``[N, ...]`` tensor (requires grad; what the fused optimizer
    updates); ``buffers``: name -> ``[N, ...]`` (the dropout rates among them).  After
    :meth:`bind` each trial model's parameters are views of their slices, so the trial's
    own evaluation, checkpoints and predictions read the fused weights as they train."""

    def __init__(self, models: list[nn.Module], dropouts: list[float], built_rate: float,
                 masks: MaskStream | None = None):
        """``dropouts``: each trial's rate; ``built_rate``: the ``dropout`` the models were
        built with (which finds the dropouts the setting governs); ``masks``: the trials'
        mask stream (``[N]`` seeds, by slot); None: torch's global generator."""
        self.n = len(models)
        self.skeleton = copy.deepcopy(models[0])
        device = next(iter(models[0].parameters())).device
        use_batched_attention(self.skeleton, device)
        use_trial_axis_layers(self.skeleton)
        # the dropouts at each trial's rate: [N] rate buffers, a 0-d slice a trial under vmap
        rates = DropoutRate([float(p) for p in dropouts], device, scale_dtype(models[0]))
        rates.masks = self.masks = masks
        if masks is not None:  # each trial's attention-probability masks its own too
            draw_attention_from(self.skeleton, masks, device, trials=self.n)
        shared = dropouts[0] if len(set(dropouts)) == 1 else None
        for parent, name in governed_dropouts(self.skeleton, built_rate):
            setattr(parent, name, RateDropout(rates, number=shared))
        rate_buffers = {f"{name}.{key}" if name else key: getattr(rates, attr)
                        for name, module in self.skeleton.named_modules()
                        if isinstance(module, RateDropout)
                        for key, attr in (("rate", "p"), ("scale", "scale"))}
        self.skeleton.to("meta")
        self.skeleton.train()
        named = [dict(m.named_parameters()) for m in models]
        self.params = {k: torch.stack([p[k].detach() for p in named]).requires_grad_(True)
                       for k, _ in models[0].named_parameters()}
        buffers = [dict(m.named_buffers()) for m in models]
        self.buffers = {k: torch.stack([b[k] for b in buffers])
                        for k, _ in models[0].named_buffers() if k not in rate_buffers}
        self.buffers.update(rate_buffers)
        skeleton_params = dict(self.skeleton.named_parameters())
        penalised = {id(p) for p in penalised_parameters(self.skeleton)}
        #: the names :func:`mtbert.techniques.losses.penalised_parameters` picks (the L1/L2 penalty's)
        self.penalised = [k for k, p in skeleton_params.items() if id(p) in penalised]

    def bind(self, models: list[nn.Module]) -> None:
        """Make each trial model's parameters views of its slice of the stacked ones."""
        for n, model in enumerate(models):
            for name, p in model.named_parameters():
                p.data = self.params[name].detach()[n]

    def map(self, fn, batch: dict[str, torch.Tensor], *args,
            tensors: dict[str, torch.Tensor] | None = None):
        """``fn(model, trial_batch, *trial_args)`` of every trial at once, ``model`` the
        skeleton with the trial's weights: ``vmap``-ed over the trial axis of the weights
        (``tensors`` stand in for some of them, e.g. SMART's teacher), ``batch`` and ``args``."""
        stacked = {**self.params, **self.buffers, **(tensors or {})}

        def one(trial_tensors, trial_batch, *trial_args):
            return fn(_Bound(self.skeleton, trial_tensors), trial_batch, *trial_args)

        return vmap(one, randomness="different")(stacked, batch, *args)

    def task_losses(self, task: str, batch: dict[str, torch.Tensor], cfg) -> torch.Tensor:
        """Each trial's loss on its slice of the stacked ``batch`` (every tensor ``[N, ...]``):
        ``[N]``.  ``cfg``: any of the trials' (the loss settings are structure)."""
        return self.map(lambda model, b: batch_loss(model, task, b, cfg), batch)


def stack_batches(batches: list[dict[str, torch.Tensor] | None], pad_id: int
                  ) -> dict[str, torch.Tensor]:
    """One ``[N, rows, width]`` batch from N trials' host batches of one task (None: the
    trial has no batch of it this step).  Every tensor is padded to the most rows and each
    2-D one to its longest width across trials: ids with ``pad_id``, masks and token types
    with 0; a filler row holds one attended pad token, label 0 and row weight 0.  Packed in
    NumPy on the host (as a collate packs rows): no torch op a trial, one tensor a key."""
    real = [b for b in batches if b is not None]
    n, rows = len(batches), max(len(b["labels"]) for b in real)
    keys = [k for k in real[0] if k != ROW_WEIGHTS]
    out: dict[str, torch.Tensor] = {}
    for k in keys:
        like = _array(real[0], k)
        width = max(b[k].shape[1] for b in real) if like.ndim == 2 else None
        shape = (n, rows) if width is None else (n, rows, width)
        fill = pad_id if k.startswith("input_ids") else 0
        packed = np.full(shape, fill, dtype=like.dtype)
        for i, b in enumerate(batches):
            have = 0 if b is None else len(b["labels"])
            if b is not None:
                value = _array(b, k)
                packed[(i, slice(0, have)) + tuple(slice(0, s) for s in value.shape[1:])] = value
            if k.startswith("attention_mask"):
                packed[i, have:, 0] = 1  # filler rows: one attended token (finite attention)
        out[k] = torch.from_numpy(packed)
    weights = np.zeros((n, rows), dtype=np.float32)
    for i, b in enumerate(batches):
        if b is not None:
            have = len(b["labels"])
            weights[i, :have] = _array(b, ROW_WEIGHTS) if ROW_WEIGHTS in b else 1.0
    out[ROW_WEIGHTS] = torch.from_numpy(weights)
    return out


def _array(batch: dict[str, torch.Tensor], key: str) -> np.ndarray:
    """A host batch's ``key`` as NumPy (:meth:`mtbert.data.batching.HostBatch.array`; a
    plain dict's tensor: its ``numpy()``)."""
    return batch.array(key) if isinstance(batch, HostBatch) else batch[key].numpy()
