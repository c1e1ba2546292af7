#!/usr/bin/env bash
# The device suite (issue 42): one command that answers speed, depth, volunteers, live trust and serving on one GPU.
#
#   bash scripts/device_suite.sh                          # SUITE=full DEVICE=cuda: one H100/H200, DEADLINE_S (480 s)
#   SUITE=smoke DEVICE=cpu bash scripts/device_suite.sh   # every job at the tiny preset on CPU (tests/test_device_suite.py):
#                                                         # 147 s alone on 2 cores at dd5d5bc (172 s before 1afd97e):
#                                                         # scripts/time_smoke.sh, device-suite-smoke-cpu.json
#   SUITE=rehearsal DEVICE=cpu bash scripts/device_suite.sh   # full's jobs, flags and side-by-side launch at tiny
#                                                             # budgets: run it before a GPU session (about 8 minutes here)
#
# Environment:
#   SUITE    full | smoke | rehearsal
#   DEVICE   cuda | cpu (every job's --device)
#   RESULTS  result folder (default benchmarks/results/device-suite-$SUITE). A second run resumes: a job whose .done
#            marker exists is skipped, the depth rows already in depth.jsonl are not trained again, nor the live rows
#            already in device-live.json (commit or carry the folder, checkpoints aside, to resume on another machine).
#   ARCHIVE  the folder packed as one .tar.gz (default RESULTS.tar.gz; on a lent machine $OUT/device-suite.tar.gz, so
#            that it comes back), every 15 s and at the end: a run cut short still returns what it finished. Model
#            checkpoints (*.safetensors) stay out: they are GBs, and no result needs them.
#   DEADLINE_S  seconds the jobs may take in all (full: 480; 0: no limit): each job's limit is cut to what is left,
#            and a job with under 30 s left is skipped (not marked done: the next run does it); the summaries get a
#            minute more
#   DATA     byte-level data directory (default ../shared/data/wikitext/wikitext-2-v1-tokens). A lent machine has no
#            ../shared: copy the folder into the repository (data/ is git-ignored), carry it with the command, and
#            set DATA=data/wikitext-2-v1-tokens.
#   PYTHON   interpreter (default python3): its own torch is used; nothing is installed from the network.
#   WHEELS   optional folder of wheels, installed with pip --no-index before anything runs: only what the machine
#            lacks (the serving stack; never torch or numpy, which it has). Make it on a machine with the network,
#            for the device machine's Python (3.12 on the lent machines):
#              pip download --only-binary=:all: --python-version 3.12 --implementation cp \
#                  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d wheels \
#                  fastapi uvicorn httptools pydantic opentelemetry-api
#
# Jobs, in priority order (0 and a run alone first: a times the chip; the others run side by side, each under its
# own time limit, writing its results as it finishes):
#   0. checks     the device against the CPU: counter noise bit for bit, TF32, triton            -> device-checks.json
#      noise-speed  the diffusion noise drawn on the device against the host draw it replaced      -> device-noise-speed.json
#      optimizer-speed  a worker's RoundAdamW step against the trainers' (fused) AdamW, per block -> device-optimizer-speed.json
#   a. speed      bench speed on the paper preset and cpu-small, each bf16 run profiled, cpu-small also compiled
#                 with CUDA graphs (reduce-overhead)                                              -> device-speed*.json
#   b. depth      cpu-small stack vs E2E at matched FLOPs, lr x seeds, whole test split           -> depth.jsonl, device-depth.json
#   c. paper      the paper preset at a short budget, one seed                                     -> device-paper.json
#   d. averaging  volunteers at cpu-small: H in {24, 48}, M in {1, 6} vs one machine at 6x batch  -> device-averaging.json
#   e. live       a coordinator (CPU) and GPU workers over loopback, honest and each attack       -> device-live.json
#   f. serve      spec against the AR pipeline over loopback, with generative CE                   -> device-serve.json
#   audit         a GPU worker's pushes replayed on the CPU (a coordinator's), as the audit does, its moments
#                 also derived from earlier rounds: the relative errors the tolerance must cover (item 3) -> device-audit.json
#   summaries  device-depth.json and device-averaging.json from the rows that finished                  (seconds)
#   g. speed-paper-compiled  bench speed on the paper preset under torch.compile, alone, last; opt-in in full
#                 (PAPER_COMPILE_MODE=default): it times the eager arms again, as bench speed always does
#                                                                                    -> device-speed-paper-compiled.json
set -uo pipefail
cd "$(dirname "$0")/.."

