#!/usr/bin/env bash
# Create .venv (if needed) and install BlockTrain with its dev tools (EXTRAS: the optional extras, default dev;
# scripts/test.sh adds hivemind).
# TORCH_SPEC overrides the torch requirement (default: torch==2.13.0, the CPU build
# cached on the project's machines; a user with a GPU can set e.g. TORCH_SPEC=torch).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
# Installed already for this pyproject.toml (the stamp holds its digest): nothing to do.
STAMP=.venv/.blocktrain-installed
EXTRAS=${EXTRAS:-dev}
WANT="$(sha256sum pyproject.toml | cut -d' ' -f1) $EXTRAS"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ] && python -c "import importlib.util as u, sys; sys.exit(not (u.find_spec('torch') and u.find_spec('blocktrain')))"; then
  exit 0
fi
python -m pip install -q --upgrade pip 2>/dev/null || true
if ! python -c "import torch" 2>/dev/null; then
  python -m pip install -q "${TORCH_SPEC:-torch==2.13.0}"
fi
python -m pip install -q -e ".[$EXTRAS]"
echo "$WANT" > "$STAMP"
