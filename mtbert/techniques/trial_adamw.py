"""The update of N stacked trials (:mod:`mtbert.step.fused_model`): gradient clipping and AdamW
over the trial axis, each trial with its own values, in ops whose number does not grow
with N.

Each parameter is a ``[N, ...]`` tensor, trial n's weights in slice n.  Every trial keeps
its own step count per parameter, its own moments (slices of ``[N, ...]`` tensors), its
own learning rate and weight decay per parameter group and its own clipping norm: ``[N]``
(or ``[G, N]``) device tensors, broadcast over each parameter's slices.  A mask per
parameter (``[N]``, 1.0 or 0.0) says which trials' slices step: trial n's slice moves --
weights, moments and step count -- only where its own loss reached the parameter in this
step, as its solo optimizer updates only the parameters that have a gradient
(``zero_grad(set_to_none=True)``): a task head that another trial trained this step stays
where it was, and so do its moments.

The arithmetic is ``torch.optim.AdamW``'s (Loshchilov & Hutter 2019, Algorithm 2, as torch
writes it), for each stepping slice with its trial's values:

    t ← t + 1;  m ← m + (1 − β₁)(g − m);  v ← β₂ v + (1 − β₂) g²
    θ ← θ (1 − lr·λ) − lr / (1 − β₁ᵗ) · m / (√v / √(1 − β₂ᵗ) + ε)

and a masked-out slice is left bit for bit (its weight in each blend is exactly 0).
Clipping is ``torch.nn.utils.clip_grad_norm_``'s: each trial's gradients scaled by
min(1, c / (‖g‖ + 1e-6)), ‖g‖ the norm of its per-parameter norms.  The loop is over the
parameters, never over the trials: one op sequence for any N (``tests/test_fused.py``
counts them), and nothing read back to the host, so a CUDA graph can hold it.  Against
torch's fused kernel, which each solo trial's optimizer runs, a slice agrees to rounding
(float64: ~1e-16 a step).
"""

from __future__ import annotations

import torch

STATE_KEYS = ("step", "exp_avg", "exp_avg_sq")


