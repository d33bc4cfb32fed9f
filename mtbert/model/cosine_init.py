"""The cosine start of the siamese QQP head.

A sentence-similarity encoder (the packaged MiniLM) already separates duplicate
questions by the cosine of their mean-pooled vectors (one threshold: dev QQP 0.776).
A randomly initialised head on [u, v, |u−v|, u·v, cos] throws that away and, while it
is still random, sends noise into the encoder. With ``pair_head_init=cosine`` the
model's QQP logit is

    logit = a·cos(u, v) + b + W·features,    W = 0 at the start,

and (a, b) are the 1-D logistic regression of the duplicate label on the cosine,
fitted here on ``cosine_fit_rows`` training rows by Newton's method on

    L(a, b) = mean_i BCE(σ(a·c_i + b + o_i), y_i) + (λ/2)(a² + b²),  λ = 1e-3

(o_i: the logit without the cosine term, 0 unless a pre-training stage trained the
head; λ keeps (a, b) finite on separable rows). The first QQP evaluation is then the
cosine-threshold classifier with the threshold −b/a fitted on training rows.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from mtbert.data import Split, collate, eval_batches
from mtbert.model.model import MultitaskModel

L2 = 1e-3


def fit_logistic_1d(x: np.ndarray, y: np.ndarray, offset: np.ndarray | None = None,
                    l2: float = L2, iters: int = 100) -> tuple[float, float]:
    """(a, b) minimising mean BCE(σ(a·x + b + offset), y) + l2/2·(a² + b²) (Newton)."""
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    o = np.zeros_like(x) if offset is None else np.asarray(offset, dtype=np.float64)
    design = np.stack([x, np.ones_like(x)], axis=1)

    def loss(w: np.ndarray) -> float:
        z = design @ w + o  # BCE with logits: log(1 + e^z) − y·z, computed stably
        return float(np.mean(np.logaddexp(0.0, z) - y * z) + l2 / 2 * w @ w)

    w = np.zeros(2)
    current = loss(w)
    for _ in range(iters):
        p = 0.5 * (1.0 + np.tanh(0.5 * (design @ w + o)))  # σ without overflow
        grad = design.T @ (p - y) / len(x) + l2 * w
        hess = (design * (p * (1 - p))[:, None]).T @ design / len(x) + l2 * np.eye(2)
        step = np.linalg.lstsq(hess, grad, rcond=None)[0]
        t = 1.0  # damped Newton: halve the step until the loss does not rise
        while t > 1e-6 and loss(w - t * step) > current:
            t /= 2
        w = w - t * step
        previous, current = current, loss(w)
        if np.abs(t * step).max() < 1e-10 or previous - current < 1e-15:
            break
    return float(w[0]), float(w[1])


@torch.no_grad()
def qqp_cosines(model: MultitaskModel, split: Split, pad_id: int, batch_size: int,
                device: torch.device) -> tuple[np.ndarray, np.ndarray]:
    """cos(u, v) and the logit without its cosine term, per row of ``split`` (eval mode)."""
    was_training = model.training
    model.eval()
    cos = np.zeros(len(split))
    rest = np.zeros(len(split))
    for indices in eval_batches(split, batch_size, "siamese"):
        batch = {k: v.to(device) for k, v in collate(split, indices, "siamese", pad_id).items()
                 if k != "labels"}
        out = model("qqp", batch)
        c = F.cosine_similarity(out.u.float(), out.v.float(), dim=-1)
        cos[indices] = c.cpu().numpy()
        rest[indices] = (out.logits.float() - model.qqp_cos_scale * c
                         - model.qqp_cos_shift).cpu().numpy()
    model.train(was_training)
    return cos, rest


def fit_qqp_cosine(model: MultitaskModel, split: Split, rows: int, pad_id: int,
                   batch_size: int, device: torch.device, seed: int) -> dict[str, float]:
    """Set the model's (a, b) from ``rows`` training rows (a seeded sample); returns
    a, b and the fitted rule's accuracy on those rows."""
    if len(split) > rows:
        pick = np.sort(np.random.default_rng([seed, 13]).permutation(len(split))[:rows])
        split = split.subset(pick)
    cos, rest = qqp_cosines(model, split, pad_id, batch_size, device)
    a, b = fit_logistic_1d(cos, split.labels, rest)
    model.qqp_cos_scale.data.fill_(a)
    model.qqp_cos_shift.data.fill_(b)
    accuracy = float(np.mean(((a * cos + b + rest) > 0) == (split.labels > 0.5)))
    return {"a": a, "b": b, "rows": len(split), "train_accuracy": accuracy}
