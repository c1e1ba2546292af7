#!/usr/bin/env bash
# A tour of the whole system on one machine, over loopback: a coordinator and three workers train a 4-block stack,
# the result is scored, two pipeline stages serve it, and an OpenAI-style gateway answers a chat sent by the openai
# client. Every step says what it does and where to look. TOUR_PRESET=tiny for a one-minute check (the test suite's).
#   bash scripts/tour.sh                 # cpu-quick, 3 workers, ROUNDS rounds of H steps per block
#   TOUR_PRESET=tiny ROUNDS=2 H=5 bash scripts/tour.sh
# Measured alone on 2 cores: 180 s (benchmarks/results/readme-timing-tour.log).
set -euo pipefail
cd "$(dirname "$0")/.."
START=$SECONDS
PRESET=${TOUR_PRESET:-cpu-quick}
ROUNDS=${ROUNDS:-10}          # rounds each block trains
H=${H:-10}                    # inner steps per round
WORKERS=${WORKERS:-3}
OUT=${TOUR_OUT:-runs/tour}
step() { echo; echo "== [$((SECONDS - START)) s] $*"; }
free_port() { python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

VENV=${VENV:-.venv}           # the environment scripts/setup.sh makes (installed here when missing)
if [ ! -x "$VENV/bin/blocktrain" ]; then step "installing (scripts/setup.sh)"; bash scripts/setup.sh; VENV=.venv; fi
. "$VENV/bin/activate"
if [ -z "${BLOCKTRAIN_DATA:-}" ] && [ -d ../shared/data/wikitext/wikitext-2-v1-tokens ]; then
  export BLOCKTRAIN_DATA=$(cd ../shared/data/wikitext/wikitext-2-v1-tokens && pwd)
fi
if [ -z "${BLOCKTRAIN_DATA:-}" ]; then python -m pip install -q -e ".[download]"; fi

rm -rf "$OUT"; mkdir -p "$OUT/logs"
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT
wait_for() {  # wait_for WHAT SECONDS COMMAND... : poll until the command succeeds
  local what=$1 limit=$2 t0=$SECONDS; shift 2
  until "$@" > /dev/null 2>&1; do
    if (( SECONDS - t0 > limit )); then echo "$what did not come up within $limit s; see $OUT/logs" >&2; exit 1; fi
    sleep 0.5
  done
}

step "1. a coordinator for a $PRESET stack: $ROUNDS rounds of H=$H steps per block, blocks trained in order"
PORT=$(free_port)
for i in $(seq 1 "$WORKERS"); do blocktrain token add "w$i" --run-dir "$OUT/coord" > "$OUT/w$i.token" 2>> "$OUT/logs/tokens.log"; done
OMP_NUM_THREADS=1 blocktrain coordinator --run-dir "$OUT/coord" --preset "$PRESET" --objective stack \
  --rounds "$ROUNDS" --local-steps "$H" --host 127.0.0.1 --port "$PORT" --threads 1 --eval-bytes 4096 \
  2> "$OUT/logs/coordinator.log" &
PIDS+=($!)
wait_for "the coordinator" 60 curl -sf "http://127.0.0.1:$PORT/v1/status"
echo "   dashboard  http://127.0.0.1:$PORT/        (open it in a browser while the workers train)"
echo "   status     curl -s http://127.0.0.1:$PORT/v1/status"
echo "   metrics    curl -s http://127.0.0.1:$PORT/metrics"
echo "   log        $OUT/logs/coordinator.log; worker tokens in $OUT/w*.token"

cat > "$OUT/status.py" <<'EOF'
import json, sys
s = json.load(sys.stdin)
blocks = "  ".join(f"block {b['block']} {b['state']} v{b['version']}" for b in s["blocks"])
ce = s.get("latest_eval_ce")
print("   " + blocks + (f"   latest eval CE {ce:.3f} nats/byte" if ce is not None else ""))
EOF

step "2. $WORKERS workers join with their tokens; each trains the open block and pushes int8 deltas"
WPIDS=()
for i in $(seq 1 "$WORKERS"); do
  OMP_NUM_THREADS=1 BLOCKTRAIN_TOKEN=$(cat "$OUT/w$i.token") blocktrain worker \
    --coordinator "http://127.0.0.1:$PORT" --local-steps "$H" --threads 1 --no-progress \
    --frozen-cache "$OUT/frozen-cache" --summary-json "$OUT/w$i.summary.json" 2> "$OUT/logs/w$i.log" &
  WPIDS+=($!); PIDS+=($!)
done
echo "   logs       $OUT/logs/w1.log ... w$WORKERS.log"
status_line() {
  curl -sf "http://127.0.0.1:$PORT/v1/status" | python "$OUT/status.py" || true
}
while kill -0 "${WPIDS[@]}" 2> /dev/null; do
  status_line; sleep 10
done
for p in "${WPIDS[@]}"; do wait "$p"; done
status_line

step "3. the trained stack, scored on test bytes (blocktrain eval $OUT/coord)"
blocktrain eval "$OUT/coord" --split test --max-bytes 32768 --no-progress

step "4. two pipeline stages serve it: blocks 0-1 and blocks 2-3, in a ring over TCP"
S0=$(free_port); S1=$(free_port)
blocktrain serve --run "$OUT/coord" --blocks 0-1 --listen "127.0.0.1:$S0" --next "127.0.0.1:$S1" --threads 1 \
  2> "$OUT/logs/stage0.log" &
PIDS+=($!)
blocktrain serve --run "$OUT/coord" --blocks 2-3 --listen "127.0.0.1:$S1" --next "127.0.0.1:$S0" --threads 1 \
  2> "$OUT/logs/stage1.log" &
PIDS+=($!)
echo "   logs       $OUT/logs/stage0.log, stage1.log"

step "5. an OpenAI-style gateway in front of stage 0"
G=$(free_port)
blocktrain gateway --pipeline "127.0.0.1:$S0" --listen "127.0.0.1:$G" > "$OUT/logs/gateway.log" 2>&1 &
PIDS+=($!)
wait_for "the gateway" 120 curl -sf "http://127.0.0.1:$G/v1/models"
echo "   models     curl -s http://127.0.0.1:$G/v1/models"
echo "   log        $OUT/logs/gateway.log"

step "6. a chat through the openai client (default mode: speculative decoding, stage 0 drafts)"
python - "$G" <<'EOF'
import sys

import openai

client = openai.OpenAI(base_url=f"http://127.0.0.1:{sys.argv[1]}/v1", api_key="none")
model = client.models.list().data[0].id
messages = [{"role": "user", "content": "Tell me about the Valkyria Chronicles game."}]
print(f"   user       {messages[0]['content']}")
reply = client.chat.completions.create(model=model, messages=messages, max_tokens=120, temperature=0.8, seed=1)
print(f"   assistant  {reply.choices[0].message.content!r}")
extra = reply.model_extra or {}
print(f"   ({reply.usage.completion_tokens} bytes; mode {extra.get('blocktrain', {}).get('mode')}; "
      "a byte-level model this small writes WikiText-like text, not answers)")
EOF

step "tour done in $((SECONDS - START)) s; everything it wrote is under $OUT"
