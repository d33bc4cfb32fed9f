#!/usr/bin/env bash
# The GPU evidence in one run (docs/bench/fused.md#the-gpu-evidence-in-one-run has what each
# step measures, its limit and the files written):
#
#   bash bench/gpu_evidence.sh [--dry-run] [--steps 1-6] [--budget-s 520] [--mpnet DIR]
#        MODEL_DIR DATA_DIR OUT_DIR
#
# Steps: 1 the attention probe, then the CUDA tests (a failure stops the run); 2 the fused
# layer alone; 3 fused plain batch 32 (and a try to capture the stacked step as one CUDA
# graph); 4 SMART batch 16; 5 the full smart search, --fuse on then off; 6 the peers' rows;
# 7 with --mpnet DIR, a 3-epoch training of that model, then a full smart search with it.
# --steps: 1-6 by default, 7 with --mpnet; all within --budget-s (520 s; 1500 for a dry
# run).  --dry-run: steps 1-4 (and 7a) on the CPU with a tiny random BERT from MODEL_DIR's
# tokenizer.  Exit 0 when every step that ran passed, 1 when one failed or timed out, 2 on
# missing inputs.
set -uo pipefail
cd "$(dirname "$0")/.."
repo=$PWD

usage="usage: bash bench/gpu_evidence.sh [--dry-run] [--steps LIST] [--budget-s S] [--mpnet DIR] MODEL_DIR DATA_DIR OUT_DIR"
dry=0; steps=""; explicit=0; budget=""; mpnet=""; positional=()
while [ $# -gt 0 ]; do
  case $1 in
    --dry-run) dry=1 ;;
    --steps) steps=${2:-}; explicit=1; shift ;;
    --budget-s) budget=${2:-}; shift ;;
    --mpnet) mpnet=${2:-}; shift ;;
    -h|--help) sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) echo "error: unknown option $1; $usage" >&2; exit 2 ;;
    *) positional+=("$1") ;;
  esac
  shift
