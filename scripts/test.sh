#!/usr/bin/env bash
# The README's test command: install, lint, type-check, run the test suite (slow tests skipped).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
# Headless Chromium for the dashboard test (Debian package); skipped quietly where apt is unavailable.
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  (apt-get update -qq && apt-get install -y -qq chromium >/dev/null) || echo "note: could not install chromium; the dashboard test will skip"
fi
echo "== ruff"; ruff check src tests benchmarks
echo "== mypy"; mypy
echo "== pytest"
export BLOCKTRAIN_TEST_THREADS=${BLOCKTRAIN_TEST_THREADS:-2}
pytest -q -p no:cacheprovider "$@"
