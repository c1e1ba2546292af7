#!/bin/bash
# How far does the diffusion chain's per-position noise (9c71f7c) move a trained chain's CE from the per-row noise of
# the committed diffusion figures? One cpu-mini diffusion run (800 steps a block) scored on the first 262,144 test
# bytes by the old code (OLD_SRC: the src/ of a checkout of b5820fd, e.g. `git worktree add /tmp/old b5820fd`) and by
# this one, at eval's batch of 32 windows and at 8 (the old draw moved with the batch), into OUT/*.json.
#   OLD_SRC=/tmp/old/src OUT=runs/noise-shift DATA=../shared/data/wikitext/wikitext-2-v1-tokens \
#     bash benchmarks/quality/noise_shift.sh
set -euo pipefail
: "${OLD_SRC:?set OLD_SRC to the src/ of a checkout of b5820fd}"
OUT=${OUT:-runs/noise-shift}
DATA=${DATA:-../shared/data/wikitext/wikitext-2-v1-tokens}
PY=${PY:-.venv/bin/python}
NEW_SRC=$(pwd)/src
mkdir -p "$OUT"
PYTHONPATH=$NEW_SRC "$PY" -m blocktrain train --preset cpu-mini --objective diffusion --steps 800 --out "$OUT/run" \
  --data "$DATA" --no-progress
for code in old new; do
  src=$NEW_SRC; [ "$code" = old ] && src=$OLD_SRC
  for b in 32 8; do
    PYTHONPATH=$src "$PY" -m blocktrain eval "$OUT/run" --data "$DATA" --split test --max-bytes 262144 --batch-size "$b" \
      --json --no-progress > "$OUT/$code-b$b.json"
  done
done
"$PY" - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
ce = {f"{c}-b{b}": json.load(open(f"{out}/{c}-b{b}.json"))["ce_nats_per_byte"] for c in ("old", "new") for b in (32, 8)}
for k, v in ce.items():
    print(f"{k:8s} {v:.6f}")
print(f"new - old at batch 32: {ce['new-b32'] - ce['old-b32']:+.6f}; old batch 8 - 32: {ce['old-b8'] - ce['old-b32']:+.6f}; "
      f"new batch 8 - 32: {ce['new-b8'] - ce['new-b32']:+.2e}")
PY
