"""The Python side of ``bench/gpu_evidence.sh`` (docs/bench/fused.md): its check of the
inputs, the dry run's tiny model, the attention probe (step 1a; exit 1 beyond bf16
rounding) and the evidence file and its table (``--help`` lists the subcommands).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import platform
import subprocess
import sys
import time
import warnings
from pathlib import Path

from bench.common import commit, seconds
from mtbert.core.atomic import atomic_write_text
from tests.tiny_models import TOKENIZER_FILES, tiny_model

#: what every step needs (import names)
REQUIRED_MODULES = ("torch", "transformers", "numpy", "pyarrow", "yaml", "safetensors",
                    "tokenizers", "pytest")
#: what steps 5 and 6 (the searches) need besides
STACK_MODULES = ("ray", "optuna", "mlflow")
#: ``vmap``'s warning when an op has no batching rule and runs once per trial
FALLBACK_WARNING = "not yet implemented the batching rule"


# ---------------------------------------------------------------------- check
def missing_inputs(model: Path, data: Path, cuda: bool, mpnet: Path | None = None) -> list[str]:
    """What the run needs and does not have, each as a few words."""
    from mtbert.core.pretrained import WEIGHT_FILES
    from mtbert.core.tasks import TASKS

    missing = [f"python module {name}" for name in REQUIRED_MODULES
               if importlib.util.find_spec(name) is None]
    if cuda and not missing:
        import torch
        if not torch.cuda.is_available():
            missing.append(f"a CUDA GPU (torch {torch.__version__} sees none)")
    for label, folder in (("model", model), ("mpnet", mpnet)):
        if folder is None:
            continue
        if not folder.is_dir():
            missing.append(f"{label} folder {folder}")
            continue
        if not (folder / "config.json").is_file():
            missing.append(f"{folder / 'config.json'}")
        if not any((folder / name).is_file() for name in WEIGHT_FILES):
            missing.append(f"weights in {folder} ({' or '.join(WEIGHT_FILES[::2])})")
        if not any((folder / name).is_file() for name in TOKENIZER_FILES[:2]):
            missing.append(f"a tokenizer in {folder} (tokenizer.json or vocab.txt)")
    if not data.is_dir():
        missing.append(f"data folder {data}")
    else:
        names = sorted({f for spec in TASKS.values() for f in spec.files.values()})
        absent = [n for n in names if not (data / n).is_file()]
        if absent:
            missing.append(f"{', '.join(absent)} in {data}")
    return missing


def check(args) -> int:
    """One line: what is missing (exit 2), or what is there (exit 0)."""
    mpnet = Path(args.mpnet) if args.mpnet else None
    missing = missing_inputs(Path(args.model), Path(args.data), not args.dry_run, mpnet)
    if missing:
        print("error: missing: " + "; ".join(missing), file=sys.stderr)
        return 2
    from mtbert.core.errors import ConfigError
    from mtbert.core.pretrained import check_model
    for folder in [args.model] + ([args.mpnet] if args.mpnet else []):
        try:
            check_model(str(Path(folder).resolve()))
        except ConfigError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    stack = [name for name in STACK_MODULES if importlib.util.find_spec(name) is None]
    print(f"check: model {args.model}, data {args.data}"
          + (f", mpnet {args.mpnet}" if args.mpnet else "")
          + ("; the searches' stack: ok" if not stack
             else f"; the searches' stack lacks {', '.join(stack)}"))
    return 0


# ---------------------------------------------------------------------- probe
def _relative_error(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def probe(device_name: str, trials: int, rows: int, heads: int, tokens: int, head_size: int,
          repeats: int = 5) -> dict:
    """The attention probe (module doc): figures and ``ok``."""
    import torch
    import torch.nn.functional as F
    from torch.func import vmap

    from mtbert.core.devices import prefer_stable_attention_kernels

    device = torch.device(device_name)
    cuda = device.type == "cuda"
    if cuda:
        prefer_stable_attention_kernels()
    dtype = torch.bfloat16 if cuda else torch.float32
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5
    generator = torch.Generator().manual_seed(0)
    shape = (trials, rows, heads, tokens, head_size)
    leaves = [torch.randn(shape, generator=generator).to(device, dtype).requires_grad_()
              for _ in range(3)]
    lengths = torch.randint(1, tokens + 1, (trials, rows), generator=generator)
    mask = (torch.arange(tokens) < lengths[..., None])[:, :, None, None, :].to(device)
    upstream = torch.randn(shape, generator=generator).to(device)

    def attend(q, k, v, m):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m)

    def fused():
        return vmap(attend)(*leaves, mask)

    def looped():
        return torch.stack([attend(q, k, v, m) for q, k, v, m in zip(*leaves, mask)])

    def forward_backward(fn):
        for leaf in leaves:
            leaf.grad = None
        out = fn()
        (out.float() * upstream).sum().backward()
        return out.detach(), [leaf.grad.detach().clone() for leaf in leaves]

    def reference():
        q, k, v = (leaf.detach().double().requires_grad_() for leaf in leaves)
        scores = q @ k.transpose(-1, -2) * head_size ** -0.5
        out = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v
        (out * upstream.double()).sum().backward()
        return out.detach(), [q.grad, k.grad, v.grad]

    figures = {"device": torch.cuda.get_device_name(device) if cuda else "cpu",
               "dtype": str(dtype).removeprefix("torch."),
               "shape": dict(zip(("trials", "rows", "heads", "tokens", "head_size"), shape)),
               "padded_share": float(1 - lengths.sum() / lengths.numel() / tokens),
               "sdp_enabled": {name: bool(getattr(torch.backends.cuda, f"{name}_sdp_enabled")())
                               for name in ("flash", "mem_efficient", "math", "cudnn")}}
    ref_out, ref_grads = reference()
    ok = True
    for name, fn in (("fused", fused), ("loop", looped)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                figures[name] = _measure(fn, forward_backward, ref_out, ref_grads, repeats,
                                         device, tolerance)
            except Exception as exc:  # the probe's point: any failure of the kernel, named
                figures[name] = {"error": f"{type(exc).__name__}: {exc}".splitlines()[0]}
                ok = False
                continue
        figures[name]["vmap_fell_back"] = any(FALLBACK_WARNING in str(w.message)
                                              for w in caught)
        ok = ok and figures[name]["within_tolerance"]
    if "ms_median" in figures.get("fused", {}) and "ms_median" in figures.get("loop", {}):
        figures["loop_over_fused"] = figures["loop"]["ms_median"] / figures["fused"]["ms_median"]
    figures["tolerance"] = tolerance
    figures["ok"] = ok
    return figures


def _measure(fn, forward_backward, ref_out, ref_grads, repeats: int, device,
             tolerance: float) -> dict:
    """One way of attending: its errors against the reference, finiteness, median time of
    a forward and backward, and the attention kernels it ran."""
    import torch

    out, grads = forward_backward(fn)
    errors = {"out": _relative_error(out, ref_out),
              **{f"grad_{n}": _relative_error(g, r) for n, g, r in zip("qkv", grads, ref_grads)}}
    finite = bool(torch.isfinite(out).all()) and all(bool(torch.isfinite(g).all())
                                                     for g in grads)
    times = [seconds(device, lambda: forward_backward(fn)) for _ in range(repeats)]
    return {"relative_error": errors, "finite": finite,
            "within_tolerance": finite and max(errors.values()) <= tolerance,
            "ms_median": 1000 * sorted(times)[len(times) // 2],
            "kernels": _kernels(fn, forward_backward)}


def _kernels(fn, forward_backward) -> list[str]:
    """The attention ops one forward and backward of ``fn`` ran (torch.profiler's names)."""
    from torch.profiler import profile

    with profile() as prof:
        forward_backward(fn)
    return sorted({e.key for e in prof.key_averages() if "attention" in e.key})


# ---------------------------------------------------------------------- the evidence file
def machine() -> dict:
    """The machine and software the figures come from."""
    info = {"date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
            "host": platform.node(), "python": platform.python_version(),
            "cpus": os.cpu_count(), "load_average": list(os.getloadavg()),
            "commit": os.environ.get("EVIDENCE_COMMIT") or commit() or "unknown"}
    for name in ("torch", "transformers"):  # read without importing them (seconds each)
        try:
            info[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            info[name] = None
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version",
                               "--format=csv,noheader"], capture_output=True, text=True,
                              timeout=30)
        info["gpu"] = done.stdout.strip() or None if done.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired):
        info["gpu"] = None
    return info


