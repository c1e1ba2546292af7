"""The suite's own guards (tests/conftest.py): a child forked from a test process dies with it."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest


@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux's")
def test_a_child_forked_from_a_test_process_dies_with_it() -> None:
    """P is forked from this process and forks C, then ends: C, asleep, is killed at once (a timed-out test's
    process leaves no child holding the pipe the suite's controller reads)."""
    r, w = os.pipe()
    p = os.fork()
    if p == 0:  # P: fork C, report its pid, end
        c = os.fork()
        if c == 0:  # C: sleeps unless the guard kills it
            time.sleep(30)
            os._exit(0)
        os.write(w, str(c).encode())
        os._exit(0)
    os.close(w)
    c = int(os.read(r, 32))
    os.close(r)
    os.waitpid(p, 0)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(c, 0)  # C lives (or is a zombie awaiting its reaper)
        except ProcessLookupError:
            break
        if _state(c) == "Z":
            break
        time.sleep(0.05)
    else:
        os.kill(c, signal.SIGKILL)
        pytest.fail("a child forked from a test process outlived it")


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "gone"
