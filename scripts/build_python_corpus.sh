#!/usr/bin/env bash
# A second real corpus from text already on this machine: the Python standard library's own source
# (about 30 MB of .py files; site-packages, tests' binary fixtures and hidden folders left out).
# Writes a prepared dataset directory; the data is never committed.
#
#   bash scripts/build_python_corpus.sh [OUT [prepare flags...]]      (default OUT: data/python-stdlib)
#
# Its manifest.json names the source, the split counts and sha256s, and the fingerprint. Another
# Python version (or build) gives other bytes, hence another fingerprint.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-data/python-stdlib}
[ $# -gt 0 ] && shift
PY=${PYTHON:-.venv/bin/python}
STDLIB=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')
"$PY" -m blocktrain prepare "$STDLIB" --out "$OUT" --include '*.py' --exclude 'site-packages,__pycache__' "$@"
