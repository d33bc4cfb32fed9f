#!/bin/bash
# What a lent GPU runs for the step graphs, in one call: the full-budget smart search
# first (the figure most at risk of the call's time limit), then the CUDA tests, the
# throughput benches and the trial-reuse bench (docs/bench/step_graphs.md).  Call 2 of
# tools/gpu_bundle.py runs it from the repository root with $DATA (the carried data),
# /tmp/minilm and PYTHONPATH set, and stops it with SIGINT at its time limit.
set -uo pipefail
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
python -c 'import torch; print("torch", torch.__version__, torch.cuda.get_device_name(0))'
echo "=== $(date +%T) the full-budget smart search"
# SIGINT is the search's Ctrl-C: past 420 s it stops its trials and still writes its summary
timeout -s INT 420 python tune_driver.py --space smart --budget full --model /tmp/minilm \
  --data-dir "$DATA" --storage-path /tmp/ray_results --experiment smart-full-graphs
echo "=== $(date +%T) python -m pytest -q -m cuda tests/test_step_graphs.py"
if python -c 'import pytest' 2>/dev/null; then
  timeout 120 python -m pytest -q -m cuda tests/test_step_graphs.py -p no:cacheprovider \
    2>&1 | tee "$OUT/cuda_tests.log"
else
  echo "pytest is not installed here: the CUDA tests did not run" | tee "$OUT/cuda_tests.log"
fi
TP="python bench/throughput.py --device cuda --model /tmp/minilm --data-dir $DATA --skip-hf"
echo "=== $(date +%T) bench/throughput.py: batch 32, then SMART at batch 16 (graphs)"
timeout 60 $TP --threads 2 --warmup 300 --steps 600 --json "$OUT/tp_graphs.json" \
  2>&1 | tee "$OUT/throughput.log"
timeout 60 $TP --threads 2 --warmup 300 --steps 300 --batch-size 16 --set smart_lambda_sst=1 \
  --set smart_lambda_qqp=1 --set smart_lambda_sts=1 --json "$OUT/tp_smart16_graphs.json" \
  2>&1 | tee -a "$OUT/throughput.log"
echo "=== $(date +%T) python bench/trial_reuse.py --device cuda --trials 4"
timeout 150 python bench/trial_reuse.py --device cuda --model /tmp/minilm --data-dir "$DATA" \
  --trials 4 2>&1 | tee "$OUT/trial_reuse.log"