SUITE=${SUITE:-full}
DEVICE=${DEVICE:-cuda}
RESULTS=${RESULTS:-benchmarks/results/device-suite-$SUITE}
DATA=${DATA:-../shared/data/wikitext/wikitext-2-v1-tokens}
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export BLOCKTRAIN_DATA="$DATA"
BT=("$PY" -m blocktrain)

case "$SUITE" in
  # full: the lrs middle first (a row cut short loses an edge lr, not the likely best); limits fit DEADLINE_S
  full)  SPEED_PRESETS="paper cpu-small"; DEPTH_PRESET=cpu-small; LRS="2e-3 3e-3 1.5e-3 4e-3 1e-3"; SEEDS="0 1 2"
         LONG_LRS="2e-3 3e-3 1.5e-3"; LONG_SEEDS="0 1"; PAPER_STEPS=300; AVG_PRESET=cpu-small; AVG_STEPS=2400
         AVG_H="24 48"; AVG_SEEDS="0"; AVG_BLOCKS=cold,warm; LIVE_PRESET=cpu-mini; LIVE_STEPS=400; LIVE_H=25; SERVE_PRESET=cpu-small
         SPEED_STEPS=30; TEST_BYTES=0; LIMIT=240; SPEED_COMPILE="cpu-small:reduce-overhead"; PAPER_COMPILE=""; DEADLINE=480
         NOISE_REPS=10; OPT_PRESETS="cpu-mini cpu-small paper"; LONG_PRESET=cpu-small-long; PAPER_PRESET=paper; SERVE_DEFAULT=""
         LIVE_DEFAULT=honest6,sign_flip,scaled_random
         AUDIT_ARGS="--preset cpu-mini --h 25 --blocks 0,1 --precisions bf16,fp32 --derive-rounds 2 --worker-threads 4 --replay-threads 4" ;;
  # smoke: LIMIT 240, as full's: under CI's load (pytest's two workers and mypy beside the suite's own jobs) the serve
  # job, 53 s alone, ran past 150 s and was cut
  smoke) SPEED_PRESETS="tiny"; DEPTH_PRESET=tiny; LRS="2e-3"; SEEDS="0"; LONG_LRS=""; LONG_SEEDS=""; PAPER_STEPS=0
         AVG_PRESET=tiny; AVG_STEPS=20; AVG_H="10"; AVG_SEEDS="0"; AVG_BLOCKS=cold; LIVE_PRESET=tiny; LIVE_STEPS=20; LIVE_H=10
         SERVE_PRESET=tiny; SPEED_STEPS=20; TEST_BYTES=4096; LIMIT=240; SPEED_COMPILE=""; PAPER_COMPILE=""; NOISE_REPS=1; OPT_PRESETS=cpu-mini
         LONG_PRESET=tiny; PAPER_PRESET=tiny; LIVE_DEFAULT=honest6,sign_flip; DEADLINE=0
         AUDIT_ARGS="--preset tiny --h 3 --blocks 0 --precisions fp32 --derive-rounds 1 --worker-threads 1 --replay-threads 1"
         SERVE_DEFAULT="--output-bytes 16 --prompt-bytes 16 --prompts 1 --sweeps 1 --long-output-bytes 0 --tf-bytes 512 --hop-delay-ms 0 --draft-max 4 --base-port 47300" ;;
  rehearsal)  # full's structure at tiny budgets: every job, compile mode and launch of the full suite, on a CPU
              # (but the warm block: tiny trains diffusion, and a warm block needs the stack)
         SPEED_PRESETS="tiny"; DEPTH_PRESET=tiny; LRS="2e-3"; SEEDS="0 1"; LONG_LRS="3e-3"; LONG_SEEDS="0"; PAPER_STEPS=20
         AVG_PRESET=tiny; AVG_STEPS=20; AVG_H="5 10"; AVG_SEEDS="0"; AVG_BLOCKS=cold; LIVE_PRESET=tiny
         LIVE_STEPS=20; LIVE_H=10; SERVE_PRESET=tiny; SPEED_STEPS=20; TEST_BYTES=4096; LIMIT=600
         SPEED_COMPILE="tiny:reduce-overhead"; PAPER_COMPILE=default; NOISE_REPS=1; OPT_PRESETS=cpu-mini; LONG_PRESET=tiny; PAPER_PRESET=tiny
         DEADLINE=0
         LIVE_DEFAULT=""; SERVE_DEFAULT="--output-bytes 16 --prompt-bytes 16 --prompts 1 --sweeps 1 --long-output-bytes 0 --tf-bytes 512 --hop-delay-ms 0 --draft-max 4"
         AUDIT_ARGS="--preset tiny --h 5 --blocks 0 --precisions bf16,fp32 --derive-rounds 2 --worker-threads 1 --replay-threads 1" ;;
  *) echo "SUITE must be full, smoke or rehearsal, got $SUITE" >&2; exit 2 ;;
