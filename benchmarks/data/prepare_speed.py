"""Throughput and peak memory of ``blocktrain prepare`` at two corpus sizes (issue 22).

Two sources, each at about 30 MB and at ten times that (the same bytes repeated):

* ``directory``: the Python standard library's ``.py`` files, the second corpus
  (``scripts/build_python_corpus.sh``); the large size is ten folders of symlinks to them;
* ``text``: one text file, WikiText-2's train split repeated.

Each measurement runs in a fresh process, which reports the seconds spent in
:func:`blocktrain.data.prepare.prepare` and its peak resident memory (``VmHWM``, which a new program image starts
afresh; ``ru_maxrss`` would carry the parent's peak across the fork).
``prepare`` is single-threaded: one core.

    flock /tmp/blocktrain-cpu.lock python benchmarks/data/prepare_speed.py --json benchmarks/results/prepare-speed.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Any

from blocktrain.data.dataset import resolve_data_dir
from blocktrain.data.prepare import directory_files

CHILD = """
import json, sys, time
from pathlib import Path
from blocktrain.data.prepare import PrepareOptions, prepare
src, out, include, exclude = sys.argv[1], sys.argv[2], tuple(sys.argv[3].split(",")), tuple(filter(None, sys.argv[4].split(",")))
t0 = time.perf_counter()
done = prepare(Path(src), Path(out), PrepareOptions(include=include, exclude=exclude, progress=False))
wall = time.perf_counter() - t0
size = sum(v["bytes"] for v in done.manifest["splits"].values())
hwm = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))  # kB, this image's own
print(json.dumps({"seconds": wall, "bytes_out": size, "peak_rss_mib": hwm / 1024}))
"""


def measure(src: Path, out: Path, include: str, exclude: str) -> dict[str, Any]:
    res = subprocess.run([sys.executable, "-c", CHILD, str(src), str(out), include, exclude], check=True,
                         stdout=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    row: dict[str, Any] = json.loads(res.stdout.strip().splitlines()[-1])
    row["mb_per_s"] = row["bytes_out"] / 1e6 / row["seconds"]
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default=None, help="WikiText directory for the text source (default: $BLOCKTRAIN_DATA)")
    ap.add_argument("--repeat", type=int, default=10, help="the large size is this many copies")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        big = t / "stdlib-x"
        for i in range(args.repeat):  # copy i: a folder of symlinks to the same files
            for rel, path in directory_files(stdlib, ("*.py",), ("site-packages", "__pycache__")):
                link = big / f"copy{i}" / rel
                link.parent.mkdir(parents=True, exist_ok=True)
                link.symlink_to(path)
        train = resolve_data_dir(args.data).open("train").path
        small_txt, big_txt = t / "small.txt", t / "big.txt"
        unit = train.read_bytes()
        copies = max(1, round(30e6 / len(unit)))
        with small_txt.open("wb") as f:  # written piece by piece: the parent stays small, whatever the size
            for _ in range(copies):
                f.write(unit)
        with big_txt.open("wb") as f:
            for _ in range(copies * args.repeat):
                f.write(unit)
        del unit
        cases = [("directory", "30 MB", stdlib, "*.py", "site-packages,__pycache__"),
                 ("directory", f"{args.repeat}x", big, "*.py", ""),
                 ("text", "30 MB", small_txt, "*", ""),
                 ("text", f"{args.repeat}x", big_txt, "*", "")]
        for n, (kind, size, src, include, exclude) in enumerate(cases):
            row = {"source": kind, "size": size, **measure(src, t / f"out{n}", include, exclude)}
            rows.append(row)
            print(f"{kind:9s} {row['bytes_out'] / 1e6:7.1f} MB in {row['seconds']:6.2f} s = {row['mb_per_s']:6.1f} MB/s, "
                  f"peak RSS {row['peak_rss_mib']:.0f} MiB", flush=True)
    doc = {"benchmark": "prepare-speed", "target_mb_per_s": 50.0, "runs": rows,
           "cpu": os.uname().machine, "command": "python benchmarks/data/prepare_speed.py " + " ".join(sys.argv[1:])}
    if args.json:
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
