#!/usr/bin/env bash
# The main job: train a 4-block BlockTrain model and the E2E reference on WikiText-2 at matched
# compute, evaluate both on the test split, and generate a sample from each.
# PRESET=cpu-small (default, ~1 h on 2 CPU cores), cpu-mini (minutes), tiny (seconds), paper (GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
PRESET=${PRESET:-cpu-small}
# Data: --data/BLOCKTRAIN_DATA if set; else the project's read-only copy when present; else cache/download.
if [ -z "${BLOCKTRAIN_DATA:-}" ] && [ -d ../shared/data/wikitext/wikitext-2-v1-tokens ]; then
  export BLOCKTRAIN_DATA=$(cd ../shared/data/wikitext/wikitext-2-v1-tokens && pwd)
fi
if [ -z "${BLOCKTRAIN_DATA:-}" ]; then
  python -m pip install -q -e ".[download]"
fi
RUN=runs/main-$PRESET
blocktrain bench quality --preset "$PRESET" --out "$RUN" --fresh --json "$RUN.json"
echo "== BlockTrain sample"
blocktrain generate "$RUN" --model blocktrain --prompt " = Valkyria Chronicles = " --bytes 200 --no-progress
echo "== E2E sample"
blocktrain generate "$RUN" --model e2e --prompt " = Valkyria Chronicles = " --bytes 200 --no-progress
blocktrain plot "$RUN" --out "$RUN-curves.png"
echo "results: $RUN.json, $RUN.md, $RUN-curves.png"
