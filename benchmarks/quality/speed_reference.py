"""``blocktrain bench speed`` plus the same trainers timed on an older commit's code (its fp32 path).

    python benchmarks/quality/speed_reference.py --reference-commit d95cdf2 --preset cpu-small \
        --json benchmarks/results/speed-cpu-small.json

Every other flag is one of ``blocktrain bench speed``. The product's benchmark
times the current code; then the reference commit is checked out in a temporary
git worktree and its trainers run with the same preset, data and steps (fp32,
its own defaults), each in a fresh child process. Trainers the reference commit
lacks (the stack objective, before the --objective flag) are left out. The reference columns of the table
and ``reference_fp32_s_per_step`` / ``speedup_over_reference`` (this code's bf16 against the reference's fp32:
the code and the precision) / ``speedup_fp32_over_reference`` (fp32 against fp32: the code alone) in the JSON come
from here.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from blocktrain.bench.speed import (
    TRAINERS,
    SpeedOptions,
    bytes_per_step,
    common_flags,
    measure_speed,
    seconds_per_step,
    write_speed,
)
from blocktrain.cli.main import build_parser, speed_options
from blocktrain.errors import BlockTrainError
from blocktrain.train.metrics import read_jsonl

REPO = Path(__file__).resolve().parents[2]


def run_command(cmd: list[str], env: dict[str, str] | None = None) -> None:
    """Run one child process of the reference commit (its code runs only as a command line); BlockTrainError if it fails."""
    rc = subprocess.call(cmd, env=env)
    if rc != 0:
        raise BlockTrainError(f"timed run failed (exit {rc}): {shlex.join(cmd)}")


def time_reference(opts: SpeedOptions, result: dict[str, Any], commit: str) -> None:
    """Add the reference rows: the same commands on ``commit``'s code, in a temporary git worktree."""
    step_bytes = bytes_per_step(opts.preset)
    with tempfile.TemporaryDirectory(prefix="blocktrain-ref-") as tmp:
        tree = Path(tmp) / "tree"
        run_command(["git", "-C", str(REPO), "worktree", "add", "--detach", str(tree), commit])
        try:
            env = {**os.environ, "PYTHONPATH": str(tree / "src")}
            helps = subprocess.run([sys.executable, "-m", "blocktrain", "train-block", "--help"], env=env,
                                   capture_output=True, text=True).stdout
            has_objectives = "--objective" in helps  # d95cdf2 predates the flag: its blocks are diffusion blocks
            for name, sub, metrics_name, _, _ in TRAINERS:
                if "stack" in name and not has_objectives:
                    continue  # the reference commit has no stack objective
                sub_old = sub if has_objectives else tuple(a for a in sub if a not in ("--objective", "diffusion"))
                out = opts.out / f"{name}-reference"
                fp32 = ["--precision", "fp32"] if "--precision" in helps else []  # d95cdf2 computes in fp32 only
                cmd = [sys.executable, "-m", "blocktrain", *sub_old, "--out", str(out), *common_flags(opts), *fp32]
                run_command(cmd, env)
                sps = seconds_per_step(read_jsonl(out / "metrics" / f"{metrics_name}.jsonl"), step_bytes)
                result[name]["reference_fp32_s_per_step"] = sps
                result[name]["speedup_over_reference"] = sps / result[name]["bf16_s_per_step"]  # precision and code
                # the code alone: fp32 against the reference's fp32 (the bf16 figure mixes in the precision's gain)
                result[name]["speedup_fp32_over_reference"] = sps / result[name]["fp32_s_per_step"]
                result["commands"][f"{name}.reference"] = f"(at {commit}) blocktrain " + shlex.join(cmd[3:])
        finally:
            subprocess.call(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)])
    result["reference_commit"] = commit


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, add_help=False)
    ours.add_argument("--reference-commit", required=True, help="git commit whose trainers to time beside the current code")
    known, rest = ours.parse_known_args(argv)
    args = build_parser().parse_args(["bench", "speed", *rest])
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        opts = speed_options(args, shlex.join(["python", "benchmarks/quality/speed_reference.py", *argv]))
        result = measure_speed(opts)
        time_reference(opts, result, known.reference_commit)
        write_speed(opts, result)
    except BlockTrainError as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
