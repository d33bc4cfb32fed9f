"""AdamW over stacked parameters: N trials' optimizers as one (:mod:`mtbert.fused_model`).

Each parameter is a ``[N, ...]`` tensor, trial n's weights in slice n.  Every trial keeps
its own step count per parameter, its own moments (slices of ``[N, ...]`` tensors), and
its own learning rate and weight decay per parameter group.  A mask per parameter says
which trials' slices step: trial n's slice moves -- weights, moments and step count --
only where its own loss reached the parameter in this step, as its solo optimizer
updates only the parameters that have a gradient (``zero_grad(set_to_none=True)``): a
task head that another trial trained this step stays where it was, and so do its moments.

The update is ``torch.optim.AdamW(fused=True)``'s own kernel (``torch._fused_adamw_``,
what the solo trainer's optimizer runs), called on the stepping slices, one call per
(trial, parameter group) with that trial's learning rate and weight decay: each slice
gets exactly the arithmetic of the trial's solo optimizer, bit for bit
(``tests/test_fused.py``), in one pass over the weights.  A hand-written update with the
rates as ``[N]`` tensors (θ·(1 − lr·λ), the moments' lerp and addcmul, the bias
corrections, the division) takes about ten passes over the weights and their moments,
and on a CPU MiniLM's 22.7 M parameters per trial make each pass count.
"""

from __future__ import annotations

import torch

STATE_KEYS = ("step", "exp_avg", "exp_avg_sq")


class TrialAdamW:
    """``step(lrs, weight_decays, masks)``: one AdamW step of every trial's stepping slices."""

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
        self._views: dict[str, tuple] = {}  # name -> (its gradient, per-trial views)

    @torch.no_grad()
    def step(self, lrs: list[list[float]], weight_decays: list[list[float]],
             masks: dict[str, list[bool]]) -> None:
        """``lrs``, ``weight_decays``: ``[G][N]``, each trial's rates per group; ``masks``:
        name -> N booleans, the trials whose slice of it steps (a name absent, or a
        parameter without a gradient, steps no trial)."""
        calls: dict[tuple[int, int], list[list[torch.Tensor]]] = {}
        for name, p in self.params.items():
            mask = masks.get(name)
            if p.grad is None or mask is None:
                continue
            slices = self._slices(name, p)
            for n, on in enumerate(mask):
                if on:
                    lists = calls.setdefault((self.group_of[name], n), [[], [], [], [], []])
                    for out, tensor in zip(lists, slices[n]):
                        out.append(tensor)
        for (g, n), (params, grads, exp_avgs, exp_avg_sqs, steps) in calls.items():
            torch._foreach_add_(steps, 1)
            torch._fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, [], steps,
                                lr=lrs[g][n], beta1=self.beta1, beta2=self.beta2,
                                weight_decay=weight_decays[g][n], eps=self.eps,
                                amsgrad=False, maximize=False)

    def _slices(self, name: str, p: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
        """Per trial: its (weights, gradient, moments, step) views of ``name``, made again
        only when the gradient tensor is a new one (the fused step zeroes it in place)."""
        held = self._views.get(name)
        if held is None or held[0] is not p.grad:
            state = self.state[name]
            held = (p.grad, [(p[n], p.grad[n], state["exp_avg"][n], state["exp_avg_sq"][n],
                              state["step"][n]) for n in range(p.shape[0])])
            self._views[name] = held
        return held[1]
