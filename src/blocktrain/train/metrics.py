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

from blocktrain.checkpoint.safetensors_io import atomic_write_bytes

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
            if _ends_cut(self.path):  # a line cut short by a kill: this record starts on its own line
                line = "\n" + line
        with self.path.open("a") as f:
            f.write(line)
            f.flush()


def _ends_cut(path: Path) -> bool:
    """Whether ``path`` ends inside a line (its last write was cut short by a kill)."""
    if not path.exists() or not path.stat().st_size:
        return False
    with path.open("rb") as f:
        f.seek(-1, 2)
        return f.read(1) != b"\n"


def append_jsonl(path: Path, record: dict[str, Any]) -> None:
    """Append one record to the JSONL at ``path`` (made with its folder if missing), on a line of its own even after
    a line cut short by a kill (which would otherwise swallow it: a reader skips the joined line)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    line = json.dumps(record) + "\n"
    with path.open("a") as f:
        f.write(("\n" if _ends_cut(path) else "") + line)
        f.flush()


def write_json(path: Path, doc: Any) -> None:
    """``doc`` as indented JSON at ``path``, whole or not at all (a kill mid-write leaves the previous file)."""
    atomic_write_bytes(path, (json.dumps(doc, indent=1) + "\n").encode())


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


def drop_after(path: Path, step: int) -> int:
    """Rewrite ``path`` (atomically) without its records of steps after ``step``; how many were dropped. A run killed
    between two checkpoints resumes from the earlier one and logs the steps after it again: without this the file held
    them twice, and a curve drawn from it went back on itself. Records without a step are kept."""
    if not path.is_file():
        return 0
    records = read_jsonl(path)
    kept = [r for r in records if not (isinstance(r.get("step"), int) and r["step"] > step)]
    if len(kept) < len(records):
        atomic_write_bytes(path, "".join(json.dumps(r, sort_keys=True) + "\n" for r in kept).encode())
    return len(records) - len(kept)
