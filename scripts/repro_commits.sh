#!/usr/bin/env bash
# Run `blocktrain bench quality` at two commits, one after the other on this machine, and compare every float field
# of their results (a refactor that changes no number reproduces them all):
#   BEFORE=445e5c8 AFTER=HEAD PRESETS="tiny cpu-quick" OUT=benchmarks/results/house-refactor-repro.json \
#     flock /tmp/blocktrain-cpu.lock bash scripts/repro_commits.sh
# Each commit runs in its own git worktree under $WORK (default /tmp/repro-commits) with this checkout's .venv and
# its own sources first on PYTHONPATH; DATA defaults to the shared WikiText-2 tokens. Timing fields are not compared.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
BEFORE=${BEFORE:?set BEFORE to a commit}; AFTER=${AFTER:-HEAD}; PRESETS=${PRESETS:-"tiny cpu-quick"}
OUT=${OUT:?set OUT to the result JSON}; WORK=${WORK:-/tmp/repro-commits}
DATA=${DATA:-$ROOT/../shared/data/wikitext/wikitext-2-v1-tokens}
mkdir -p "$WORK"
for side in $([ "${COMPARE_ONLY:-0}" = 1 ] || echo before after); do  # COMPARE_ONLY=1: compare $WORK's results again
  commit=$([ $side = before ] && echo "$BEFORE" || echo "$AFTER")
  tree="$WORK/$side"
  [ -d "$tree" ] && git worktree remove --force "$tree"
  git worktree add -q --detach "$tree" "$commit"
  for p in $PRESETS; do
    echo "== $side ($commit): bench quality --preset $p"
    (cd "$tree" && PYTHONPATH="$tree/src:$tree" BLOCKTRAIN_DATA="$DATA" "$ROOT/.venv/bin/python" -m blocktrain bench quality \
      --preset "$p" --objective both --out "$WORK/runs/$side-$p" --fresh --json "$WORK/$side-$p.json" --no-progress)
  done
done
"$ROOT/.venv/bin/python" - "$OUT" "$BEFORE" "$AFTER" $PRESETS <<'PY'
import json, subprocess, sys
out, before, after, *presets = sys.argv[1:]
work = __import__("os").environ.get("WORK", "/tmp/repro-commits")
TIMINGS = ("wall", "seconds", "_s_", "mfu", "peak", "per_s", "memory", "mib")
def floats(x, path=""):
    if isinstance(x, float):
        yield path, x
    elif isinstance(x, dict):
        for k, v in x.items():
            if not any(t in k for t in TIMINGS):  # a speed figure, not a result of the arithmetic
                yield from floats(v, f"{path}/{k}")
    elif isinstance(x, list):
        for i, v in enumerate(x):
            yield from floats(v, f"{path}/{i}")
rev = lambda c: subprocess.run(["git", "rev-parse", "--short", c], capture_output=True, text=True).stdout.strip()
doc = {"what": "blocktrain bench quality at two commits, one after the other on this machine: every float field "
               "of the results but timings", "before_commit": rev(before), "after_commit": rev(after),
       "command": "BEFORE=%s AFTER=%s PRESETS='%s' bash scripts/repro_commits.sh" % (before, after, " ".join(presets)),
       "presets": {}}
for p in presets:
    a = dict(floats(json.load(open(f"{work}/before-{p}.json"))))
    b = dict(floats(json.load(open(f"{work}/after-{p}.json"))))
    keys = sorted(set(a) & set(b))
    differ = {k: [a[k], b[k]] for k in keys if a[k] != b[k]}
    doc["presets"][p] = {"float_fields_compared": len(keys), "equal": len(keys) - len(differ), "differ": differ,
                         "stack_ce": [a.get("/objectives/stack/ce_nats_per_byte"), b.get("/objectives/stack/ce_nats_per_byte")]}
    print(p, len(keys) - len(differ), "of", len(keys), "equal")
open(out, "w").write(json.dumps(doc, indent=1) + "\n")
PY
