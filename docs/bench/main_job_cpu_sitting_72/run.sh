#!/bin/bash
# The main job (README's search: --space smart, its defaults: budget small, 8 trials) at
# 6d4724d (before #72), then at b103b70, one after the other on the idle 2-core machine
# (2026-12-08, 03:55 to 04:23 UTC). Each checkout's own precision: 6d4724d has no bf16 on
# the CPU (float32); b103b70 trains in bf16 where the CPU has it.
#   usage: run.sh 6D4724D_TREE B103B70_TREE STORAGE
for pair in "6d4724d:$1" "b103b70:$2"; do
  name=${pair%%:*}; tree=${pair#*:}
  (cd "$tree" && /usr/bin/time -f "%e s wall %U u %S s" env PYTHONPATH="$tree" python tune_driver.py \
     --space smart --storage-path "$3/$name" --experiment smart-small-sitting > "$3/$name.log" 2>&1)
done
