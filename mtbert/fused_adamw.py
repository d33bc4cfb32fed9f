"""The update of N stacked trials (:mod:`mtbert.fused_model`): gradient clipping and AdamW
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


def _over_trials(values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``[N]`` values shaped to broadcast over ``like``'s ``[N, ...]`` slices."""
    return values.view((-1,) + (1,) * (like.dim() - 1))


class TrialAdamW:
    """``clip_(max_norms, masks)`` then ``step(lrs, weight_decays, masks)``: one clipped
    AdamW step of every trial's stepping slices (module doc)."""

    def __init__(self, params: dict[str, torch.Tensor], group_of: dict[str, int],
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8):
        self.params = params
        self.group_of = group_of  # parameter name -> index of its group in the rates
        self.beta1, self.beta2 = betas
        self.eps = eps
        self.state = {name: {"step": torch.zeros(p.shape[0], dtype=torch.float32,
                                                 device=p.device),
                             "exp_avg": torch.zeros_like(p, memory_format=torch.contiguous_format),
                             "exp_avg_sq": torch.zeros_like(
                                 p, memory_format=torch.contiguous_format)}
                      for name, p in params.items()}

    @torch.no_grad()
    def clip_(self, max_norms: torch.Tensor, masks: dict[str, torch.Tensor]) -> None:
        """Each trial's gradient scaled to its ``max_norms[n]`` (0: not clipped), the norm
        over the parameters its step reached (``masks``: name -> ``[N]`` 0/1)."""
        names = [k for k, p in self.params.items() if p.grad is not None and k in masks]
        if not names:
            return
        grads = [self.params[k].grad for k in names]
        n = grads[0].shape[0]
        norms = torch.stack([torch.linalg.vector_norm(g.reshape(n, -1), dim=1) for g in grads])
        reached = torch.stack([masks[k] for k in names]).to(norms.dtype)
        total = torch.linalg.vector_norm(norms * reached, dim=0)
        limit = max_norms.to(total.dtype)
        scale = torch.where(limit > 0, torch.clamp(limit / (total + 1e-6), max=1.0),
                            torch.ones_like(total))
        for g in grads:
            g.mul_(_over_trials(scale.to(g.dtype), g))

    @torch.no_grad()
    def step(self, lrs: torch.Tensor, weight_decays: torch.Tensor,
             masks: dict[str, torch.Tensor]) -> None:
        """``lrs``, ``weight_decays``: ``[G, N]`` device tensors, each trial's rates per
        group; ``masks``: name -> ``[N]`` 0/1, the trials whose slice of it steps (a name
        absent, or a parameter without a gradient, steps no trial)."""
        decay = 1.0 - lrs * weight_decays  # θ(1 − lr·λ)
        for name, p in self.params.items():
            mask = masks.get(name)
            if p.grad is None or mask is None:
                continue
            g, state, group = p.grad, self.state[name], self.group_of[name]
            step = state["step"]
            step.add_(mask.to(step.dtype))
            # the per-trial factors in float64 (as torch's kernel takes its scalars), then
            # the weights' dtype; a slice that does not step gets blend weights 0, factor 1
            on = mask.to(torch.float64)
            t = step.to(torch.float64)
            first = torch.where(on > 0, 1.0 - torch.pow(self.beta1, t), 1.0)
            second = torch.where(on > 0, 1.0 - torch.pow(self.beta2, t), 1.0)
            dt = p.dtype
            state["exp_avg"].lerp_(g, _over_trials((on * (1.0 - self.beta1)).to(dt), g))
            sq = state["exp_avg_sq"]
            sq.mul_(_over_trials((1.0 - on * (1.0 - self.beta2)).to(dt), g))
            sq.addcmul_(g, g * _over_trials((on * (1.0 - self.beta2)).to(dt), g))
            p.mul_(_over_trials(torch.where(on > 0, decay[group], 1.0).to(dt), p))
            denom = (sq.sqrt() / _over_trials(second.sqrt().to(dt), p)).add_(self.eps)
            rate = (on * lrs[group] / first).to(dt)
            p.addcdiv_(state["exp_avg"] * _over_trials(-rate, p), denom)