esac
LIVE_ROWS=${LIVE_ROWS:-$LIVE_DEFAULT}  # the live job's rows (empty: every attack kind)
PAPER_COMPILE=${PAPER_COMPILE_MODE:-$PAPER_COMPILE}  # job g's compile mode (empty: no job g)
DEADLINE_S=${DEADLINE_S:-$DEADLINE}
END=$(( $(date +%s) + DEADLINE_S ))  # (with DEADLINE_S > 0) when every job must have ended
ARCHIVE=${ARCHIVE:-$RESULTS.tar.gz}
SERVE_FLAGS=${SERVE_FLAGS:-$SERVE_DEFAULT}  # bench serve's flags beyond the runs and the device
AVG_ROUNDS=$([ "$SUITE" = full ] && echo 100 || echo 2)  # the whole stack's outer steps per block
# The volunteers' default (issue 43's winner), as the study's flags: the rows measure what the coordinator runs
AVG_FLAGS="--aggregation median --inner-start shared_mv --mean-v --moment-codec factored --share-every 3 --outer nesterov --outer-lr 0.7 --outer-momentum 0.5"

mkdir -p "$RESULTS"
log() { echo "[device-suite $(date +%T)] $*" >&2; }
if [ ! -d "$DATA" ]; then
  log "no data directory at $DATA: copy the byte-level WikiText-2 folder into the repository (data/ is git-ignored), carry it, and set DATA"
  exit 2
fi

