"""The fused skeleton's own batching rules (mtbert/model/trial_axis.py) compute what
``vmap``'s general rules compute: each trial's layer on its own slice, values and
gradients (float64), the embedding's padding row untrained as ``nn.Embedding`` leaves it;
a function folded over the trials' rows, and a dropout draw inside it, as under ``vmap``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, vmap

from mtbert.core.trial_streams import MaskStream, keep_mask, keep_threshold
from mtbert.model.trial_axis import fold_trials, use_trial_axis_layers

N = 3


def _per_trial_and_stacked(module: nn.Module, inputs: torch.Tensor):
    """(outputs, grads) of N copies of ``module`` with perturbed weights, once looped one
    trial at a time with ``module``'s own class and once stacked under ``vmap`` with the
    trial-axis class."""
    torch.manual_seed(0)
    weights = {k: torch.stack([p.detach() + 0.1 * torch.randn_like(p) for _ in range(N)])
               for k, p in module.named_parameters()}
    out_grad = None
    looped, looped_grads = [], {k: [] for k in weights}
    for n in range(N):
        own = {k: w[n].clone().requires_grad_() for k, w in weights.items()}
        y = functional_call(module, own, (inputs[n],))
        if out_grad is None:
            out_grad = torch.randn(N, *y.shape, dtype=y.dtype)
        y.backward(out_grad[n])
        looped.append(y.detach())
        for k, p in own.items():
            looped_grads[k].append(p.grad)
    stacked = {k: w.clone().requires_grad_() for k, w in weights.items()}
    skeleton = type(module).__new__(type(module))
    skeleton.__dict__.update(module.__dict__)
    use_trial_axis_layers(nn.ModuleList([skeleton]))
    assert type(skeleton) is not type(module)
    y = vmap(lambda w, x: functional_call(skeleton, w, (x,)))(stacked, inputs)
    y.backward(out_grad)
    return ((torch.stack(looped), {k: torch.stack(g) for k, g in looped_grads.items()}),
            (y.detach(), {k: p.grad for k, p in stacked.items()}))


def _assert_same(pair):
    (looped, looped_grads), (stacked, stacked_grads) = pair
    assert torch.allclose(stacked, looped, rtol=0, atol=1e-12)
    for k in looped_grads:
        assert torch.allclose(stacked_grads[k], looped_grads[k], rtol=0, atol=1e-12), k


@pytest.mark.parametrize("shape", [(5, 7, 4), (5, 4), (4,)])
@pytest.mark.parametrize("bias", [True, False])
def test_a_stacked_linear_layer_is_each_trials_linear_layer(shape, bias):
    layer = nn.Linear(4, 6, bias=bias).double()
    _assert_same(_per_trial_and_stacked(layer, torch.randn(N, *shape, dtype=torch.float64)))


@pytest.mark.parametrize("padding_idx", [None, 0])
def test_a_stacked_embedding_is_each_trials_embedding_its_padding_row_untrained(padding_idx):
    table = nn.Embedding(9, 4, padding_idx=padding_idx).double()
    ids = torch.randint(0, 9, (N, 5, 6))
    ids[:, :, -2:] = 0  # padding in every trial
    pair = _per_trial_and_stacked(table, ids)
    _assert_same(pair)
    grads = pair[1][1]["weight"]
    if padding_idx is not None:
        assert torch.count_nonzero(grads[:, 0]) == 0
    else:
        assert torch.count_nonzero(grads[:, 0]) > 0


@pytest.mark.parametrize("shape", [(5, 7, 4), (4,)])
def test_a_stacked_layer_norm_is_each_trials_layer_norm(shape):
    norm = nn.LayerNorm(4).double()
    _assert_same(_per_trial_and_stacked(norm, torch.randn(N, *shape, dtype=torch.float64)))


def _attention(q, k, v):
    return torch.matmul((q @ k.transpose(-1, -2)).softmax(-1), v)


def test_a_function_folded_over_the_trials_rows_is_its_vmap():
    torch.manual_seed(1)
    q, k, v = (torch.randn(N, 2, 3, 5, 4, dtype=torch.float64, requires_grad=True)
               for _ in range(3))
    grad = torch.randn(N, 2, 3, 5, 4, dtype=torch.float64)
    plain = vmap(_attention)(q, k, v)
    expected = torch.autograd.grad(plain, (q, k, v), grad)
    folded = vmap(lambda *t: fold_trials(_attention, *t))(q, k, v)
    got = torch.autograd.grad(folded, (q, k, v), grad)
    assert torch.allclose(folded, plain, rtol=0, atol=1e-12)
    for a, b in zip(got, expected):
        assert torch.allclose(a, b, rtol=0, atol=1e-12)
    # outside vmap: the function itself
    assert torch.equal(fold_trials(_attention, q[0], k[0], v[0]), _attention(q[0], k[0], v[0]))


@pytest.mark.parametrize("seeds", [(10, 10, 10), (10, 11, 12)])
def test_a_mask_inside_a_folded_function_is_the_vmapped_mask(seeds):
    """A dropout mask drawn inside a folded function (N trials' rows in one axis) is the
    one drawn over ``[N, ...]`` under ``vmap``: each trial's rows its own seed's."""
    x = torch.zeros(N, 2, 5)
    threshold = keep_threshold(0.5)

    def drawn(fold: bool) -> torch.Tensor:
        stream = MaskStream(N, torch.device("cpu"))
        stream.draw({n: torch.Generator().manual_seed(s) for n, s in enumerate(seeds)})
        if fold:
            return vmap(lambda t: fold_trials(
                lambda rows: keep_mask(rows, threshold, stream), t),
                randomness="different")(x)
        return vmap(lambda t: keep_mask(t, threshold, stream), randomness="different")(x)

    folded, vmapped = drawn(True), drawn(False)
    assert torch.equal(folded, vmapped)
    assert len({tuple(folded[n].flatten().tolist()) for n in range(N)}) == len(set(seeds))
    for n, seed in enumerate(seeds):  # each trial's rows: its mask alone, from its seed
        alone = MaskStream(1, torch.device("cpu"))
        alone.draw({0: torch.Generator().manual_seed(seed)})
        assert torch.equal(folded[n], keep_mask(x[0], threshold, alone))
