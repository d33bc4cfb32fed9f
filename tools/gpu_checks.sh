#!/bin/bash
# What a lent GPU runs for the step graphs in call 2 (tools/gpu_bundle.py): the full-budget
# smart search first (the figure most at risk of the call's time limit), its MPS daemon's
# logs copied beside it, then bench/mps_exit.py, which asks whether a client's clean exit
# faults the clients still replaying graphs under MPS (docs/bench/step_graphs.md).  The
# throughput, trial-reuse and worker-start benches, measured on 2026-11-26 and twice on
# 2026-11-27, are left to their own commands there.  The CUDA tests need neither MiniLM
# nor the data, so they run in call 1 after the stack is unpacked
# (docs/gpu_h100/README.md).  Call 2 runs this from the repository root with $DATA (the
# carried data), /tmp/minilm and PYTHONPATH set, and stops it with SIGINT at its time
# limit.  $OUT brings back at most 8 files: this writes 2 beside call 2's search.log,
# gpu_util.csv and the search's two summaries (the mps_exit tables go to search.log).
set -uo pipefail
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
python -c 'import torch; print("torch", torch.__version__, torch.cuda.get_device_name(0))'
echo "=== $(date +%T) the full-budget smart search"
# SIGINT is the search's Ctrl-C: past 390 s it stops its trials and still writes its summary
timeout -s INT 390 python tune_driver.py --space smart --budget full --model /tmp/minilm \
  --data-dir "$DATA" --storage-path /tmp/ray_results --experiment smart-full-graphs
for f in /tmp/ray_results/smart-full-graphs/mps_log/*/*.log; do
  [ -f "$f" ] && cp "$f" "$OUT/mps_$(basename "$f")"
done
for mode in clean release; do
  echo "=== $(date +%T) python bench/mps_exit.py --device cuda --mode $mode --leavers 6"
  timeout 120 python bench/mps_exit.py --device cuda --mode "$mode" --leavers 6
done
