#!/bin/bash
# The main job's finalist configuration (0ecdc45e: SMART lambda 1/5/1, eps 1.15e-5, mu 0.5,
# lr 1.86e-4, dropout 0.074, batch 32) trained alone on one thread, the `small` budget's
# 1,000 training rows a task, at abce43b and at the commit named in its page, one after the
# other on the idle 2-core machine. Rounds 1 and 2: 12 steady schedule steps; round 3: 96
# (one pass over each task's rows, so both trees train the same rows).
#   usage: run.sh BASE_CHECKOUT HEAD_CHECKOUT ROUND STEPS
SET="--set smart_lambda_sst=1 --set smart_lambda_qqp=5 --set smart_lambda_sts=1 --set smart_eps=1.15e-5 --set smart_mu=0.5 --set lr=1.86e-4 --set dropout=0.074 --set max_train_per_task=1000 --set lr_schedule=wsd"
for tree in "$1" "$2"; do
  name=$([ "$tree" = "$1" ] && echo abce43b || echo head)
  (cd "$tree" && PYTHONPATH=$tree python -m bench.throughput --threads 1 --steps "$4" --warmup 3 \
     --batch-size 32 --eval-rows 300 $SET --json "${name}_$3.json" > "${name}_$3.log" 2>&1)
done
