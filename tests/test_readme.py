"""The README as a newcomer runs it (:mod:`benchmarks.quality.readme_sections`): every shell block of "Train on your
own text", "A decentralised run" and "Serving", then the Python snippet, run in order in a fresh directory, word for
word but for one substitution table (a CPU-sized preset, free loopback ports for the hosts, a folder of 30 notes for
``~/my-notes``). A command that exits non-zero, or prints a traceback or an error, fails the test. Edit a README
command and this test runs the edit.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import pytest
from benchmarks.quality.readme_sections import run_readme, stop, substitutions

CPU = "--preset tiny --objective stack --steps 30"  # the CPU-sized stand-in for the README's presets

pytestmark = pytest.mark.timeout(600)


@pytest.fixture
def servers() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    stop(procs)


def test_the_readme_runs_as_written(tmp_path: Path, servers: list[subprocess.Popen[bytes]]) -> None:
    ran = [r.ran for r in run_readme(tmp_path, substitutions(("--preset cpu-mini", CPU)), servers)]
    words = [" ".join(r.split()[1:3]) if r != "python" else r for r in ran]
    assert words.count("python") == 1 and any("worker" in w for w in words) and sum(w.startswith("serve ") for w in words) == 2, ran
    for p in servers:
        assert p.poll() is None, f"{cast(list[str], p.args)[1]} stopped early"
