"""Shared fixtures: a small synthetic WikiText-like data directory and tiny configs."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from blocktrain.config import RunConfig
from blocktrain.presets import tiny

THREADS = int(os.environ.get("BLOCKTRAIN_TEST_THREADS", "1"))
torch.set_num_threads(THREADS)
_FORKED_FROM = [0, 0]  # the pid a child was forked from, and 1 if from its main thread


def _before_fork() -> None:
    _FORKED_FROM[:] = [os.getpid(), int(threading.current_thread() is threading.main_thread())]


def _die_with_the_test_process() -> None:
    """In every child forked from a test process's main thread (tests/forked_cli.py's commands, the block processes
    of ``train``): SIGKILL when that process dies (Linux ``prctl(PR_SET_PDEATHSIG)``). A test process ended by its
    timeout then leaves no child behind holding ports, or the pipe the suite's controller reads until it closes. The
    signal follows the forking thread, so a child forked from another thread (hivemind's) is left alone."""
    if sys.platform != "linux" or not _FORKED_FROM[1]:
        return
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != _FORKED_FROM[0]:  # the parent died before the prctl: nothing would deliver the signal
        os._exit(1)


os.register_at_fork(before=_before_fork, after_in_child=_die_with_the_test_process)


@pytest.fixture(autouse=True)
def _torch_threads_restored() -> Iterator[None]:
    """A test that leaves torch at another thread count fails (and the count is put back): tests fork children
    (tests/forked_cli.py, the block processes of ``train``), and a child forked from a process whose OpenMP pool ran
    with more threads than the child's hangs in libgomp's barrier; one such hang held CI past its limit."""
    yield
    now = torch.get_num_threads()
    if now == THREADS:
        return
    torch.set_num_threads(THREADS)
    if now > 1:  # fewer threads (a command run in-process at its --threads 1) forks safely
        pytest.fail(f"this test left torch at {now} threads (the suite runs at {THREADS}): restore the count it set, "
                    "or set it only in a child process", pytrace=False)


_TEXT = (
    " = Valkyria Chronicles III = \n \n Senjo no Valkyria 3 : Unrecorded Chronicles is a tactical role @-@ "
    "playing video game developed by Sega and Media.Vision for the PlayStation Portable . Released in January "
    "2011 in Japan , it is the third game in the Valkyria series . The game began development in 2010 , carrying "
    "over a large portion of the work done on Valkyria Chronicles II . \n"
)


def write_data_dir(root: Path, n_repeat: int = 40, flavour: str = "tokens") -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for i, split in enumerate(("train", "valid", "test")):
        text = "".join(_TEXT.replace("2011", str(2000 + (j + i) % 30)) for j in range(n_repeat if split == "train" else 6))
        (root / f"wiki.{split}.{flavour}").write_bytes(text.encode())
    return root


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    return write_data_dir(tmp_path / "data")


@pytest.fixture
def tiny_cfg() -> RunConfig:
    return tiny()
