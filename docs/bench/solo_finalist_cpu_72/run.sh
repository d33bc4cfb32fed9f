#!/bin/bash
# The main job's finalist configuration (0ecdc45e: SMART lambda 1/5/1, eps 1.15e-5, mu 0.5,
# lr 1.86e-4, dropout 0.074, batch 32) trained alone on one thread, the `small` budget's
# 1,000 training rows a task, 96 steady schedule steps (one pass over each task's rows), at
# three checkouts one after the other on the idle 2-core machine: 6d4724d (before #72),
# bbcfd32 (before the hashed masks) and 75f8fd4. ROUND 2: each checkout's default precision
# (bf16 at bbcfd32 and 75f8fd4; 6d4724d has no precision setting: float32); ROUND fp32:
# float32 everywhere. 6d4724d's bench has an HF Trainer reference, skipped.
#   usage: run.sh 6D4724D_TREE BBCFD32_TREE 75F8FD4_TREE ROUND
SET="--set smart_lambda_sst=1 --set smart_lambda_qqp=5 --set smart_lambda_sts=1 --set smart_eps=1.15e-5 --set smart_mu=0.5 --set lr=1.86e-4 --set dropout=0.074 --set max_train_per_task=1000 --set lr_schedule=wsd"
folder=$(pwd)/docs/bench/solo_finalist_cpu_72
for pair in "6d4724d:$1" "bbcfd32:$2" "75f8fd4:$3"; do
  name=${pair%%:*}; tree=${pair#*:}; extra=""
  [ "$name" = 6d4724d ] && extra=--skip-hf
  [ "$name" != 6d4724d ] && [ "$4" = fp32 ] && extra="--set precision=fp32"
  (cd "$tree" && PYTHONPATH=$tree /usr/bin/time -f "%e s wall %U u %S s" python -m bench.throughput \
     --threads 1 --steps 96 --warmup 3 --batch-size 32 --eval-rows 300 $SET $extra \
     --json "$folder/${name}_$4.json" > "$folder/${name}_$4.log" 2>&1)
done
