"""The benchmarks: each module a script, run from the repository root as
``python -m bench.NAME`` (docs/bench/ has what they measured)."""
