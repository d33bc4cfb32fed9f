#!/bin/bash
# What a lent GPU runs for the step graphs in call 2 (tools/gpu_bundle.py): the full-budget
# smart search first (the figure most at risk of the call's time limit), then the
# throughput benches, the trial-reuse bench and where 8 fresh workers' start goes
# (docs/bench/step_graphs.md).  The CUDA
# tests need neither MiniLM nor the data, so they run in call 1 after the stack is
# unpacked (docs/gpu_h100/README.md), which leaves call 2's 540 s to these.  Call 2 runs
# this from the repository root with $DATA (the carried data), /tmp/minilm and PYTHONPATH
# set, and stops it with SIGINT at its time limit.  $OUT brings back at most 8 files:
# this writes 4 beside call 2's search.log, gpu_util.csv and the search's two summaries
# (the worker-start table goes to search.log).
set -uo pipefail
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
python -c 'import torch; print("torch", torch.__version__, torch.cuda.get_device_name(0))'
echo "=== $(date +%T) the full-budget smart search"
# SIGINT is the search's Ctrl-C: past 390 s it stops its trials and still writes its summary
timeout -s INT 390 python tune_driver.py --space smart --budget full --model /tmp/minilm \
  --data-dir "$DATA" --storage-path /tmp/ray_results --experiment smart-full-graphs
TP="python bench/throughput.py --device cuda --model /tmp/minilm --data-dir $DATA --skip-hf"
echo "=== $(date +%T) bench/throughput.py: batch 32, then SMART at batch 16 (graphs)"
timeout 40 $TP --threads 2 --warmup 300 --steps 600 --json "$OUT/tp_graphs.json" \
  2>&1 | tee "$OUT/throughput.log"
timeout 40 $TP --threads 2 --warmup 300 --steps 300 --batch-size 16 --set smart_lambda_sst=1 \
  --set smart_lambda_qqp=1 --set smart_lambda_sts=1 --json "$OUT/tp_smart16_graphs.json" \
  2>&1 | tee -a "$OUT/throughput.log"
echo "=== $(date +%T) python bench/trial_reuse.py --device cuda --trials 4"
timeout 60 python bench/trial_reuse.py --device cuda --model /tmp/minilm --data-dir "$DATA" \
  --trials 4 2>&1 | tee "$OUT/trial_reuse.log"
echo "=== $(date +%T) python bench/worker_start.py --processes 8 --device cuda"
timeout 60 python bench/worker_start.py --processes 8 --device cuda --model /tmp/minilm
