"""Batching rules of the fused skeleton's own: where ``vmap``'s general rules dispatch
several ops for what one op does with the trial axis first.

**Linear layers.**  ``vmap``'s rule for ``F.linear`` with a batched weight (each trial
its own) goes through ``matmul``'s general batching: 12 dispatched ops a layer where a
solo ``addmm`` takes 4 (``tests/test_step_ops.py`` counts a step's).  The trials' linear
layer is one ``baddbmm``: y[n] = b[n] + x[n] W[n]ᵀ for each trial n, x's rows flattened to
``[N, rows, in]``; autograd records that op on the stacked tensors, so its backward is
``baddbmm``'s (two ``bmm`` and a sum).

**Embeddings** are one lookup in the trials' tables flattened to ``[N·V, H]``, each
trial's ids offset by n·V (a ``padding_idx`` row gets no gradient in any trial, as
``nn.Embedding``'s); **LayerNorm** normalises every trial's rows at once and applies each
trial's gains and shifts in one ``addcmul``.

Each rule is a ``torch.autograd.Function`` whose ``vmap`` staticmethod is the rule
(:class:`_VmapRule`); the skeleton's modules (:func:`use_trial_axis_layers`) call it under
``vmap`` and their plain op outside it.

**Functions without weights** (attention's two products and softmax, a per-row loss):
:func:`fold_trials` runs such a function once with the trial axis folded into its rows
(``[N, B, ...]`` → ``[N·B, ...]``), as a solo run calls it on a larger batch: the same
arithmetic row by row, in the solo step's ops.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch._C._functorch import is_batchedtensor

from mtbert.core.trial_streams import folded_trials


def _leading(t: torch.Tensor, dim: int | None, n: int) -> torch.Tensor:
    """``t`` with its trial axis first (a tensor not batched: the same for every trial)."""
    if dim is None:
        return t.expand(n, *t.shape)
    return t if dim == 0 else t.movedim(dim, 0)


class _VmapRule(torch.autograd.Function):
    """A function with a batching rule of its own (its ``vmap``), applied only under
    ``vmap``: autograd records the ops the rule runs on the stacked tensors, so the
    function's own backward is never taken (the modules below call the plain op outside
    ``vmap``)."""

    generate_vmap_rule = False

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError("a trial-axis function is differentiated through its vmap rule")


class TrialAxisLinear(_VmapRule):
    """``F.linear(x, weight, bias)``; under ``vmap``, one ``baddbmm`` for every trial."""

    @staticmethod
    def forward(x, weight, bias):
        return F.linear(x, weight, bias)

    @staticmethod
    def vmap(info, in_dims, x, weight, bias):
        n = info.batch_size
        x = _leading(x, in_dims[0], n)
        weight = _leading(weight, in_dims[1], n)
        rows = x.dim() == 3  # [N, rows, in] already: no reshape either way
        flat = x if rows else x.reshape(n, -1, x.shape[-1])
        if bias is None:
            out = torch.bmm(flat, weight.transpose(1, 2))
        else:
            bias = _leading(bias, in_dims[2], n)
            out = torch.baddbmm(bias.unsqueeze(1), flat, weight.transpose(1, 2))
        return (out if rows else out.view(*x.shape[:-1], weight.shape[1])), 0


class _TrialRows(torch.autograd.Function):
    """``F.embedding`` over N trials' tables flattened to ``[N·V, H]`` (the ids offset by
    n·V), whose gradient leaves each trial's ``padding_idx`` row at 0 as ``nn.Embedding``'s
    does."""

    @staticmethod
    def forward(ids, table, rows, padding_idx):
        return F.embedding(ids, table)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ids, table, ctx.rows, ctx.padding_idx = inputs
        ctx.save_for_backward(ids)
        ctx.num_weights = table.shape[0]

    @staticmethod
    def backward(ctx, grad):
        ids, = ctx.saved_tensors
        table = torch.ops.aten.embedding_dense_backward(grad, ids, ctx.num_weights, -1, False)
        table.view(-1, ctx.rows, table.shape[-1]).select(1, ctx.padding_idx).zero_()
        return None, table, None, None


_offsets: dict[tuple, torch.Tensor] = {}


def _trial_offsets(n: int, rows: int, like: torch.Tensor) -> torch.Tensor:
    """``[N, 1, ...]`` (``like``'s dims): n·rows, trial n's first row in the flattened
    tables; made once per shape and device."""
    key = (n, rows, like.device, like.dim())
    if key not in _offsets:
        _offsets[key] = (torch.arange(n, device=like.device) * rows).view(
            (n,) + (1,) * (like.dim() - 1))
    return _offsets[key]


class TrialAxisEmbedding(_VmapRule):
    """``F.embedding(ids, weight)``; under ``vmap`` one lookup in every trial's table."""

    @staticmethod
    def forward(ids, weight, padding_idx):
        return F.embedding(ids, weight, padding_idx)

    @staticmethod
    def vmap(info, in_dims, ids, weight, padding_idx):
        n = info.batch_size
        ids, weight = _leading(ids, in_dims[0], n), _leading(weight, in_dims[1], n)
        ids = ids + _trial_offsets(n, weight.shape[1], ids)
        table = weight.flatten(0, 1)
        if padding_idx is None:
            return F.embedding(ids, table), 0
        return _TrialRows.apply(ids, table, weight.shape[1], padding_idx), 0


class TrialAxisLayerNorm(_VmapRule):
    """``F.layer_norm`` over the last axis; under ``vmap`` the trials' rows normalised
    together and each scaled and shifted by its trial's gains: one ``addcmul``."""

    @staticmethod
    def forward(x, weight, bias, eps):
        return F.layer_norm(x, x.shape[-1:], weight, bias, eps)

    @staticmethod
    def vmap(info, in_dims, x, weight, bias, eps):
        n = info.batch_size
        x = _leading(x, in_dims[0], n)
        shape = (n,) + (1,) * (x.dim() - 2) + (x.shape[-1],)
        gains = _leading(weight, in_dims[1], n).view(shape)
        shifts = _leading(bias, in_dims[2], n).view(shape)
        return _Affine.apply(F.layer_norm(x, x.shape[-1:], eps=eps), gains, shifts), 0


class _Affine(torch.autograd.Function):
    """``normed · gains + shifts`` (one ``addcmul``; gains and shifts broadcast over the
    rows), its backward the three products autograd's ``addcmul`` takes five ops for."""

    @staticmethod
    def forward(normed, gains, shifts):
        return torch.addcmul(shifts, normed, gains)

    @staticmethod
    def setup_context(ctx, inputs, output):
        normed, gains, _ = inputs
        ctx.save_for_backward(normed, gains)

    @staticmethod
    def backward(ctx, grad):
        normed, gains = ctx.saved_tensors
        rows = tuple(range(1, grad.dim() - 1))  # the axes gains broadcast over
        if not rows:  # [N, H]: one row a trial
            return grad * gains, grad * normed, grad
        return (grad * gains, (grad * normed).sum(rows, keepdim=True),
                grad.sum(rows, keepdim=True))


class StackedLinear(nn.Linear):
    """An ``nn.Linear`` of the fused skeleton (its weights are the trials', given by
    ``functional_call`` under ``vmap``): :class:`TrialAxisLinear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not is_batchedtensor(self.weight):
            return super().forward(x)
        return TrialAxisLinear.apply(x, self.weight, self.bias)


class StackedEmbedding(nn.Embedding):
    """An ``nn.Embedding`` of the fused skeleton: :class:`TrialAxisEmbedding` under
    ``vmap``."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not is_batchedtensor(self.weight):
            return super().forward(ids)
        return TrialAxisEmbedding.apply(ids, self.weight, self.padding_idx)


class StackedLayerNorm(nn.LayerNorm):
    """An ``nn.LayerNorm`` (one axis, affine) of the fused skeleton:
    :class:`TrialAxisLayerNorm` under ``vmap``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not is_batchedtensor(self.weight):
            return super().forward(x)
        return TrialAxisLayerNorm.apply(x, self.weight, self.bias, self.eps)


def use_trial_axis_layers(model: nn.Module) -> None:
    """``model``'s (a fused skeleton's) ``nn.Linear``, ``nn.Embedding`` (no max norm) and
    one-axis affine ``nn.LayerNorm`` become their stacked classes above (the same
    parameters and names)."""
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = StackedLinear
        elif type(module) is nn.Embedding and module.max_norm is None and not module.sparse:
            module.__class__ = StackedEmbedding
        elif (type(module) is nn.LayerNorm and len(module.normalized_shape) == 1
              and module.weight is not None and module.bias is not None):
            module.__class__ = StackedLayerNorm


class _FoldTrials(_VmapRule):
    """``fn(*tensors)``; under ``vmap``, once over the trials' rows folded together."""

    @staticmethod
    def forward(fn, *tensors):
        return fn(*tensors)

    @staticmethod
    def vmap(info, in_dims, fn, *tensors):
        n = info.batch_size
        folded = [_leading(t, d, n).flatten(0, 1) for t, d in zip(tensors, in_dims[1:])]
        with folded_trials(n):  # a mask inside (dropout) is drawn as the vmapped one
            out = fn(*folded)
        return out.view(n, -1, *out.shape[1:]), 0


def fold_trials(fn, *tensors: torch.Tensor) -> torch.Tensor:
    """``fn(*tensors)`` for a ``fn`` without weights whose rows (the leading axis of every
    tensor and of its one output) are independent; under ``vmap`` one call over every
    trial's rows (module doc)."""
    if not any(is_batchedtensor(t) for t in tensors):
        return fn(*tensors)
    return _FoldTrials.apply(fn, *tensors)
