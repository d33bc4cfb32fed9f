"""How much training a search did per second, and the share of the GPU's arithmetic that
was: ``python bench/search_rate.py SUMMARY_JSON [--throughput TP_JSON]``.

``SUMMARY_JSON`` is a search's ``summary.json``: every trial's examples trained (the
larger of its ``examples_seen`` and its best checkpoint's, since summaries written before
2026-11-27 undercounted trials the scheduler paused) over Tune's loop and over the whole
wall (``phases``).  ``TP_JSON`` is a ``bench/throughput.py --json`` output on the same
GPU: its FLOPs per trained example and the GPU's measured bf16 peak give the MFU
(model FLOPs utilisation) of that rate.  That MFU counts a plain training step's FLOPs per
example, so a search whose trials add SMART's extra passes did more arithmetic than it
shows.

Why beside ``bench/gpu_busy.py``: nvidia-smi's utilisation is the share of time in which
*any* kernel ran, so one small trial at 2.7 % of the GPU's arithmetic reads ~100 % busy.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def read_json(path: Path, what: str) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise SystemExit(f"error: {path}: expected {what} ({exc})") from None


def examples_trained(summary: dict) -> int:
    """Every trial's examples trained: its ``examples_seen``, or its best checkpoint's
    where that is larger (older summaries undercounted paused trials)."""
    total = 0
    for trial in summary.get("trials", []):
        best = (trial.get("best") or {}).get("examples_seen") or 0
        total += max(int(trial.get("examples_seen") or 0), int(best))
    return total


def flops_per_example(throughput: dict) -> tuple[float, float]:
    """(FLOPs per trained example, the GPU's peak FLOP/s) of a throughput.py JSON."""
    try:
        processes = throughput["processes"]
        flops = sum(float(p["flops"]) for p in processes)
        examples = sum(float(p["examples"]) for p in processes)
        return flops / examples, float(throughput["peak_gflops"]) * 1e9
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:
        raise SystemExit(f"error: expected bench/throughput.py's JSON with processes[].flops, "
                         f"processes[].examples and peak_gflops ({exc!r})") from None


def search_rate(summary: dict, throughput: dict | None = None) -> dict:
    phases = summary.get("phases") or {}
    if "tune_s" not in phases or "total_s" not in phases:
        raise SystemExit("error: the summary has no phases.tune_s / phases.total_s "
                         "(written before 2026-11-26?)")
    examples = examples_trained(summary)
    out = {"examples": examples, "tune_s": float(phases["tune_s"]),
           "total_s": float(phases["total_s"])}
    out["per_s_tune"] = examples / out["tune_s"]
    out["per_s_total"] = examples / out["total_s"]
    if throughput is not None:
        per_example, peak = flops_per_example(throughput)
        out["flops_per_example"] = per_example
        out["mfu_tune"] = out["per_s_tune"] * per_example / peak
        out["mfu_total"] = out["per_s_total"] * per_example / peak
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("summary_json", type=Path)
    p.add_argument("--throughput", type=Path, metavar="TP_JSON",
                   help="bench/throughput.py --json output on the same GPU: gives the MFU")
    args = p.parse_args(argv)
    summary = read_json(args.summary_json, "a search's summary.json")
    tp = (read_json(args.throughput, "bench/throughput.py's JSON")
          if args.throughput is not None else None)
    r = search_rate(summary, tp)
    mfu = (lambda key: f", MFU {r[key]:.2%}") if tp is not None else (lambda key: "")
    print(f"examples trained: {r['examples']:,}")
    print(f"over Tune's loop ({r['tune_s']:.0f} s): {r['per_s_tune']:,.0f} ex/s{mfu('mfu_tune')}")
    print(f"over the whole wall ({r['total_s']:.0f} s): {r['per_s_total']:,.0f} ex/s"
          f"{mfu('mfu_total')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
