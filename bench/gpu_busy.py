"""How busy the GPU was during Tune's loop: ``python -m bench.gpu_busy UTIL_CSV SUMMARY_JSON``.

``UTIL_CSV`` is what ``TZ=UTC nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used
--format=csv,noheader -l 5`` wrote beside a search (``gpu_util.csv``); ``SUMMARY_JSON`` is that search's ``summary.json``, whose
``phases`` give Tune's loop (``tune_started_at`` to ``tune_ended_at``, Unix seconds).
nvidia-smi's utilisation is the share of each sample period in which some kernel ran (not
how full the GPU was).  Printed: the loop's length and when its first trial was ready
(``phases.first_ready_s``: the wait for the first worker), the samples inside the loop,
their mean, the share of the loop's samples at ≥ 90 % and ≥ 50 %, and the longest
stretch under 50 % (a lone host-bound trial at the end shows there).  Several GPUs: one
row each.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path


@dataclass(frozen=True)
class Sample:
    at: float        # Unix seconds
    gpu: int         # the sample's row within its timestamp (GPU index order)
    percent: float


def read_samples(path: Path) -> list[Sample]:
    """The rows of an nvidia-smi CSV (``2026/11/26 10:00:05.123, 97 %, 1234 MiB``, timestamps
    in UTC); a row that does not parse is an error naming its line."""
    samples, seen = [], {}
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        cells = [c.strip() for c in line.split(",")]
        try:
            at = datetime.strptime(cells[0], "%Y/%m/%d %H:%M:%S.%f").replace(
                tzinfo=timezone.utc).timestamp()
            percent = float(cells[1].removesuffix("%").strip())
        except (ValueError, IndexError):
            raise SystemExit(f"error: {path}, line {number}: expected 'YYYY/MM/DD HH:MM:SS.fff, "
                             f"NN %, ...' (nvidia-smi csv,noheader), got {line!r}") from None
        gpu = seen.get(cells[0], 0)
        seen[cells[0]] = gpu + 1
        samples.append(Sample(at, gpu, percent))
    return samples


def tune_loop(path: Path) -> tuple[float, float, float | None]:
    """Tune's loop in a summary.json: its start and end (Unix seconds) and how far into it
    the first trial was ready (``first_ready_s``; None in summaries without it)."""
    try:
        phases = json.loads(path.read_text(encoding="utf-8"))["phases"]
        ready = phases.get("first_ready_s")
        return (float(phases["tune_started_at"]), float(phases["tune_ended_at"]),
                None if ready is None else float(ready))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise SystemExit(f"error: {path}: expected a search's summary.json with "
                         f"phases.tune_started_at and tune_ended_at ({exc!r})") from None


def busy(samples: list[Sample], start: float, end: float) -> dict:
    """The loop's samples of one GPU: count, mean %, shares at >= 90 % and >= 50 %, and the
    longest run of consecutive samples under 50 % (how many, the seconds from its first
    to its last, where it starts relative to the loop)."""
    inside = [s for s in samples if start <= s.at <= end]
    if not inside:
        return {"samples": 0}
    longest, run = [], []
    for s in inside + [None]:
        if s is not None and s.percent < 50:
            run.append(s)
            continue
        if len(run) > len(longest):
            longest = run
        run = []
    values = [s.percent for s in inside]
    return {"samples": len(inside), "mean": sum(values) / len(values),
            "at_90": sum(v >= 90 for v in values) / len(values),
            "at_50": sum(v >= 50 for v in values) / len(values),
            "idle_samples": len(longest),
            "idle_run_s": longest[-1].at - longest[0].at if longest else 0.0,
            "idle_run_from_s": longest[0].at - start if longest else None}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("util_csv", type=Path)
    p.add_argument("summary_json", type=Path)
    args = p.parse_args(argv)
    samples = read_samples(args.util_csv)
    start, end, ready = tune_loop(args.summary_json)
    print(f"Tune's loop: {end - start:.0f} s" + (
        f", the first trial ready {ready:.0f} s into it" if ready is not None else ""))
    for gpu in sorted({s.gpu for s in samples}):
        b = busy([s for s in samples if s.gpu == gpu], start, end)
        if not b["samples"]:
            print(f"GPU {gpu}: no sample inside Tune's loop (clocks in UTC?)")
            continue
        idle = (f"longest stretch under 50 %: {b['idle_samples']} samples over "
                f"{b['idle_run_s']:.0f} s, from {b['idle_run_from_s']:.0f} s into the loop"
                if b["idle_samples"] else "no sample under 50 %")
        print(f"GPU {gpu}: {b['samples']} samples, mean {b['mean']:.1f} %, "
              f"{b['at_90']:.0%} of them at >= 90 %, {b['at_50']:.0%} at >= 50 %; {idle}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
