"""The update of N stacked trials (:mod:`mtbert.step.fused_model`): gradient clipping and AdamW
over the trial axis, each trial with its own values, in ops whose number does not grow
with N.

Each parameter is a ``[N, ...]`` tensor, trial n's weights in slice n.  Every trial keeps
its own step count per parameter, its own moments (slices of ``[N, ...]`` tensors), its
own learning rate per parameter group (a ``[G, N]`` device tensor its LR schedule writes),
weight decay and clipping norm.  A mask per parameter (``[N]``, 1.0 or 0.0) says which
trials' slices step: trial n's slice moves -- weights, moments and step count -- only where
its own loss reached the parameter in this step, as its solo optimizer updates only the
parameters that have a gradient (``zero_grad(set_to_none=True)``): a task head that
another trial trained this step stays where it was, and so do its moments.

The arithmetic is ``torch.optim.AdamW``'s (Loshchilov & Hutter 2019, Algorithm 2, as torch
writes it), for each stepping slice with its trial's values:

    t ← t + 1;  m ← m + (1 − β₁)(g − m);  v ← β₂ v + (1 − β₂) g²
    θ ← θ (1 − lr·λ) − lr / (1 − β₁ᵗ) · m / (√v / √(1 − β₂ᵗ) + ε)

and a masked-out slice is left bit for bit (its weight in each blend is exactly 0).
Clipping is ``torch.nn.utils.clip_grad_norm_``'s: each trial's gradients scaled by
min(1, c / (‖g‖ + 1e-6)), ‖g‖ the norm of its per-parameter norms.  The loop is over the
parameters, never over the trials, and every list the ``_foreach`` ops take is made once:
the per-trial factors are computed as ``[F, P, N]`` tensors and written into held buffers
whose views those lists hold.  One op sequence for any N (``tests/test_step_ops.py``
counts them), and nothing read back to the host, so a CUDA graph can hold it.  Against
torch's fused kernel, which each solo trial's optimizer runs, a slice agrees to rounding
(float64: ~1e-16 a step).
"""

from __future__ import annotations

import functools

import torch

STATE_KEYS = ("step", "exp_avg", "exp_avg_sq")