def record(args) -> int:
    """One step's outcome (and its result files' JSON) into the evidence file."""
    path = Path(args.evidence)
    doc = json.loads(path.read_text(encoding="utf-8"))
    status = ("skipped" if args.rc is None else "ok" if args.rc == 0
              else "timed out" if args.rc in (124, 137) else "failed")
    entry = {"status": status, "rc": args.rc, "seconds": args.seconds,
             "limit_s": args.limit_s, "command": args.cmd, **({"note": args.note} if args.note
                                                               else {})}
    results = {}
    for file in args.result:
        file = Path(file)
        if file.is_file():
            try:
                results[file.name] = json.loads(file.read_text(encoding="utf-8"))
            except json.JSONDecodeError as exc:
                results[file.name] = {"unreadable": str(exc)}
    if results:
        entry["results"] = results
    if args.log_tail:  # its last 3 lines that are not blank (the step's summary)
        tail = Path(args.log_tail)
        text = tail.read_text(encoding="utf-8", errors="replace") if tail.is_file() else ""
        entry["log_tail"] = [line for line in text.splitlines() if line.strip()][-3:]
    doc["steps"][args.name] = entry
    atomic_write_text(path, json.dumps(doc, indent=1) + "\n")
    return 0


# ---------------------------------------------------------------------- the table
def _fmt(value, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return f"{value:,}" if isinstance(value, int) else str(value)


def _train_rows(result: dict) -> list[str]:
    lines = []
    for row in result.get("rows", []):
        for engine in ("fused", "unfused"):
            f = row.get(engine)
            if f is None:
                continue
            if "error" in f:
                lines.append(f"| {row['trials']} | {engine} | error: {f['error']} |"
                             + " |" * 8)
                continue
            lines.append(
                f"| {row['trials']} | {engine} ({f['step_mode']}) | {_fmt(f['ex_per_s'])} "
                f"| {_fmt(f['ms_per_step'], 2)} | {_fmt(f['host_ms_per_step'], 2)} "
                f"| {_fmt(f['gpu_ms_per_step'], 2)} | {_fmt(f['ops_per_step'])} "
                f"| {_fmt(f['executed_per_real_token'], 2)} | {_fmt(f['memory_mb'], 0)} "
                f"| {_fmt(f['graphs_captured_in_window'])} |")
    return lines


def _search_line(name: str, summary: dict) -> str:
    """A search's wall time, Tune's loop, trials, examples per second over the loop and
    its best trial's val and dev overall."""
    phases, counts = summary["phases"], summary["counts"]
    best = summary.get("best_trial") or {}
    tune_s = phases.get("tune_s") or 0.0
    rate = summary.get("examples_trained", 0) / tune_s if tune_s else None
    return (f"{name}: {_fmt(phases.get('total_s'))} s in all, Tune's loop "
            f"{_fmt(tune_s)} s, {_fmt(rate)} ex/s over it; trials {counts['trials']} "
            f"(completed {counts['completed']}, stopped early {counts['stopped_early']}, "
            f"errored {counts['errored']}, restored {counts.get('restored', 0)}); best val "
            f"overall {_fmt(best.get('val', {}).get('val/overall'), 4)}, dev overall "
            f"{_fmt(best.get('dev', {}).get('dev/overall'), 4)}")


def table(doc: dict) -> str:
    """The evidence as Markdown: the steps, then each measurement's figures."""
    m = doc["machine"]
    out = [f"GPU evidence, {m['date_utc']} UTC, commit {m['commit']}, "
           f"{m.get('gpu') or 'no GPU'}, torch {m.get('torch')}, {m['cpus']} CPUs"
           + (" (dry run)" if doc["settings"].get("dry_run") == "1" else ""), "",
           "| step | status | s | limit s | note |", "| --- | --- | --- | --- | --- |"]
    for name, step in doc["steps"].items():
        out.append(f"| {name} | {step['status']} | {_fmt(step['seconds'], 0)} "
                   f"| {_fmt(step['limit_s'])} | {step.get('note', '')} |")
    for name, step in doc["steps"].items():
        for file, result in step.get("results", {}).items():
            if not isinstance(result, dict):
                continue
            if "rows" in result and result.get("args", {}).get("mode") == "fused":
                out += ["", f"{name} ({file}): ex/s, ms per step (wall, host, GPU busy), "
                            "ops per step, executed / real tokens, memory MB, graphs "
                            "captured in the window", "",
                        "| N | engine | ex/s | ms | host ms | GPU ms | ops | exec/real "
                        "| MB | captured |",
                        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
                out += _train_rows(result)
                out += [f"- N = {row['trials']}: the stacked step as one CUDA graph: "
                        + (f"captured, {_fmt(c['ex_per_s'])} ex/s in replays" if c["captured"]
                           else f"not captured ({c['reason']})")
                        for row in result.get("rows", [])
                        for c in [(row.get("fused") or {}).get("capture")] if c]
            elif "rows" in result and result.get("args", {}).get("mode") == "layer":
                out += ["", f"{name} ({file}): one layer, forward + backward", "",
                        "| N | fused ms | N layers ms | speed-up | fused TFLOP/s |",
                        "| --- | --- | --- | --- | --- |"]
                out += [f"| {r['trials']} | {_fmt(r['fused_ms'], 3)} "
                        f"| {_fmt(r['unfused_ms'], 3)} | {r['unfused_ms'] / r['fused_ms']:.2f} "
                        f"| {_fmt(r['fused_tflops'], 3)} |" for r in result["rows"]]
            elif "counts" in result and "phases" in result:  # a search's summary.json
                out += ["", _search_line(name, result)]
            elif "runs" in result and "figures" in result:  # bench.peers' JSON
                out += ["", f"{name}: " + "; ".join(
                    f"{method} seed {seed} {_fmt(run.get('wall_s'))} s, dev "
                    f"{_fmt((run.get('selected') or {}).get('dev'), 4)}"
                    for method, seeds in result["runs"].items() for seed, run in seeds.items())
                        + f"; figures {json.dumps(result['figures'])}"]
            elif "dev/overall" in result:  # a training's metrics.json
                out += ["", f"{name}: dev overall {result['dev/overall']:.4f}, val overall "
                            f"{result.get('val/overall', float('nan')):.4f}"]
            elif "loop_over_fused" in result or "fused" in result and "tolerance" in result:
                fused, loop = result.get("fused", {}), result.get("loop", {})
                out += ["", f"{name}: vmapped SDPA {_fmt(fused.get('ms_median'), 3)} ms, "
                            f"loop {_fmt(loop.get('ms_median'), 3)} ms; largest relative "
                            f"error {max(fused.get('relative_error', {None: 0.0}).values()):.2e}"
                            f"; kernels {fused.get('kernels')}; fell back to a loop: "
                            f"{fused.get('vmap_fell_back')}; ok: {result.get('ok')}"]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_evidence",
                                description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    c = sub.add_parser("check", help="what the run needs: one line, exit 2 when missing")
    c.add_argument("model")
    c.add_argument("data")
    c.add_argument("--dry-run", action="store_true", help="no CUDA GPU needed")
    c.add_argument("--mpnet", help="the base-size model folder of step 7")
    t = sub.add_parser("tiny-model", help="a tiny random BERT with a folder's tokenizer")
    t.add_argument("folder")
    t.add_argument("--tokenizer", required=True, help="model folder whose tokenizer it takes")
    pr = sub.add_parser("probe", help="vmapped SDPA with padding masks against a loop")
    pr.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    for flag, default in (("--trials", 8), ("--rows", 32), ("--heads", 12), ("--tokens", 64),
                          ("--head-size", 32)):
        pr.add_argument(flag, type=int, default=default)
    pr.add_argument("--json", required=True)
    i = sub.add_parser("init", help="start the evidence file")
    i.add_argument("evidence")
    i.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    r = sub.add_parser("record", help="one step's outcome into the evidence file")
    r.add_argument("evidence")
    r.add_argument("name")
    r.add_argument("--rc", type=int, help="exit status (none: skipped)")
    r.add_argument("--seconds", type=float, default=0.0)
    r.add_argument("--limit-s", type=int)
    r.add_argument("--result", action="append", default=[], help="a JSON file it wrote")
    r.add_argument("--note")
    r.add_argument("--log-tail", help="keep this file's last lines (its summary)")
    r.add_argument("--command", dest="cmd", default="", help="the step's command line")
    tb = sub.add_parser("table", help="the evidence as Markdown")
    tb.add_argument("evidence")
    tb.add_argument("--markdown", help="also write it here")
    args = p.parse_args(argv)
    if args.what == "check":
        return check(args)
    if args.what == "tiny-model":
        tiny_model(Path(args.folder), Path(args.tokenizer))  # the tests' tiny model
        return 0
    if args.what == "probe":
        figures = probe(args.device, args.trials, args.rows, args.heads, args.tokens,
                        args.head_size)
        Path(args.json).write_text(json.dumps(figures, indent=1) + "\n", encoding="utf-8")
        print(json.dumps({k: figures[k] for k in ("device", "dtype", "ok")}
                         | {k: {kk: figures[k][kk] for kk in ("ms_median", "kernels",
                                                              "vmap_fell_back")}
                            for k in ("fused", "loop") if "ms_median" in figures.get(k, {})}))
        return 0 if figures["ok"] else 1
    if args.what == "init":
        atomic_write_text(args.evidence, json.dumps({
            "machine": machine(), "settings": dict(kv.split("=", 1) for kv in args.set),
            "steps": {}}, indent=1) + "\n")
        return 0
    if args.what == "record":
        return record(args)
    text = table(json.loads(Path(args.evidence).read_text(encoding="utf-8")))
    if args.markdown:
        Path(args.markdown).write_text(text, encoding="utf-8")
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
