#!/usr/bin/env bash
# The main job: train the E2E reference, a 4-block stack and a 4-block diffusion chain on WikiText-2 (lr sweep,
# matched steps and matched FLOPs), score them on the test split, and generate a sample from the stack and the E2E.
# PRESET=cpu-small (default, ~75 min on 2 CPU cores), cpu-mini (minutes), tiny (about a minute), paper (GPU).
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
blocktrain bench quality --preset "$PRESET" --objective both --out "$RUN" --fresh --json "$RUN.json"
field() {  # field KEY... : a value of the result JSON
  python -c 'import functools, json, sys; print(functools.reduce(lambda r, k: r[k], sys.argv[2:], json.load(open(sys.argv[1]))))' "$RUN.json" "$@"
}
STACK=$(field objectives stack run_dir)
E2E=$(field e2e run_dir)
echo "== stack sample ($STACK)"
blocktrain generate "$STACK" --model blocktrain --prompt " = Valkyria Chronicles = " --bytes 200 --no-progress
echo "== E2E sample ($E2E)"
blocktrain generate "$E2E" --model e2e --prompt " = Valkyria Chronicles = " --bytes 200 --no-progress
blocktrain plot "$STACK" "$E2E" --out "$RUN-curves.png"
echo "results: $RUN.json, $RUN.md, $RUN-curves.png"
