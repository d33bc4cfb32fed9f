"""Batching rules of the fused skeleton's own: where ``vmap``'s general rules dispatch
several ops for what one op does with the trial axis first.

**Linear layers.**  ``vmap``'s rule for ``F.linear`` with a batched weight (each trial its own) goes through
``matmul``'s general batching: 12 dispatched ops a layer and 14 in its backward, where a
solo ``addmm`` takes 4 and 8 (``tests/test_step_ops.py`` counts them).  The trials' linear
layer is one ``baddbmm``: y[n] = b[n] + x[n] W[n]ᵀ for each trial n, x's rows flattened to
``[N, rows, in]``; autograd records that op on the stacked tensors, so its backward is
``baddbmm``'s (two ``bmm`` and a sum).  :class:`TrialAxisLinear` is the
``torch.autograd.Function`` that gives ``vmap`` this rule (its ``vmap`` staticmethod);
outside ``vmap`` it is ``F.linear``.

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


class TrialAxisLinear(torch.autograd.Function):
    """``F.linear(x, weight, bias)``; under ``vmap``, one ``baddbmm`` for every trial."""

    generate_vmap_rule = False

    @staticmethod
    def forward(x, weight, bias):
        return F.linear(x, weight, bias)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx, grad):
        x, weight, bias = ctx.saved_tensors
        rows = grad.reshape(-1, grad.shape[-1])
        return (grad @ weight, rows.t() @ x.reshape(-1, x.shape[-1]),
                None if bias is None else rows.sum(0))

    @staticmethod
    def vmap(info, in_dims, x, weight, bias):
        n = info.batch_size
        x = _leading(x, in_dims[0], n)
        weight = _leading(weight, in_dims[1], n)
        flat = x.reshape(n, -1, x.shape[-1])
        if bias is None:
            out = torch.bmm(flat, weight.transpose(1, 2))
        else:
            bias = _leading(bias, in_dims[2], n)
            out = torch.baddbmm(bias.unsqueeze(1), flat, weight.transpose(1, 2))
        return out.view(*x.shape[:-1], weight.shape[1]), 0


class StackedLinear(nn.Linear):
    """An ``nn.Linear`` of the fused skeleton (its weights are the trials', given by
    ``functional_call`` under ``vmap``): :class:`TrialAxisLinear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return TrialAxisLinear.apply(x, self.weight, self.bias)


def use_trial_axis_linears(model: nn.Module) -> None:
    """Every ``nn.Linear`` of ``model`` (a fused skeleton) becomes a :class:`StackedLinear`
    (the same parameters and names)."""
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = StackedLinear


class _FoldTrials(torch.autograd.Function):
    """``fn(*tensors)``; under ``vmap``, once over the trials' rows folded together."""

    generate_vmap_rule = False

    @staticmethod
    def forward(fn, *tensors):
        return fn(*tensors)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("fold_trials is differentiated through its vmap rule's ops only")

    @staticmethod
    def vmap(info, in_dims, fn, *tensors):
        n = info.batch_size
        folded = [_leading(t, d, n).flatten(0, 1) for t, d in zip(tensors, in_dims[1:])]
        with folded_trials(n):  # a draw inside (dropout) is drawn as the vmapped one
            out = fn(*folded)
        return out.view(n, -1, *out.shape[1:]), 0


def fold_trials(fn, *tensors: torch.Tensor) -> torch.Tensor:
    """``fn(*tensors)`` for a ``fn`` without weights whose rows (the leading axis of every
    tensor and of its one output) are independent; under ``vmap`` one call over every
    trial's rows (module doc)."""
    if not any(is_batchedtensor(t) for t in tensors):
        return fn(*tensors)
    return _FoldTrials.apply(fn, *tensors)
