"""Time the README's commands on a fresh clone, as a newcomer runs them, and write what each took.

    python benchmarks/quality/readme_timings.py --json benchmarks/results/readme-timings.json            # all three
    python benchmarks/quality/readme_timings.py --only tiny --only test --json benchmarks/results/readme-timings.json

``tiny`` and ``main`` each run in a fresh ``git clone`` of HEAD (no ``.venv``: installation included), placed
beside this checkout so that ``../shared/data`` resolves as it does here; ``test`` runs in the clone ``tiny``
installed, as a newcomer runs the tests after a first job (in a fresh clone of its own when ``tiny`` is not
timed). Output is streamed to a log beside the JSON, and the phases ``scripts/main.sh`` prints
(``== NAME: done in N s``) are parsed into the result. An existing JSON is updated: commands not run this time
keep their earlier entry. Run it with the machine to itself.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

from blocktrain.bench.machine import machine_info

ROOT = Path(__file__).resolve().parents[2]

log = logging.getLogger("readme_timings")

COMMANDS = {  # name -> (environment, command): the README's two commands and the tiny quick check, in run order
    "tiny": ({"PRESET": "tiny"}, ["bash", "scripts/main.sh"]),
    "test": ({}, ["bash", "scripts/test.sh"]),
    "main": ({}, ["bash", "scripts/main.sh"]),
}
TARGETS_S = {"tiny_bench": 60.0, "main": 900.0, "test": 240.0}  # issue 21's limits
PHASE = re.compile(r"^== (.+): done in (\d+) s")


def time_one(name: str, log_path: Path, clone: Path, keep: bool = False) -> dict[str, Any]:
    """Run command ``name`` in ``clone`` (cloned fresh from HEAD unless it exists); ``keep`` the clone after."""
    env_extra, cmd = COMMANDS[name]
    if not clone.exists():
        subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=clone, capture_output=True, text=True,
                            check=True).stdout.strip()
    env = {k: v for k, v in os.environ.items() if k not in ("BLOCKTRAIN_DATA", "VIRTUAL_ENV", "PYTHONPATH")}
    env.update(env_extra)
    shown = " ".join([*(f"{k}={v}" for k, v in env_extra.items()), *cmd])
    log.info("%s: %s in a fresh clone at %s (log: %s)", name, shown, commit, log_path)
    phases: dict[str, int] = {}
    t0 = time.perf_counter()
    with log_path.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=clone, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert proc.stdout is not None
        for line in proc.stdout:
            out.write(line.replace(str(clone), "<clone>"))  # no machine's absolute path in a committed log
            out.flush()
            m = PHASE.match(line)
            if m:
                phases[m.group(1).split(" (")[0]] = int(m.group(2))
                log.info("%s: %s", name, line.strip())
        rc = proc.wait()
    wall = time.perf_counter() - t0
    if not keep:
        shutil.rmtree(clone, ignore_errors=True)
    tail = log_path.read_text().splitlines()[-3:]
    log.info("%s: exit %d in %.0f s", name, rc, wall)
    return {"command": shown, "commit": commit, "exit_code": rc, "wall_s": round(wall, 1), "phases_s": phases,
            "log_tail": tail}


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", action="append", choices=sorted(COMMANDS), help="time only this command (repeatable)")
    ap.add_argument("--json", type=Path, default=ROOT / "benchmarks/results/readme-timings.json")
    args = ap.parse_args()
    result: dict[str, Any] = json.loads(args.json.read_text()) if args.json.exists() else {}
    result.setdefault("commands", {})
    names = args.only or list(COMMANDS)
    first = ROOT.parent / "readme-timing-first"
    for stale in (first, ROOT.parent / "readme-timing-main"):
        shutil.rmtree(stale, ignore_errors=True)
    for name in [n for n in COMMANDS if n in names]:  # tiny, then test in its clone, then main in a fresh one
        clone = ROOT.parent / "readme-timing-main" if name == "main" else first
        result["commands"][name] = time_one(name, args.json.with_name(f"readme-timing-{name}.log"), clone,
                                            keep=name == "tiny" and "test" in names)
        result["commands"][name]["fresh_clone"] = name != "test" or "tiny" not in names
    result.update(machine=machine_info(), targets_s=TARGETS_S,
                  script="python benchmarks/quality/readme_timings.py [--only NAME] --json benchmarks/results/readme-timings.json")
    cmds = result["commands"]
    rows: list[tuple[str, Any, float | None]] = []
    if "tiny" in cmds:
        rows.append(("PRESET=tiny bash scripts/main.sh, bench phase", cmds["tiny"]["phases_s"].get("bench quality"),
                     TARGETS_S["tiny_bench"]))
        rows.append(("PRESET=tiny bash scripts/main.sh, all", cmds["tiny"]["wall_s"], None))
    if "main" in cmds:
        rows.append(("bash scripts/main.sh", cmds["main"]["wall_s"], TARGETS_S["main"]))
    if "test" in cmds:
        rows.append(("bash scripts/test.sh", cmds["test"]["wall_s"], TARGETS_S["test"]))
    print("| command | seconds | target |\n|---|---|---|")
    for label, secs, target in rows:
        print(f"| {label} | {secs} | {'' if target is None else f'<= {target:.0f}'} |")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if all(c["exit_code"] == 0 for c in cmds.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