done
if [ ${#positional[@]} -ne 3 ]; then
  echo "error: expected MODEL_DIR DATA_DIR OUT_DIR, got ${#positional[@]} arguments; $usage" >&2
  exit 2
fi
[ -z "$budget" ] && { [ $dry = 1 ] && budget=1500 || budget=520; }
[[ $budget =~ ^[0-9]+$ ]] || { echo "error: --budget-s $budget: expected whole seconds" >&2; exit 2; }
model=$(realpath -m "${positional[0]}"); data=$(realpath -m "${positional[1]}")
dest=$(realpath -m "${positional[2]}")
[ -n "$mpnet" ] && mpnet=$(realpath -m "$mpnet")
if [ -z "$steps" ]; then
  steps="1,2,3,4"
  [ $dry = 0 ] && steps="$steps,5,6"
  [ -n "$mpnet" ] && steps="$steps,7"
fi
wanted=" "
for part in ${steps//,/ }; do
  if [[ $part =~ ^([1-7])-([1-7])$ ]]; then
    for ((i = BASH_REMATCH[1]; i <= BASH_REMATCH[2]; i++)); do wanted+="$i "; done
  elif [[ $part =~ ^[1-7]$ ]]; then
    wanted+="$part "
  else
    echo "error: --steps $steps: expected step numbers 1-7, e.g. 1-4 or 1,3,5" >&2; exit 2
  fi
done
if [[ $wanted == *" 7 "* ]] && [ -z "$mpnet" ]; then
  echo "error: step 7 needs --mpnet DIR (python -m bench.mpnet_folder builds it)" >&2; exit 2
fi

python=${PYTHON:-python}
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
check=("$model" "$data")
[ $dry = 1 ] && check+=(--dry-run)
[ -n "$mpnet" ] && check+=(--mpnet "$mpnet")
"$python" -m bench.gpu_evidence check "${check[@]}" || exit 2

mkdir -p "$dest" || exit 2
# the work folder (the token cache, the tiny model, the searches' results; removed at the
# end): beside the evidence for a dry run, outside OUT_DIR on a GPU host, so that OUT_DIR
# never holds more than the evidence files, even after a run cut short
if [ $dry = 1 ]; then
  work="$dest/.work"; rm -rf "$work" && mkdir -p "$work"
else
  work=$(mktemp -d "${TMPDIR:-/tmp}/gpu_evidence.XXXXXX") || exit 1
fi
evidence="$dest/evidence.json"; log="$dest/evidence.log"; util="$dest/gpu_util.csv"
rm -f "$evidence" "$log" "$dest/evidence.md" "$util"
export MTBERT_CACHE="$work/cache" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
  TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1 RAY_USAGE_STATS_ENABLED=0
smi=""
if command -v nvidia-smi > /dev/null; then
  TZ=UTC nvidia-smi --query-gpu=timestamp,name,utilization.gpu,memory.used \
    --format=csv -l 1 > "$util" 2>&1 &
  smi=$!
else
  echo "timestamp, name, utilization.gpu [%], memory.used [MiB]" > "$util"
fi
cleanup() {
  [ -n "$smi" ] && kill "$smi" 2> /dev/null
  [ -n "${KEEP_WORK:-}" ] || rm -rf "$work"
}
trap cleanup EXIT

started=$(date +%s); deadline=$((started + budget)); failed=0
"$python" -m bench.gpu_evidence init "$evidence" --set "model=$model" --set "data=$data" \
  --set "mpnet=$mpnet" --set "dry_run=$dry" --set "steps=${wanted# }" \
  --set "budget_s=$budget" || exit 1
echo "gpu_evidence: steps ${wanted# }within $budget s; $dest" | tee -a "$log"

# step NAME LIMIT_S NEED_S SIGNAL RESULT_JSON -- COMMAND...: COMMAND under `timeout`
# (its limit cut to the time left; skipped when less than NEED_S is left), its output to
# the log, its outcome and RESULT_JSON (none: "-") into the evidence file
step() {
  local name=$1 limit=$2 need=$3 signal=$4 result=$5; shift 6
  local left=$((deadline - $(date +%s)))
  if [ "$left" -lt "$need" ]; then
    local note="skipped: $left s left of --budget-s $budget, it needs $need s (run it with --steps)"
    echo "=== $name: $note" | tee -a "$log"
    "$python" -m bench.gpu_evidence record "$evidence" "$name" --limit-s "$limit" \
      --note "$note" --command "$*"
    return 3
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "=== $(date -u +%H:%M:%S) $name (limit $limit s): $*" | tee -a "$log"
  local t0 tail_file="$work/tail.log"
  t0=$(date +%s%N)
  timeout -s "$signal" -k 20 "$limit" "$@" 2>&1 \
    | grep --line-buffered -v -e 'Loading weights' -e 'Writing model shards' \
    | tee "$tail_file" | tee -a "$log"
  local rc=${PIPESTATUS[0]}
  local ms=$((($(date +%s%N) - t0) / 1000000))
  local seconds=$((ms / 1000)).$(printf %03d $((ms % 1000)))
  local results=()
  [ "$result" != - ] && results=(--result "$result")
  "$python" -m bench.gpu_evidence record "$evidence" "$name" --rc "$rc" --seconds "$seconds" \
    --limit-s "$limit" "${results[@]}" --log-tail "$tail_file" --command "$*"
  echo "=== $name: exit $rc after ${seconds%.*} s" | tee -a "$log"
  [ "$rc" -eq 0 ] || failed=1
  return "$rc"
}
skip() {  # skip NAME REASON
  echo "=== $1: skipped: $2" | tee -a "$log"
  "$python" -m bench.gpu_evidence record "$evidence" "$1" --note "skipped: $2"
}
want() { [[ $wanted == *" $1 "* ]]; }
stack_reason() {  # why the searches cannot run here (empty: they can)
  "$python" -c 'import mlflow, optuna, ray, ray.tune' > /dev/null 2>&1 && return
  "$python" -c 'import mlflow, optuna, ray, ray.tune' 2>&1 | tail -n 1
}

if [ $dry = 1 ]; then
  device=cpu; tiny="$work/tiny-model"
  "$python" -m bench.gpu_evidence tiny-model "$tiny" --tokenizer "$model" > /dev/null 2>&1 \
    || { echo "error: cannot build the tiny model from $model's tokenizer" >&2; exit 1; }
  bench_model=$tiny; train_model=$mpnet  # step 7: the folder given (a tiny one will do)
  probe=(--trials 2 --rows 4 --heads 2 --tokens 16 --head-size 8)
  layer=(--trials 1,2 --steps 2 --warmup 1 --batch-size 4 --length 16 --threads 1)
  plain=(--trials 1,2 --unfused-trials 2 --steps 3 --warmup 1 --threads 1
         --set max_length=32 --set epochs=1000)
  smart=(--trials 2 --unfused-trials "" --steps 2 --warmup 1 --threads 1 --batch-size 16
         --set max_length=32 --set epochs=1000)
  search=(--budget smoke --num-samples 1)
  peers=(--budget smoke --num-samples 1 --seeds 0 --gpus-per-trial 0)
  mpnet_train=(--set max_examples=64 --set max_length=32 --set eval_batch_size=32)
  # a shared 2-core machine: generous limits (they guard a GPU host's slot, not a CPU's)
  limits=(120 180 120 300 240 300 300 600 300)
else
  device=cuda; bench_model=$model; train_model=$mpnet
  probe=()
  layer=(--trials 1,2,4,8,16,32 --steps 20 --warmup 3)
  plain=(--trials 1,2,8,16,32 --unfused-trials 1,8 --steps 20 --warmup 2 --threads 8
         --row-timeout 120)
  smart=(--trials 8,16 --unfused-trials "" --steps 20 --warmup 2 --threads 8 --row-timeout 120
         --batch-size 16)
  search=(--budget full)
  peers=(--budget full --seeds 0 --gpus-per-trial 0.125 --max-concurrent 8)
  mpnet_train=(--set epochs=3)
  limits=(20 60 45 200 90 180 240 420 300)
fi
# limits: probe, CUDA tests, layer, plain, SMART, search on, search off, peers, 7a (7b: the rest)
common=(--device "$device" --model "$bench_model" --data-dir "$data")

if want 1; then
  step "1a attention probe" "${limits[0]}" 10 TERM "$work/probe.json" -- \
    "$python" -m bench.gpu_evidence probe --device "$device" "${probe[@]}" \
    --json "$work/probe.json" || { echo "gpu_evidence: the probe failed: stopping" | tee -a "$log"; }
  if [ $failed = 0 ]; then
    step "1b CUDA tests" "${limits[1]}" 20 TERM - -- \
      env "MTBERT_TOKENIZER=$model" "$python" -m pytest -q -m cuda -p no:cacheprovider tests/test_fused.py \
      || echo "gpu_evidence: the CUDA tests failed: stopping" | tee -a "$log"
  fi
fi
if [ $failed = 0 ]; then
  want 2 && step "2 fused layer" "${limits[2]}" 20 TERM "$work/layer.json" -- \
    "$python" -m bench.throughput --mode layer "${common[@]}" "${layer[@]}" --json "$work/layer.json"
  want 3 && step "3 plain b32" "${limits[3]}" 60 TERM "$work/plain.json" -- \
    "$python" -m bench.throughput --mode fused --capture "${common[@]}" "${plain[@]}" --json "$work/plain.json"
  want 4 && step "4 SMART b16" "${limits[4]}" 40 TERM "$work/smart.json" -- \
    "$python" -m bench.throughput --mode fused --technique smart "${common[@]}" "${smart[@]}" --json "$work/smart.json"
  if want 5 || want 6 || want 7; then reason=$(stack_reason); else reason=""; fi
  driver=("$python" tune_driver.py --space smart --data-dir "$data"
          --storage-path "$work/ray_results")
  [ $dry = 1 ] && driver+=(--gpus-per-trial 0)
  if want 5; then
    if [ -n "$reason" ]; then
      skip "5 full search" "Ray, Optuna or MLflow do not import ($reason)"
    else
      for fuse in on off; do
        limit=${limits[5]}; [ $fuse = off ] && limit=${limits[6]}
        # needs 120 s: --fuse on meets its target within 2 min or misses it there
        step "5 full search, --fuse $fuse" "$limit" 120 INT \
          "$work/ray_results/fuse-$fuse/summary.json" -- "${driver[@]}" "${search[@]}" \
          --model "$bench_model" --fuse $fuse --experiment "fuse-$fuse"
      done
    fi
  fi
  if want 6; then
    if [ -n "$reason" ]; then
      skip "6 peers" "Ray, Optuna or MLflow do not import ($reason)"
    else
      step "6 peers" "${limits[7]}" 300 INT "$work/peers.json" -- \
        "$python" -m bench.peers "${peers[@]}" --model "$bench_model" --data-dir "$data" \
        --out "$work/peers" --json "$work/peers.json"
    fi
  fi
  if want 7; then
    step "7a mpnet training" "${limits[8]}" 60 TERM "$work/mpnet/metrics.json" -- \
      "$python" -m mtbert.train --data-dir "$data" --out "$work/mpnet" \
      --set "model=$train_model" --set "device=$device" --set progress=false "${mpnet_train[@]}"
    if [ -n "$reason" ]; then
      skip "7b mpnet search" "Ray, Optuna or MLflow do not import ($reason)"
    elif [ $dry = 1 ] && [ $explicit = 0 ]; then
      skip "7b mpnet search" "dry run: the searches run when --steps names them"
    else
      step "7b mpnet search" 600 120 INT "$work/ray_results/mpnet/summary.json" -- \
        "${driver[@]}" "${search[@]}" --model "$train_model" --experiment mpnet
    fi
  fi
fi

"$python" -m bench.gpu_evidence table "$evidence" --markdown "$dest/evidence.md" | tee -a "$log"
echo "gpu_evidence: $(( $(date +%s) - started )) s; exit $failed; files: $(ls "$dest" | tr '\n' ' ')" \
  | tee -a "$log"
exit $failed
