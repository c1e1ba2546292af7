"""``blocktrain ARGS`` in a child process forked from the test process: a real process (its own pid, sockets,
signals, exit code) that skips the interpreter's start-up and torch's import, which the test process has done.

Tests of coordinators, workers and stages start dozens of them; started with ``python -m blocktrain`` each would
first spend 2-3 s of CPU importing torch. The console entry point itself is tested with real interpreters
(``tests/test_cli.py``). :class:`ForkedCli` answers the parts of :class:`subprocess.Popen` those tests use.
"""

from __future__ import annotations

import io
import logging
import os
import signal
import subprocess
import sys
import time
import traceback
from typing import IO, Any

import torch


class ForkedCli:
    """A forked ``blocktrain`` CLI run; ``stdout``/``stderr`` as Popen takes them: None (inherited),
    ``subprocess.DEVNULL``, ``subprocess.PIPE`` or ``subprocess.STDOUT`` (stderr only); ``env`` replaces the child's
    environment."""

    def __init__(self, argv: list[str], *, stdout: int | None = None, stderr: int | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.args = argv
        self.returncode: int | None = None
        out_r = out_w = err_r = err_w = None
        if stdout == subprocess.PIPE:
            out_r, out_w = os.pipe()
        if stderr == subprocess.PIPE:
            err_r, err_w = os.pipe()
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        pid = os.fork()
        if pid == 0:  # the child: never returns
            out = _target(stdout, out_w, 1)
            err = out if stderr == subprocess.STDOUT else _target(stderr, err_w, 2)
            _child(argv, out, err, env, {out_r, err_r} - {None})
        self.pid = pid
        for fd in (out_w, err_w):
            if fd is not None:
                os.close(fd)
        self.stdout: IO[bytes] | None = os.fdopen(out_r, "rb") if out_r is not None else None
        self.stderr: IO[bytes] | None = os.fdopen(err_r, "rb") if err_r is not None else None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if end is not None and time.monotonic() > end:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            time.sleep(0.02)
        assert self.returncode is not None
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[bytes | None, bytes | None]:
        out = self.stdout.read() if self.stdout is not None else None  # ends when the child closes its end
        err = self.stderr.read() if self.stderr is not None else None
        self.wait(timeout)
        return out, err

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _target(how: int | None, pipe_w: int | None, inherited: int) -> int:
    """The fd a child stream goes to: the pipe's write end, /dev/null, or the parent's own fd (None: inherited)."""
    if pipe_w is not None:
        return pipe_w
    return os.open(os.devnull, os.O_WRONLY) if how == subprocess.DEVNULL else os.dup(inherited)


def _child(argv: list[str], out_fd: int, err_fd: int, env: dict[str, str] | None, close: set[int | None]) -> None:
    code = 1
    try:
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        os.dup2(out_fd, 1)
        os.dup2(err_fd, 2)
        for fd in close:
            if fd is not None:
                os.close(fd)
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=True)
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True)
        if env is not None:
            os.environ.clear()
            os.environ.update(env)
        for sig in (signal.SIGTERM, signal.SIGALRM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        root = logging.getLogger()  # the test process's capture handlers: not the child's
        for h in list(root.handlers):
            root.removeHandler(h)
        for name in list(logging.root.manager.loggerDict):
            lg = logging.getLogger(name)
            lg.handlers.clear()
            lg.setLevel(logging.NOTSET)
            lg.propagate = True
        root.setLevel(logging.WARNING)
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        sys.argv = ["blocktrain", *argv]
        from blocktrain.cli.main import main

        code = main(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


_REAL_POPEN = subprocess.Popen


def fork_popen(cmd: Any, *args: Any, **kw: Any) -> Any:
    """``subprocess.Popen`` that forks ``[python, -m, blocktrain, ...]`` commands (see :class:`ForkedCli`) and runs
    anything else for real. A test that monkeypatches it in lets product code that starts CLI processes (``train``'s
    block processes, the coordinators of ``benchmarks/data/ingest.py``) start them without the interpreter's start-up."""
    simple = not args and set(kw) <= {"env", "stdout", "stderr"}
    if simple and isinstance(cmd, list) and cmd[:3] == [sys.executable, "-m", "blocktrain"]:
        return ForkedCli([str(c) for c in cmd[3:]], **kw)
    return _REAL_POPEN(cmd, *args, **kw)


def spawn(argv: list[str], **kw: Any) -> ForkedCli:
    """``subprocess.Popen([python, -m, blocktrain, *argv], **kw)``, forked (``stdout``, ``stderr``, ``env``)."""
    return ForkedCli(argv, **kw)