class TrialAdamW:
    """``clip_(max_norms, masks)`` then ``step(lrs, weight_decays, masks)``: one clipped
    AdamW step of every trial's stepping slices (module doc)."""

    def __init__(self, params: dict[str, torch.Tensor], group_of: dict[str, int],
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8):
        self.params = params
        self.names = list(params)
        self.group_of = group_of  # parameter name -> index of its group in the rates
        self.beta1, self.beta2 = betas
        self.eps = eps
        first = next(iter(params.values()))
        self.n, self.device = first.shape[0], first.device
        #: every parameter's per-trial step counts, one ``[P, N]`` tensor (row i: names[i])
        self.steps = torch.zeros(len(self.names), self.n, dtype=torch.float32,
                                 device=self.device)
        self.state = {name: {"step": self.steps[i],
                             "exp_avg": torch.zeros_like(p, memory_format=torch.contiguous_format),
                             "exp_avg_sq": torch.zeros_like(
                                 p, memory_format=torch.contiguous_format)}
                      for i, (name, p) in enumerate(params.items())}
        self.group_index = torch.tensor([group_of[k] for k in self.names], device=self.device)
        self._lists: dict[tuple, dict] = {}
        self._stacked: dict[int, tuple] = {}

    def stacked_masks(self, masks: dict[str, torch.Tensor]) -> torch.Tensor:
        """``[P, N]`` float64: row i the mask of ``names[i]`` (0 where a name is absent);
        made once per masks dict (the step's are made once per pattern and kept)."""
        held = self._stacked.get(id(masks))
        if held is None or held[0] is not masks:
            zero = torch.zeros(self.n, dtype=torch.float64, device=self.device)
            held = (masks, torch.stack([masks[k].to(torch.float64) if k in masks else zero
                                        for k in self.names]))
            self._stacked[id(masks)] = held
        return held[1]

    def _stepping(self) -> dict:
        """The parameters with a gradient, their tensors as lists (for the ``_foreach``
        ops) and, per (dtype, ndim), which rows of the ``[P, N]`` factors broadcast over
        them; made again only when the set of gradients changes."""
        key = tuple(id(self.params[k].grad) for k in self.names)
        lists = self._lists.get(key)
        if lists is None:
            rows = [i for i, k in enumerate(self.names) if self.params[k].grad is not None]
            tensors = [self.params[self.names[i]] for i in rows]
            shapes = sorted({(p.dtype, p.dim()) for p in tensors}, key=str)
            with_grad = torch.zeros(len(self.names), 1, dtype=torch.float64,
                                    device=self.device)
            with_grad[rows] = 1.0
            lists = {"rows": rows, "params": tensors, "with_grad": with_grad,
                     "row_index": torch.tensor(rows, device=self.device),
                     "grads": [p.grad for p in tensors],
                     "exp_avgs": [self.state[self.names[i]]["exp_avg"] for i in rows],
                     "exp_avg_sqs": [self.state[self.names[i]]["exp_avg_sq"] for i in rows],
                     "shapes": shapes,
                     "shape_of": [shapes.index((p.dtype, p.dim())) for p in tensors],
                     # each trial's slice of each gradient, trial-major (clipping's norms)
                     "slices": [p.grad[n] for n in range(self.n) for p in tensors]}
            self._lists = {key: lists}
        return lists

    def _over_trials(self, factors: torch.Tensor, lists: dict) -> list[list[torch.Tensor]]:
        """``[F, P, N]`` per-trial factors -> per factor, a list of each stepping
        parameter's ``[N, 1, ...]`` view in its dtype (a few ops for any P and N)."""
        picked = factors.index_select(1, lists["row_index"])
        views = []
        for dtype, ndim in lists["shapes"]:
            shaped = picked.to(dtype).view(picked.shape + (1,) * (ndim - 1))
            views.append([f.unbind(0) for f in shaped.unbind(0)])
        return [[views[s][f][j] for j, s in enumerate(lists["shape_of"])]
                for f in range(factors.shape[0])]

    @torch.no_grad()
    def clip_(self, max_norms: torch.Tensor, masks: dict[str, torch.Tensor]) -> None:
        """Each trial's gradient scaled to its ``max_norms[n]`` (0: not clipped), the norm
        over the parameters its step reached (``masks``: name -> ``[N]`` 0/1)."""
        lists = self._stepping()
        if not lists["rows"]:
            return
        p = len(lists["rows"])
        norms = torch.stack(torch._foreach_norm(lists["slices"])).view(self.n, p)
        reached = self.stacked_masks(masks).index_select(0, lists["row_index"]).t()
        total = torch.linalg.vector_norm(norms * reached.to(norms.dtype), dim=1)
        limit = max_norms.to(total.dtype)
        scale = torch.where(limit > 0, torch.clamp(limit / (total + 1e-6), max=1.0), 1.0)
        factors = scale.to(torch.float64).expand(len(self.names), self.n).unsqueeze(0)
        torch._foreach_mul_(lists["grads"], self._over_trials(factors, lists)[0])

    @torch.no_grad()
    def step(self, lrs: torch.Tensor, weight_decays: torch.Tensor,
             masks: dict[str, torch.Tensor]) -> None:
        """``lrs``, ``weight_decays``: ``[G, N]`` device tensors, each trial's rates per
        group; ``masks``: name -> ``[N]`` 0/1, the trials whose slice of it steps (a name
        absent, or a parameter without a gradient, steps no trial)."""
        lists = self._stepping()
        if not lists["rows"]:
            return
        on = self.stacked_masks(masks) * lists["with_grad"]            # [P, N]
        self.steps.add_(on.to(self.steps.dtype))
        # the per-trial factors in float64 (as torch's kernel takes its scalars); a slice
        # that does not step gets blend weights 0 and factors 1: it stays bit for bit
        t = self.steps.to(torch.float64)
        stepping = on > 0
        first = torch.where(stepping, 1.0 - torch.pow(self.beta1, t), 1.0)
        second = torch.where(stepping, 1.0 - torch.pow(self.beta2, t), 1.0)
        lr = lrs.index_select(0, self.group_index)                     # [P, N]
        decay = torch.where(stepping, 1.0 - lr * weight_decays.index_select(0, self.group_index),
                            1.0)
        # θ −= lr/(1 − β₁ᵗ) · m / (√v/√(1 − β₂ᵗ) + ε), written with one division fewer:
        # θ += m / ((√v + ε√(1 − β₂ᵗ)) / r), r = −lr·√(1 − β₂ᵗ)/(1 − β₁ᵗ); r = 0 where a
        # slice does not step, so its divisor is +inf and its weights move by exactly 0
        root = second.sqrt()
        rate = -(on * lr * root / first)
        factors = torch.stack([on * (1.0 - self.beta1),               # m's blend weight
                               on * (1.0 - self.beta2),               # v's blend weight
                               decay,                                 # θ(1 − lr·λ)
                               self.eps * root,                       # ε√(1 − β₂ᵗ)
                               rate])
        w_m, w_v, decay, eps, rate = self._over_trials(factors, lists)
        params, grads = lists["params"], lists["grads"]
        exp_avgs, exp_avg_sqs = lists["exp_avgs"], lists["exp_avg_sqs"]
        torch._foreach_lerp_(exp_avgs, grads, w_m)                    # m + (1 − β₁)(g − m)
        torch._foreach_lerp_(exp_avg_sqs, torch._foreach_mul(grads, grads), w_v)
        torch._foreach_mul_(params, decay)
        denom = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_add_(denom, eps)
        torch._foreach_div_(denom, rate)
        torch._foreach_addcdiv_(params, exp_avgs, denom)
