#!/usr/bin/env bash
# The README's test command: install, lint, type-check, run the test suite (slow tests skipped).
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS=dev,hivemind bash scripts/setup.sh  # hivemind: its engine's tests run too (they skip where it is missing)
. .venv/bin/activate
# Headless Chromium for the dashboard test (Debian package); skipped quietly where apt is unavailable.
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  (apt-get update -qq && apt-get install -y -qq chromium >/dev/null) || echo "note: could not install chromium; the dashboard test will skip"
fi
echo "== ruff"; ruff check src tests benchmarks
# mypy runs beside pytest (it fills the cores while tests wait on sockets and deadlines); its report follows pytest's
MYPY_LOG=$(mktemp)
mypy > "$MYPY_LOG" 2>&1 &
MYPY_PID=$!
echo "== pytest"
# One pytest worker per core (pytest-xdist), each test on one torch thread; every test has a 300 s timeout
# (pytest-timeout, pyproject.toml). PYTEST_WORKERS=0 runs the tests in this one process.
# The whole run is bounded too (SUITE_LIMIT_S), so that a hang outside any test ends with a message, not CI's kill.
WORKERS=${PYTEST_WORKERS:-auto}
LIMIT=(timeout --kill-after=30 "${SUITE_LIMIT_S:-3600}")
export BLOCKTRAIN_TEST_THREADS=${BLOCKTRAIN_TEST_THREADS:-1}
set +e
if [ "$WORKERS" = 0 ]; then
  "${LIMIT[@]}" pytest -q -p no:cacheprovider "$@"
else
  "${LIMIT[@]}" pytest -q -p no:cacheprovider -n "$WORKERS" --dist worksteal "$@"
fi
PYTEST_RC=$?
if [ "$PYTEST_RC" = 124 ] || [ "$PYTEST_RC" = 137 ]; then echo "pytest did not finish within ${SUITE_LIMIT_S:-3600} s"; fi
wait "$MYPY_PID"
MYPY_RC=$?
set -e
echo "== mypy"; cat "$MYPY_LOG"; rm -f "$MYPY_LOG"
[ "$PYTEST_RC" = 0 ] && [ "$MYPY_RC" = 0 ]