class TrialAdamW:
    """``clip_(max_norms, masks)`` then ``step(lrs, masks)``: one clipped AdamW step of
    every trial's stepping slices (module doc).  ``weight_decays``: ``[G][N]``, each trial's
    weight decay per parameter group (settings, fixed for the run)."""

    def __init__(self, params: dict[str, torch.Tensor], group_of: dict[str, int],
                 weight_decays: list[list[float]], betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8):
        self.params = params
        self.names = list(params)
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
        #: ``[P, N]``: each parameter's weight decay in each trial (its group's)
        self.decays = torch.tensor([weight_decays[group_of[k]] for k in self.names],
                                   dtype=torch.float64, device=self.device)
        dtypes = sorted({p.dtype for p in params.values()}, key=str)
        #: the dtype of the per-slice gradient norms stacked together (clipping's)
        self.norm_dtype = functools.reduce(torch.promote_types, dtypes)
        #: per dtype, ``[F, P, N]``: the step's per-trial factors (clipping's scale, then
        #: AdamW's five), written each step; the lists hold each one's ``[N, 1, ...]`` view
        #: per parameter, as the ``_foreach`` ops take them
        self.factors = {d: torch.ones(6, len(self.names), self.n, dtype=d, device=self.device)
                        for d in dtypes}
        self._scale_rows = [held[0] for held in self.factors.values()]
        self._adamw_rows = [held[1:] for held in self.factors.values()]
        self._one = torch.ones((), dtype=torch.float64, device=self.device)
        self._clips: dict[tuple, tuple] = {}
        self.lists: dict[str, list] = {"grads": []}
        self._masks: dict[int, dict] = {}

    def _held_lists(self) -> dict[str, list]:
        """The tensor lists the ``_foreach`` ops take, made once: the gradients are held
        from the start and zeroed in place after each step (made again only if one was
        replaced)."""
        tensors = [self.params[k] for k in self.names]
        held = self.lists["grads"]
        if len(held) == len(tensors) and all(p.grad is g for p, g in zip(tensors, held)):
            return self.lists
        for p in tensors:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        views = [[self.factors[p.dtype][f, i].view((-1,) + (1,) * (p.dim() - 1))
                  for i, p in enumerate(tensors)] for f in range(6)]
        self.lists = {"params": [p.detach() for p in tensors],
                      "grads": [p.grad for p in tensors],
                      "exp_avgs": [self.state[k]["exp_avg"] for k in self.names],
                      "exp_avg_sqs": [self.state[k]["exp_avg_sq"] for k in self.names],
                      # each trial's slice of each gradient, trial-major (clipping's norms)
                      "slices": [p.grad[n] for n in range(self.n) for p in tensors],
                      "scale": views[0], "adamw": views[1:]}
        return self.lists

    def _per_masks(self, masks: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """What the step reads of ``masks``, made once per masks dict (the step's are made
        once per pattern and kept): ``on`` ``[P, N]`` float64 (row i the mask of
        ``names[i]``, 0 where a name is absent), the step counts' increments, the stepping
        slices, AdamW's blend weights and clipping's ``[N, P]`` reach."""
        held = self._masks.get(id(masks))
        if held is None or held["masks"] is not masks:
            zero = torch.zeros(self.n, dtype=torch.float64, device=self.device)
            on = torch.stack([masks[k].to(torch.float64) if k in masks else zero
                              for k in self.names])
            held = {"masks": masks, "on": on, "increments": on.to(self.steps.dtype),
                    "stepping": on > 0, "w_m": on * (1.0 - self.beta1),
                    "w_v": on * (1.0 - self.beta2),
                    "reached": on.t().to(self.norm_dtype).contiguous()}
            self._masks[id(masks)] = held
        return held

    def _limits(self, max_norms: torch.Tensor, dtype: torch.dtype) -> tuple:
        """``max_norms`` in ``dtype`` and where it is > 0 (made once per tensor)."""
        key = (id(max_norms), dtype)
        held = self._clips.get(key)
        if held is None or held[0] is not max_norms:
            held = (max_norms, max_norms.to(dtype), max_norms > 0)
            self._clips[key] = held
        return held[1], held[2]

    @torch.no_grad()
    def clip_(self, max_norms: torch.Tensor, masks: dict[str, torch.Tensor]) -> None:
        """Each trial's gradient scaled to its ``max_norms[n]`` (0: not clipped), the norm
        over the parameters its step reached (``masks``: name -> ``[N]`` 0/1)."""
        held = self._per_masks(masks)
        lists = self._held_lists()
        norms = torch.stack(torch._foreach_norm(lists["slices"])).view(self.n, -1)
        total = torch.linalg.vector_norm(norms * held["reached"], dim=1)
        limit, clips = self._limits(max_norms, total.dtype)
        scale = torch.where(clips, torch.clamp(limit / (total + 1e-6), max=1.0), self._one)
        for row in self._scale_rows:
            row.copy_(scale)  # [N] over every parameter's row
        torch._foreach_mul_(lists["grads"], lists["scale"])

    @torch.no_grad()
    def step(self, lrs: torch.Tensor, masks: dict[str, torch.Tensor]) -> None:
        """``lrs``: ``[G, N]`` device tensor, each trial's learning rate per group;
        ``masks``: name -> ``[N]`` 0/1, the trials whose slice of it steps (a name absent
        steps no trial)."""
        held = self._per_masks(masks)
        on, stepping, one = held["on"], held["stepping"], self._one               # [P, N]
        self.steps.add_(held["increments"])
        # the per-trial factors in float64 (as torch's kernel takes its scalars); a slice
        # that does not step gets blend weights 0 and factors 1: it stays bit for bit
        t = self.steps.to(torch.float64)
        first = torch.where(stepping, 1.0 - torch.pow(self.beta1, t), one)
        second = torch.where(stepping, 1.0 - torch.pow(self.beta2, t), one)
        lr = lrs.index_select(0, self.group_index)                     # [P, N]
        decay = torch.where(stepping, 1.0 - lr * self.decays, one)
        # θ −= lr/(1 − β₁ᵗ) · m / (√v/√(1 − β₂ᵗ) + ε), written with one division fewer:
        # θ += m / ((√v + ε√(1 − β₂ᵗ)) / r), r = −lr·√(1 − β₂ᵗ)/(1 − β₁ᵗ); r = 0 where a
        # slice does not step, so its divisor is +inf and its weights move by exactly 0
        root = second.sqrt()
        rate = -(on * lr * root / first)
        factors = torch.stack([held["w_m"],         # m's blend weight, 1 − β₁ where on
                               held["w_v"],         # v's blend weight, 1 − β₂ where on
                               decay,               # θ(1 − lr·λ)
                               self.eps * root,     # ε√(1 − β₂ᵗ)
                               rate])
        for rows in self._adamw_rows:
            rows.copy_(factors)
        lists = self._held_lists()
        w_m, w_v, decay, eps, rate = lists["adamw"]
        params, grads = lists["params"], lists["grads"]
        exp_avgs, exp_avg_sqs = lists["exp_avgs"], lists["exp_avg_sqs"]
        torch._foreach_lerp_(exp_avgs, grads, w_m)                    # m + (1 − β₁)(g − m)
        torch._foreach_lerp_(exp_avg_sqs, torch._foreach_mul(grads, grads), w_v)
        torch._foreach_mul_(params, decay)
        denom = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_add_(denom, eps)
        torch._foreach_div_(denom, rate)
        torch._foreach_addcdiv_(params, exp_avgs, denom)
