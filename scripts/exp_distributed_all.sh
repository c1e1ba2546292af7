#!/usr/bin/env bash
# All committed distributed-training measurements, in sequence (take the CPU lock once):
#   flock /tmp/blocktrain-cpu.lock scripts/exp_distributed_all.sh
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p benchmarks/results runs
echo "== six workers"; date -u
scripts/exp_six_workers.sh
echo "== three hosts"; date -u
scripts/netns_three_hosts.sh
echo "== ingest bench (cpu-small block, fp32 deltas)"; date -u
OMP_NUM_THREADS=1 .venv/bin/python benchmarks/data/ingest.py --preset cpu-small --updates 24 --compress none \
  --json benchmarks/results/ingest.json
date -u
