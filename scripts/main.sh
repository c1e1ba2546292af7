#!/usr/bin/env bash
# The main job: train the E2E reference, a 4-block stack and a 4-block diffusion chain on WikiText-2 (lr sweep,
# matched steps and matched FLOPs), score them on the test split, and generate a sample from the stack and the E2E.
# PRESET=cpu-quick (the default), tiny (the quick check), cpu-mini, cpu-small (the committed benchmark), paper (GPU).
# The durations of each, measured on a fresh clone, are in benchmarks/results/readme-timings.json.
set -euo pipefail
cd "$(dirname "$0")/.."
START=$SECONDS
phase() {  # phase NAME COMMAND... : run one phase and print one summary line, in a log as on a terminal
  local name=$1 t0=$SECONDS; shift
  echo "== $name"
  "$@"
  echo "== $name: done in $((SECONDS - t0)) s (total $((SECONDS - START)) s)"
}
phase "setup" bash scripts/setup.sh
. .venv/bin/activate
PRESET=${PRESET:-cpu-quick}
# Data: --data/BLOCKTRAIN_DATA if set; else the project's read-only copy when present; else cache/download.
if [ -z "${BLOCKTRAIN_DATA:-}" ] && [ -d ../shared/data/wikitext/wikitext-2-v1-tokens ]; then
  export BLOCKTRAIN_DATA=$(cd ../shared/data/wikitext/wikitext-2-v1-tokens && pwd)
fi
if [ -z "${BLOCKTRAIN_DATA:-}" ]; then
  python -m pip install -q -e ".[download]"
fi
RUN=runs/main-$PRESET
phase "bench quality ($PRESET: E2E, stack and diffusion; the ETA is on the training bar)" \
  blocktrain bench quality --preset "$PRESET" --objective both --out "$RUN" --fresh --json "$RUN.json"
field() {  # field KEY... : a value of the result JSON
  python -c 'import functools, json, sys; print(functools.reduce(lambda r, k: r[k], sys.argv[2:], json.load(open(sys.argv[1]))))' "$RUN.json" "$@"
}
STACK=$(field objectives stack run_dir)
E2E=$(field e2e run_dir)
phase "stack sample ($STACK)" \
  blocktrain generate "$STACK" --model blocktrain --prompt " = Valkyria Chronicles = " --bytes 200 --no-progress
phase "E2E sample ($E2E)" \
  blocktrain generate "$E2E" --model e2e --prompt " = Valkyria Chronicles = " --bytes 200 --no-progress
phase "curves" blocktrain plot "$STACK" "$E2E" --out "$RUN-curves.png"
echo "results: $RUN.json, $RUN.md, $RUN-curves.png (main job done in $((SECONDS - START)) s)"
