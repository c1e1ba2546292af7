#!/usr/bin/env bash
# The equal-samples reference of the six-worker stack run: one machine at six times the batch
# (96 sequences per step), the same steps per block, recipe and test bytes. Writes
# benchmarks/results/six-workers-stack-batch96-reference.json (RESULT to override), reading the six-worker
# result it compares with from SIX (default benchmarks/results/six-workers-stack.json).
#
#   flock /tmp/blocktrain-cpu.lock scripts/exp_batch96_reference.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PRESET=${PRESET:-cpu-mini}
STEPS=${STEPS:-400}
EVAL_BYTES=${EVAL_BYTES:-32768}
DATA=${DATA:-$(cd ../shared/data/wikitext/wikitext-2-v1-tokens && pwd)}  # the shared WikiText-2 beside the repository
OUT=${OUT:-runs/six-ref-b96}
SIX=${SIX:-benchmarks/results/six-workers-stack.json}
RESULT=${RESULT:-benchmarks/results/six-workers-stack-batch96-reference.json}
BT=".venv/bin/blocktrain"
rm -rf "$OUT"; mkdir -p "$(dirname "$OUT")"
OMP_NUM_THREADS=2 $BT train --preset "$PRESET" --objective stack --steps "$STEPS" --batch-size 96 --data "$DATA" \
  --out "$OUT" --no-progress 2> "$OUT.log"
OMP_NUM_THREADS=2 $BT eval "$OUT" --model blocktrain --split test --data "$DATA" --max-bytes "$EVAL_BYTES" --json \
  --no-progress > "$OUT.eval.json"
.venv/bin/python - "$OUT.eval.json" "$SIX" "$RESULT" "$PRESET" "$STEPS" "$EVAL_BYTES" <<'PY'
import json, sys
ev_path, six_path, out, preset, steps, nbytes = sys.argv[1:]
ev = json.load(open(ev_path))
six = json.load(open(six_path))
doc = {
    "what": f"single-machine stack run on {preset} at six times the batch (96 sequences per step), {steps} steps per "
            "block: the equal-samples reference for the six-worker stack run, whose six workers all train the open block",
    "ce_nats_per_byte": ev["ce_nats_per_byte"],
    "bytes_scored": ev["bytes_scored"],
    "split": "test",
    "six_worker_ce_nats_per_byte": six["six_worker_ce_nats_per_byte"],
    "single_batch16_ce_nats_per_byte": six["single_machine_ce_nats_per_byte"],
    "six_worker_gap_nats_per_byte": six["six_worker_ce_nats_per_byte"] - ev["ce_nats_per_byte"],
    "eval": ev,
    "command": f"PRESET={preset} STEPS={steps} EVAL_BYTES={nbytes} flock /tmp/blocktrain-cpu.lock scripts/exp_batch96_reference.sh",
}
json.dump(doc, open(out, "w"), indent=1)
print(f"batch-96 reference {ev['ce_nats_per_byte']:.4f}; six workers {six['six_worker_ce_nats_per_byte']:.4f} "
      f"(gap {doc['six_worker_gap_nats_per_byte']:+.4f})")
PY