if [ -n "${WHEELS:-}" ]; then
  log "installing the wheels in $WHEELS (no network)"
  "$PY" -m pip install --no-index --find-links "$WHEELS" --quiet "$WHEELS"/*.whl || { log "wheel install failed"; exit 2; }
fi
"$PY" -c "import torch, blocktrain; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())" \
  > "$RESULTS/machine.txt" 2>&1 || { cat "$RESULTS/machine.txt" >&2; exit 2; }
"$PY" -c "import fastapi, uvicorn, pydantic, httptools" >> "$RESULTS/machine.txt" 2>&1 \
  || log "the serving stack does not import (see machine.txt): the live and serve jobs will fail; give WHEELS"

pack() {  # the result folder but its checkpoints as one archive, replaced atomically; tar's exit 1 is "a file changed
  # as it was read" (the jobs write all the time): the archive is still whole, so it replaces the last one
  local part="$ARCHIVE.$BASHPID.part"
  tar --exclude='*.safetensors' --exclude='*.part' --exclude='.job-*.pid' --warning=no-file-changed -czf "$part" -C "$(dirname "$RESULTS")" \
    "$(basename "$RESULTS")" 2>/dev/null
  if [ $? -le 1 ]; then mv -f "$part" "$ARCHIVE"; else rm -f "$part"; fi
}
( while sleep 15; do pack; done ) &
PACKER=$!
# a tar the packer had begun goes on alone after the kill: its part file is removed (it writes on, unlinked)
rm -f "$RESULTS"/.job-*.pid  # a killed run's (its pids may be anyone's now)
stop_jobs() {  # the jobs' timeouts still running (a Ctrl-C or a SIGTERM to the suite): their commands end with them
  local f
  for f in "$RESULTS"/.job-*.pid; do [ -f "$f" ] && kill "$(cat "$f")" 2>/dev/null; rm -f "$f"; done
}
trap 'stop_jobs; kill $PACKER 2>/dev/null; pack; rm -f "$ARCHIVE".*.part' EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

left() {  # seconds until the deadline (a large number without one)
  if [ "$DEADLINE_S" -gt 0 ]; then echo $(( END - $(date +%s) )); else echo 1000000; fi
}

job() {  # job NAME SECONDS CMD...: run once under its own limit, cut to the deadline; .done marks a finished job, .rc
  # its exit status
  local name=$1 limit=$2; shift 2
  if [ -f "$RESULTS/$name.done" ]; then log "$name: done already, skipped"; return 0; fi
  local rest; rest=$(left)
  if [ "$rest" -lt 30 ]; then log "$name: skipped, ${rest}s left before the deadline (the next run does it)"; return 0; fi
  if [ "$rest" -lt "$limit" ]; then limit=$rest; fi
  log "$name: start (limit ${limit}s)"
  local t0=$SECONDS
  # timeout leads a process group of its own, which a signal to the suite's group does not reach: the exit trap
  # signals each running one (it passes the signal on to its command's group)
  timeout --kill-after=10 "$limit" "$@" > "$RESULTS/$name.log" 2>&1 &
  local tpid=$!
  echo "$tpid" > "$RESULTS/.job-$name.pid"
  wait "$tpid"
  local rc=$?
  rm -f "$RESULTS/.job-$name.pid"
  echo "$rc $((SECONDS - t0))" > "$RESULTS/$name.rc"
  if [ "$rc" = 0 ]; then touch "$RESULTS/$name.done"; fi
  log "$name: exit $rc after $((SECONDS - t0))s"
  return 0
}

# 0. the device against the CPU, alone (seconds)
job checks 120 "$PY" benchmarks/quality/device_checks.py --device "$DEVICE" --json "$RESULTS/device-checks.json"
job noise-speed 120 "$PY" benchmarks/quality/noise_speed.py --device "$DEVICE" --reps "$NOISE_REPS" \
  --json "$RESULTS/device-noise-speed.json"
OPT_ARGS=(); for p in $OPT_PRESETS; do OPT_ARGS+=(--preset "$p"); done
job optimizer-speed 120 "$PY" benchmarks/quality/optimizer_speed.py --device "$DEVICE" --reps "$((NOISE_REPS * 2))" \
  "${OPT_ARGS[@]}" --json "$RESULTS/device-optimizer-speed.json"

# a. speed, alone; SPEED_COMPILE lists PRESET:MODE pairs also timed under torch.compile
for p in $SPEED_PRESETS; do
  mode=off
  for pair in $SPEED_COMPILE; do [ "${pair%%:*}" = "$p" ] && mode=${pair#*:}; done
  job "speed-$p" "$LIMIT" "${BT[@]}" bench speed --preset "$p" --steps "$SPEED_STEPS" --device "$DEVICE" --data "$DATA" \
    --profile --compile "$mode" --out "$RESULTS/runs/speed-$p" --json "$RESULTS/device-speed-$p.json"
done

# b. depth: one bench per (preset, lr, seed), each a row of depth.jsonl (rows already there are skipped); then the summary
depth_rows() {  # one preset's rows for one seed (appending whole lines to depth.jsonl: safe side by side)
  # shellcheck disable=SC2086  # the lr list splits into words
  "$PY" benchmarks/quality/device_depth.py rows --preset "$1" --lrs $2 --seeds $3 --device "$DEVICE" --data "$DATA" \
    --max-eval-bytes "$TEST_BYTES" --runs "$RESULTS/runs" --jsonl "$RESULTS/depth.jsonl" --timeout "$LIMIT"
}  # its log is the job's, depth.log; each bench's own is runs/depth-KEY.log
depth() {  # a process per seed, side by side; the long preset's after (the summary is job "summaries"); fails if any
  # seed's rows did (a job marked done is not run again)
  local pids=() s p rc=0
  for s in $SEEDS; do depth_rows "$DEPTH_PRESET" "$LRS" "$s" & pids+=($!); done
  for p in "${pids[@]}"; do wait "$p" || rc=1; done
  if [ -n "$LONG_LRS" ]; then
    pids=(); for s in $LONG_SEEDS; do depth_rows "$LONG_PRESET" "$LONG_LRS" "$s" & pids+=($!); done
    for p in "${pids[@]}"; do wait "$p" || rc=1; done
  fi
  return $rc
}
summaries() {  # what the rows that finished say, whatever the jobs' fate
  if [ "$SUITE" != smoke ]; then  # these ran beside the other jobs on one GPU: their times are not the chip's alone
    for f in "$RESULTS/device-serve.json" "$RESULTS/device-paper.json"; do
      if [ -s "$f" ]; then
        "$PY" -c 'import json, os, sys
p = sys.argv[1]; d = json.load(open(p))
d["shared_device"] = "run beside the depth, averaging, live and audit jobs on the same GPU: its CE figures stand, its times are not the chip alone"
open(p + ".tmp", "w").write(json.dumps(d, indent=2)); os.replace(p + ".tmp", p)' "$f"
      fi
    done
  fi
  if [ -s "$RESULTS/depth.jsonl" ]; then
    "$PY" benchmarks/quality/device_depth.py summary --jsonl "$RESULTS/depth.jsonl" --json "$RESULTS/device-depth.json"
  fi
  if [ -s "$RESULTS/averaging.jsonl" ]; then
    "$PY" benchmarks/distributed/averaging_scaling.py --preset "$AVG_PRESET" --steps "$AVG_STEPS" --table-only \
      --jsonl "$RESULTS/averaging.jsonl" --json "$RESULTS/device-averaging.json"
  fi
}

paper() {
  "${BT[@]}" bench quality --preset "$PAPER_PRESET" --objective stack --steps "$PAPER_STEPS" --no-lr-sweep --no-matched-steps \
    --isolate no --device "$DEVICE" --data "$DATA" --out "$RESULTS/runs/paper" --resume --no-progress \
    --json "$RESULTS/device-paper.json"
}

averaging() {
  # shellcheck disable=SC2086  # AVG_FLAGS: several flags
  for h in $AVG_H; do
    "$PY" benchmarks/distributed/averaging_scaling.py --preset "$AVG_PRESET" --steps "$AVG_STEPS" --h "$h" $AVG_FLAGS \
      --workers 1,6 --blocks "$AVG_BLOCKS" --seeds "$AVG_SEEDS" --device "$DEVICE" --data "$DATA" --no-progress \
      --cache "$RESULTS/runs/averaging-cache" --jsonl "$RESULTS/averaging.jsonl" || return 1
  done
  # shellcheck disable=SC2086
  "$PY" benchmarks/distributed/averaging_scaling.py --preset "$AVG_PRESET" --stack --rounds "$AVG_ROUNDS" --workers 6 \
    $AVG_FLAGS --seeds 0 --device "$DEVICE" --data "$DATA" --no-progress --jsonl "$RESULTS/averaging.jsonl"
}  # its table is job "summaries"

live() {
  "$PY" benchmarks/distributed/hostile_http.py --preset "$LIVE_PRESET" --steps "$LIVE_STEPS" --h "$LIVE_H" \
    --device "$DEVICE" --data "$DATA" --work "$RESULTS/runs/live" --out "$RESULTS/device-live.json" \
    --timeout-s "$LIMIT" --skip-done ${LIVE_ROWS:+--rows "$LIVE_ROWS"}
}

audit() {  # the worker on the device, its replays on the CPU (and on the device), in both arithmetics
  # shellcheck disable=SC2086  # AUDIT_ARGS splits into flags
  "$PY" benchmarks/distributed/audit_replay.py $AUDIT_ARGS --cross --worker-device "$DEVICE" --replay-device cpu \
    --data "$DATA" --json "$RESULTS/device-audit.json"
}

serve() {  # bench serve's rows: sweep and ar on a diffusion run beside its E2E pipeline, spec on a stack run
  local run="$RESULTS/runs/serve" stack="$RESULTS/runs/serve-stack"
  "${BT[@]}" train --preset "$SERVE_PRESET" --objective diffusion --device "$DEVICE" --data "$DATA" --out "$run" \
    --no-progress || return 1
  "${BT[@]}" train-e2e --preset "$SERVE_PRESET" --objective diffusion --device "$DEVICE" --data "$DATA" --out "$run" \
    --no-progress || return 1
  "${BT[@]}" train --preset "$SERVE_PRESET" --objective stack --device "$DEVICE" --data "$DATA" --out "$stack" \
    --no-progress || return 1
  "${BT[@]}" bench serve --run "$run" --stack-run "$stack" --device "$DEVICE" --data "$DATA" \
    --json "$RESULTS/device-serve.json" ${SERVE_FLAGS:-}
}

if [ "$SUITE" = smoke ]; then  # two cores: one job at a time
  job depth "$LIMIT" bash -c "$(declare -f depth depth_rows); $(declare -p RESULTS LRS SEEDS LONG_LRS LONG_SEEDS LONG_PRESET DEPTH_PRESET LIMIT DEVICE DATA TEST_BYTES PY BT); depth"
  job averaging "$LIMIT" bash -c "$(declare -f averaging); $(declare -p RESULTS AVG_PRESET AVG_STEPS AVG_H AVG_SEEDS AVG_BLOCKS AVG_ROUNDS AVG_FLAGS DEVICE DATA PY); averaging"
  job live "$LIMIT" bash -c "$(declare -f live); $(declare -p RESULTS LIVE_PRESET LIVE_STEPS LIVE_H DEVICE DATA LIMIT PY LIVE_ROWS); live"
  job serve "$LIMIT" bash -c "$(declare -f serve); $(declare -p RESULTS SERVE_PRESET DEVICE DATA PY BT SERVE_FLAGS); serve"
  job audit "$LIMIT" bash -c "$(declare -f audit); $(declare -p RESULTS AUDIT_ARGS DEVICE DATA PY); audit"
else  # launch-bound jobs side by side (16 cores, one GPU), each under its own limit
  pids=()
  job depth "$LIMIT" bash -c "$(declare -f depth depth_rows); $(declare -p RESULTS LRS SEEDS LONG_LRS LONG_SEEDS LONG_PRESET DEPTH_PRESET LIMIT DEVICE DATA TEST_BYTES PY BT); depth" &
  pids+=($!)
  job paper "$LIMIT" bash -c "$(declare -f paper); $(declare -p RESULTS PAPER_PRESET PAPER_STEPS DEVICE DATA BT); paper" &
  pids+=($!)
  job averaging "$LIMIT" bash -c "$(declare -f averaging); $(declare -p RESULTS AVG_PRESET AVG_STEPS AVG_H AVG_SEEDS AVG_BLOCKS AVG_ROUNDS AVG_FLAGS DEVICE DATA PY); averaging" &
  pids+=($!)
  job live "$LIMIT" bash -c "$(declare -f live); $(declare -p RESULTS LIVE_PRESET LIVE_STEPS LIVE_H DEVICE DATA LIMIT PY LIVE_ROWS); live" &
  pids+=($!)
  job serve "$LIMIT" bash -c "$(declare -f serve); $(declare -p RESULTS SERVE_PRESET DEVICE DATA PY BT SERVE_FLAGS); serve" &
  pids+=($!)
  job audit "$LIMIT" bash -c "$(declare -f audit); $(declare -p RESULTS AUDIT_ARGS DEVICE DATA PY); audit" &
  pids+=($!)
  wait "${pids[@]}"  # these jobs only: a bare wait would wait for the packer, which never ends
fi
rm -f "$RESULTS/summaries.done"  # the summaries follow the rows: made again by every run
EXTRA=$([ "$SUITE" = smoke ] && echo 0 || echo 60)  # side by side: the summaries' minute past the jobs' deadline
END=$(( END + EXTRA ))
job summaries 60 bash -c "$(declare -f summaries); $(declare -p RESULTS AVG_PRESET AVG_STEPS PY SUITE); summaries"
END=$(( END - EXTRA ))
# g. the paper preset compiled, alone again: the last priority, opt-in (it times the eager arms again; never in smoke)
if [ -n "$PAPER_COMPILE" ]; then
  job speed-paper-compiled "$LIMIT" "${BT[@]}" bench speed --preset "$PAPER_PRESET" --steps "$SPEED_STEPS" --device "$DEVICE" \
    --data "$DATA" --profile --compile "$PAPER_COMPILE" --out "$RESULTS/runs/speed-paper-compiled" \
    --json "$RESULTS/device-speed-paper-compiled.json"
fi
log "finished; results in $RESULTS (and $ARCHIVE)"
for f in "$RESULTS"/*.rc; do echo "$(basename "$f" .rc) $(cat "$f")"; done
