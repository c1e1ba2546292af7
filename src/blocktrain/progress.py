"""Progress bars that stay readable when the output is a log file.

On a terminal :func:`progress_bar` is an ordinary tqdm bar. When stderr is not a
terminal (``blocktrain eval ... > log 2>&1``) every in-place redraw would become
one more entry in the log, so the bar instead writes a logging line when it starts,
at most one every :data:`NON_TTY_INTERVAL_S` seconds, and one summary line when it
finishes.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

log = logging.getLogger("blocktrain.progress")

NON_TTY_INTERVAL_S = 30.0  # seconds between progress lines when the output is not a terminal


class _NullFile:
    """Where a logged bar's own drawing goes: nowhere (its lines go through logging)."""

    def write(self, s: str) -> int:
        return len(s)

    def flush(self) -> None:
        pass


class LoggedBar(tqdm):
    """A tqdm bar that logs a line at most every ``interval`` seconds (and always at the end) instead of redrawing."""

    def __init__(self, *args: Any, interval: float = NON_TTY_INTERVAL_S, **kwargs: Any) -> None:
        self._interval = interval
        self._last_line = float("-inf")  # time.monotonic() of the last line logged
        self._closing = False
        super().__init__(*args, file=_NullFile(), mininterval=interval, maxinterval=interval, **kwargs)

    def display(self, msg: str | None = None, pos: int | None = None) -> bool:
        if msg == "":  # tqdm clearing a bar that is not kept: nothing was drawn, nothing to clear
            return True
        now = time.monotonic()
        if not self._closing and now - self._last_line < self._interval:
            return True  # e.g. set_postfix() forces a refresh on every step
        self._last_line = now
        log.info("%s", self.__str__() if msg is None else msg)
        return True

    def close(self) -> None:
        self._closing = True  # the final display is always logged: the one-line summary
        super().close()


def _is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def progress_bar(*args: Any, **kwargs: Any) -> tqdm:
    """``tqdm(*args, **kwargs)`` on a terminal; a :class:`LoggedBar` (a few log lines) when the output is not one."""
    if kwargs.get("disable") or _is_terminal(kwargs.get("file") or sys.stderr):
        return tqdm(*args, **kwargs)
    for key in ("file", "dynamic_ncols", "mininterval", "maxinterval"):  # drawing options that do not apply
        kwargs.pop(key, None)
    return LoggedBar(*args, **kwargs)


class MetricsProgress:
    """Moves ``bar`` while a run trains, from the steps its trainer logs to ``RUN/metrics/NAME.jsonl`` (every
    ``log_every`` steps): ``bench quality``'s bar over its arms moves within seconds, not once per arm. The run's
    ``steps`` take ``flops`` of the bar (in GFLOP) from where it stands."""

    def __init__(self, bar: tqdm, metrics: Path, steps: int, flops: float, interval_s: float = 1.0) -> None:
        self.bar, self.metrics, self.steps, self.gflops = bar, metrics, max(1, steps), flops / 1e9
        self.start = float(bar.n)
        self.offset = metrics.stat().st_size if metrics.exists() else 0  # records from an earlier run are not news
        self.tail = b""  # a line the trainer has not finished writing
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._follow, args=(interval_s,), name="arm-progress", daemon=True)
        self.thread.start()

    def _follow(self, interval_s: float) -> None:
        while not self.done.wait(interval_s):
            step = self._latest_step()
            if step is not None:
                self._move_to(self.start + self.gflops * min(step, self.steps) / self.steps)

    def _latest_step(self) -> int | None:
        """The highest training step logged since the last look (None: no new step record)."""
        try:
            with self.metrics.open("rb") as f:
                f.seek(self.offset)
                new = f.read()
        except FileNotFoundError:
            return None
        self.offset += len(new)
        *lines, self.tail = (self.tail + new).split(b"\n")
        steps = []
        for line in lines:
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict) and "event" not in rec and isinstance(rec.get("step"), int):
                steps.append(rec["step"])
        return max(steps, default=None)

    def _move_to(self, n: float) -> None:
        if n > self.bar.n:
            self.bar.update(n - self.bar.n)

    def close(self) -> None:
        """The arm has finished: its whole share of the bar, whatever was logged."""
        self.done.set()
        self.thread.join()
        self._move_to(self.start + self.gflops)
