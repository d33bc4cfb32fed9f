#!/bin/bash
# The model's training speed under transformers' Trainer (the HF peers' path: the project's
# model and loss, no project batching) at beb39ba (the peers' runs of 2026-11-28) and at
# ab884e0, one after the other on the idle 2-core machine, 2 threads, 12 steps a row.
#   usage: run.sh BEB39BA_CHECKOUT AB884E0_CHECKOUT
for tree in "$1" "$2"; do
  (cd "$tree" && PYTHONPATH=$tree python -m bench.throughput --mode tasks --steps 12 --threads 2 \
     > "$(git -C "$tree" rev-parse --short HEAD).log" 2>&1)
done
