#!/usr/bin/env bash
# Times the device suite's smoke alone on this machine, on the synthetic corpus its test uses
# (tests/distributed_utils.write_corpus), and writes each job's exit status and seconds with the whole wall time:
#
#   flock /tmp/blocktrain-cpu.lock bash scripts/time_smoke.sh [OUT.json]   # default benchmarks/results/device-suite-smoke-cpu.json
#
# Run it alone (no other training, benchmark or test suite): issue 42 asks the smoke to take at most 3 minutes on 2
# cores, and docs/usage.md quotes this file.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-benchmarks/results/device-suite-smoke-cpu.json}
PY=${PYTHON:-.venv/bin/python}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
"$PY" -c "import sys; sys.path.insert(0, '.'); from pathlib import Path; from tests.distributed_utils import write_corpus
write_corpus(Path(sys.argv[1]))" "$WORK/data"
t0=$(date +%s.%N)
SUITE=smoke DEVICE=cpu RESULTS="$WORK/device-suite" DATA="$WORK/data" PYTHON="$PY" OMP_NUM_THREADS=1 \
  bash scripts/device_suite.sh 2> "$WORK/suite.log"
t1=$(date +%s.%N)
"$PY" - "$WORK/device-suite" "$t0" "$t1" "$OUT" "$(git describe --always --dirty)" <<'EOF'
import json, os, platform, sys
from pathlib import Path

results, t0, t1, out, rev = Path(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]), Path(sys.argv[4]), sys.argv[5]
jobs = {}
for f in sorted(results.glob("*.rc")):
    rc, seconds = f.read_text().split()
    jobs[f.stem] = {"exit": int(rc), "seconds": int(seconds)}
model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "")
doc = {"what": "the device suite's smoke (SUITE=smoke DEVICE=cpu), alone, on the synthetic corpus of its test",
       "wall_s": round(t1 - t0, 1), "jobs": jobs, "commit": rev,
       "machine": {"cpu": model, "cores": os.cpu_count(), "python": platform.python_version()},
       "command": "flock /tmp/blocktrain-cpu.lock bash scripts/time_smoke.sh"}
out.write_text(json.dumps(doc, indent=1) + "\n")
print(f"smoke: {doc['wall_s']:.0f} s; " + ", ".join(f"{k} {v['seconds']} s (exit {v['exit']})" for k, v in jobs.items()))
EOF
