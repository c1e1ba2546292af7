#!/bin/bash
# Later blocks at a lower lr, on a finished block 0: blocks 1..3 of a stack run are trained again at peak lr LR (each
# argument) on a copy of the run's block 0, then the composed model and its prefixes are scored on the whole test
# split (bf16, as bench quality scores on a CPU with bf16). Used for stack.lr_later: the same schedule as
# `--lr-later LR/LR0` up to the float rounding of the lr. Run from the repository root:
#
#   SRC=runs/depth/depth-cpu-small-long-lr1e-3-seed0/stack-lr0.001 OUT=runs/lr-probe \
#     bash benchmarks/quality/later_lr_probe.sh 7e-4 5e-4
#
# Writes OUT/later-LR/{eval-test.json,timing.json} and the blocks' metrics (their val_prefix_ce) under OUT/later-LR.
set -euo pipefail
: "${SRC:?SRC names the stack run whose block 0 is kept: a bench quality row stack-lr folder}"
OUT=${OUT:-runs/lr-probe}
PRESET=${PRESET:-cpu-small-long}
SEED=${SEED:-0}
DATA=${DATA:-../shared/data/wikitext/wikitext-2-v1-tokens}
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
for LR in "$@"; do
  P="$OUT/later-$LR"
  rm -rf "$P"; mkdir -p "$P/blocks" "$P/metrics"
  cp "$SRC/run.json" "$P/"; cp "$SRC/blocks/block_0.safetensors" "$SRC/blocks/block_0.state.safetensors" "$P/blocks/"
  cp "$SRC/metrics/block_0.jsonl" "$P/metrics/"
  t0=$(date +%s)
  for k in 1 2 3; do
    "$PY" -m blocktrain train-block --preset "$PRESET" --objective stack --lr "$LR" --seed "$SEED" --device cpu \
      --data "$DATA" --out "$P" --block $k --no-progress
  done
  t1=$(date +%s)
  "$PY" -m blocktrain eval "$P" --split test --precision bf16 --blocks-alone --json --no-progress --data "$DATA" \
    > "$P/eval-test.json"
  echo "{\"lr_later\": \"$LR\", \"train_s\": $((t1-t0)), \"eval_s\": $(( $(date +%s)-t1 ))}" > "$P/timing.json"
  echo "later blocks at $LR: $(cat "$P/timing.json")"
done
