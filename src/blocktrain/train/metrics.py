"""Append-only JSONL metric files, one object per line.

A process killed inside a write (or a full disk) can leave a last line cut short; the next writer starts on a new
line after it, and a reader skips such a line with a warning, so one cut record never makes the file unreadable.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


class JsonlWriter:
    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._checked = False  # whether the file's end was checked for a cut line (once, before the first write)

    def write(self, **record: Any) -> None:
        record.setdefault("time", time.time())
        line = json.dumps(record, sort_keys=True) + "\n"
        if not self._checked:
            self._checked = True
            if self.path.exists() and self.path.stat().st_size:
                with self.path.open("rb") as f:
                    f.seek(-1, 2)
                    if f.read(1) != b"\n":  # a line cut short by a kill: this record starts on its own line
                        line = "\n" + line
        with self.path.open("a") as f:
            f.write(line)
            f.flush()


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of ``path``, oldest first; a line that is not a JSON object (cut short by a kill) is skipped."""
    out = []
    for i, line in enumerate(path.read_text(errors="replace").splitlines(), start=1):
        line = line.strip()
        if not line:
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = None
        if not isinstance(record, dict):
            log.warning("%s line %d is not a whole record (cut short by a kill?); skipped", path, i)
            continue
        out.append(record)
    return out
