#!/bin/bash
# The main job at abce43b, then at the commit named in main_job.md, then that commit again
# on abce43b's four draws (abce43b_draws.json: its trials' configurations, in their order),
# one after the other on the idle 2-core machine.
#   usage: run.sh ABCE43B_CHECKOUT HEAD_CHECKOUT STORAGE
set -e
for tree in "$1" "$2"; do
  name=$([ "$tree" = "$1" ] && echo abce43b || echo head)
  (cd "$tree" && /usr/bin/time -v env PYTHONPATH="$tree" python tune_driver.py --space smart \
     --storage-path "$3/$name" --experiment smart-small-sitting > "$3/$name.log" 2>&1)
done
(cd "$2" && /usr/bin/time -v env PYTHONPATH="$2" python tune_driver.py --space smart \
   --points "$2/docs/bench/main_job_cpu_sitting/abce43b_draws.json" --num-samples 4 \
   --storage-path "$3/points" --experiment smart-small-abce-draws > "$3/points.log" 2>&1)
