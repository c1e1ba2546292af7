"""Depth at the committed budget, as the device suite runs it (``scripts/device_suite.sh``, job b).

Each ``bench quality`` run (one preset, one lr, one seed: the stack against the E2E at matched FLOPs) becomes one
row of a JSONL file. ``rows`` trains every (lr, seed) of a preset whose row is not in the file yet (so a second
run resumes), each under its own time limit; ``row`` adds one from a finished bench's JSON; ``summary`` picks each
arm's best lr by its mean validation CE among the lrs with every seed (:func:`pick_lr`; the test split only reports),
and prints each arm's test CE at its best lr (seed mean, spread) and the gap (stack minus E2E, nats/byte) over the
seeds both best lrs have, with its spread:

    python benchmarks/quality/device_depth.py rows --preset P --lrs 1e-3 2e-3 --seeds 0 1 --device cuda \
        --data DATA --runs RUNS --jsonl depth.jsonl [--max-eval-bytes 0] [--timeout 420]
    python benchmarks/quality/device_depth.py row --key K --preset P --lr LR --seed S --bench RUN.json --jsonl depth.jsonl
    python benchmarks/quality/device_depth.py summary --jsonl depth.jsonl --json device-depth.json
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import math
import os
import signal
import statistics
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from blocktrain.presets import get_preset
from blocktrain.train.metrics import append_jsonl, read_jsonl, write_json

ARMS = ("stack", "stack_prefix0", "e2e_matched_flops")
log = logging.getLogger("device_depth")


def row_key(preset: str, lr: str, seed: int) -> str:
    """The row's name in the JSONL: ``cpu-small-lr2e-3-seed0`` (the lr as written on the command line)."""
    return f"{preset}-lr{lr}-seed{seed}"


def bench_command(preset: str, lr: str, seed: int, device: str, data: Path, out: Path, max_eval_bytes: int) -> list[str]:
    """``bench quality`` for one row: the stack against the E2E at matched FLOPs, in one process, no lr sweep."""
    return [sys.executable, "-m", "blocktrain", "bench", "quality", "--preset", preset, "--objective", "stack",
            "--lr", lr, "--seed", str(seed), "--no-lr-sweep", "--no-matched-steps", "--isolate", "no",
            "--device", device, "--data", str(data), "--max-eval-bytes", str(max_eval_bytes), "--out", str(out),
            "--resume", "--no-progress", "--json", f"{out}.json"]  # a row cut by its time limit goes on next time


def read_rows(jsonl: Path) -> list[dict[str, Any]]:
    """The rows written so far (a line cut short by a kill is skipped with a warning); of two rows of one (preset,
    lr, seed), however the lr was written (2e-3, 0.002), the later."""
    rows: dict[tuple[str, float, int], dict[str, Any]] = {}
    for r in read_jsonl(jsonl) if jsonl.exists() else []:
        rows[_identity(r)] = r
    return list(rows.values())


def _identity(row: dict[str, Any]) -> tuple[str, float, int]:
    return row.get("preset", ""), float(row.get("lr", math.nan)), int(row.get("seed", -1))


def recipe_of(preset: str) -> str:
    """A digest of ``preset``'s whole run config as this code defines it: a row trained under another recipe (a
    default changed between two sessions of a resumed suite) is trained again, not averaged with the new ones."""
    return hashlib.sha256(get_preset(preset).to_json().encode()).hexdigest()[:16]


def _current(row: dict[str, Any], preset: str, max_eval_bytes: int) -> bool:
    """Whether ``row`` was trained under this code's recipe of ``preset`` and scored on the same bytes."""
    return row.get("recipe") == recipe_of(preset) and row.get("max_eval_bytes") == max_eval_bytes


def newest_setting(rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[str]]:
    """Each preset's rows of the recipe and scored bytes of its newest row (the JSONL's last; a suite resumed under
    a new recipe retrains its stale rows one by one, and a cut run leaves both kinds), and the keys of those left out:
    what a summary of a half-retrained suite can stand on, where :func:`summarise` refuses the mix."""
    newest = {r.get("preset"): (r.get("recipe"), r.get("bytes_scored")) for r in rows}
    kept = [r for r in rows if (r.get("recipe"), r.get("bytes_scored")) == newest[r.get("preset")]]
    return kept, [str(r.get("key")) for r in rows if r not in kept]


def append_row(jsonl: Path, row: dict[str, Any]) -> None:
    """Add one row to the JSONL (the only writer of its lines), on a line of its own after a cut one."""
    append_jsonl(jsonl, row)


def run_bench(cmd: list[str], log_path: Path, timeout: float | None) -> str | None:
    """Run one bench in its own process group, its output appended to ``log_path``; None if it exited 0, else why
    not. At ``timeout`` the whole group is killed (compile workers included), as ``timeout`` did in the suite; so it
    is when this process is told to end (the suite's ``timeout`` signals its own group, which the bench left: it
    trained on, unlimited, beside the next jobs)."""
    with log_path.open("a") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)

        def end(signum: int, frame: object) -> None:
            with contextlib.suppress(ProcessLookupError):  # it may have ended as the signal came
                os.killpg(proc.pid, signal.SIGKILL)
            raise SystemExit(128 + signum)

        previous = signal.signal(signal.SIGTERM, end)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return f"cut at {timeout:g} s"
        finally:
            signal.signal(signal.SIGTERM, previous)
    if rc == 0:
        return None
    return f"killed by signal {-rc}" if rc < 0 else f"exit {rc}"


def train_rows(preset: str, lrs: list[str], seeds: list[int], device: str, data: Path, runs: Path, jsonl: Path,
               max_eval_bytes: int, timeout: float | None) -> int:
    """Train every (lr, seed) of ``preset`` not yet in ``jsonl`` and append its row as it finishes; returns how many
    failed or ran out of time (their rows stay missing, for the next run). Each bench's output goes to its log."""
    rows = read_rows(jsonl)
    done = {_identity(r) for r in rows if _current(r, preset, max_eval_bytes)}
    if stale := sorted(r["key"] for r in rows if r.get("preset") == preset and _identity(r) not in done):
        log.info("%s: trained under another recipe or scored on other bytes than now: trained again", ", ".join(stale))
    runs.mkdir(parents=True, exist_ok=True)
    failed = 0
    for lr in lrs:
        for seed in seeds:
            key = row_key(preset, lr, seed)
            if (preset, float(lr), seed) in done:
                log.info("%s: in %s already, skipped", key, jsonl)
                continue
            out = runs / f"depth-{key}"
            log.info("%s: training (log: %s.log)", key, out)
            why = run_bench(bench_command(preset, lr, seed, device, data, out, max_eval_bytes), Path(f"{out}.log"), timeout)
            if why is None:
                try:
                    row = bench_row(key, preset, float(lr), seed, json.loads(Path(f"{out}.json").read_text()))
                    row.update(recipe=recipe_of(preset), max_eval_bytes=max_eval_bytes)
                except (OSError, ValueError, KeyError) as exc:  # this row only: the next ones still run
                    why = f"exit 0 but its JSON is unreadable ({type(exc).__name__}: {exc})"
            if why is not None:
                log.warning("%s: no row (%s)", key, why)
                failed += 1
                continue
            append_row(jsonl, row)
            log.info("%s: stack %.4f, first prefix %.4f, E2E at matched FLOPs %.4f", key, row["ce"]["stack"],
                     row["ce"]["stack_prefix0"], row["ce"]["e2e_matched_flops"])
    return failed


def bench_row(key: str, preset: str, lr: float, seed: int, bench: dict[str, Any]) -> dict[str, Any]:
    """One row: every arm's test CE (the composed stack, its first prefix, the E2E at matched FLOPs) and its
    validation CE at the end of its training (what the summary picks lrs by; None from a bench that recorded none)."""
    stack = bench["objectives"]["stack"]
    val = stack.get("val_prefix_ce") or [None]
    return {"key": key, "preset": preset, "lr": lr, "seed": seed, "device": bench["machine"]["device"],
            "bytes_scored": stack["bytes_scored"], "command": bench["command"], "resumed": bench.get("resumed", False),
            "ce": {"stack": stack["ce_nats_per_byte"], "stack_prefix0": stack["prefix_ce"][0],
                   "e2e_matched_flops": bench["e2e_matched_flops"]["ce_nats_per_byte"]},
            "val_ce": {"stack": val[-1], "stack_prefix0": val[0],  # a stack's last prefix is its composed model
                       "e2e_matched_flops": bench["e2e_matched_flops"].get("val_ce")}}


def _spread(values: list[float]) -> float | None:
    return max(values) - min(values) if len(values) > 1 else None


def pick_lr(by_lr: dict[float, dict[int, dict[str, Any]]], arm: str) -> dict[str, Any]:
    """The arm's best lr: the lowest mean validation CE over the seeds, among the lrs that have every seed any lr has
    (an lr missing a seed, a crashed or unfinished row, is left out and named: comparing on fewer seeds would let a
    survivor win on a lucky one); a CE that is missing or not finite (a diverged run) scores +inf, so it loses. On
    test CE, said so, where the rows record no validation CE at all (rows from before it was recorded). When no lr has
    every seed, each is compared on the seeds all have (or, with none in common, on its own), and it says so."""
    seeds_all = set().union(*(set(seeds) for seeds in by_lr.values()))
    complete = sorted(lr for lr, seeds in by_lr.items() if set(seeds) == seeds_all)
    candidates = complete or sorted(by_lr)
    common = sorted(set.intersection(*(set(by_lr[lr]) for lr in candidates)))
    rows = [r for seeds in by_lr.values() for r in seeds.values()]
    split = "validation" if all(isinstance(r.get("val_ce"), dict) for r in rows) else "test"

    def ce(r: dict[str, Any]) -> float:
        value = r["val_ce"].get(arm) if split == "validation" else r["ce"].get(arm)
        return float(value) if value is not None and math.isfinite(value) else math.inf

    def score(lr: float) -> float:
        seeds = common or sorted(by_lr[lr])
        return statistics.mean(ce(by_lr[lr][s]) for s in seeds)

    best = min(candidates, key=lambda lr: (score(lr), lr))  # a tie (two diverged lrs): the smaller lr
    return {"best_lr": best, "picked_on": split, "seeds_compared": common or sorted(by_lr[best]),
            "excluded_incomplete": sorted(set(by_lr) - set(complete)) if complete else [],
            "uneven": not complete}


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per preset: each arm's test CE by lr (seed mean, spread), its best lr (picked on validation, :func:`pick_lr`),
    and the gap stack minus E2E at the best lrs over the seeds both have, with its spread over those seeds."""
    out: dict[str, Any] = {}
    by_preset: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        by_preset[r["preset"]].append(r)
    for preset, rs in sorted(by_preset.items()):
        kinds = {(r.get("recipe"), r.get("bytes_scored")) for r in rs}
        if len(kinds) > 1:
            raise ValueError(f"the rows of {preset} mix recipes or scored bytes ({sorted(map(str, kinds))}): train them "
                             "again under one (`device_depth.py rows` does so for the stale ones), or move the old JSONL "
                             "aside")
        by_lr: dict[float, dict[int, dict[str, Any]]] = defaultdict(dict)
        for r in rs:
            by_lr[float(r["lr"])][int(r["seed"])] = r
        arms: dict[str, Any] = {}
        for arm in ARMS:
            pick = pick_lr(by_lr, arm)
            best = pick["best_lr"]
            ces = [by_lr[best][s]["ce"][arm] for s in sorted(by_lr[best])]
            arms[arm] = {**pick, "mean": statistics.mean(ces), "seeds": len(ces), "spread": _spread(ces),
                         "by_lr": {str(lr): {"mean": statistics.mean(r["ce"][arm] for r in seeds.values()),
                                             "ces": [seeds[s]["ce"][arm] for s in sorted(seeds)],
                                             "seeds": sorted(seeds)} for lr, seeds in sorted(by_lr.items())}}
        s_lr, e_lr = arms["stack"]["best_lr"], arms["e2e_matched_flops"]["best_lr"]
        paired = sorted(set(by_lr[s_lr]) & set(by_lr[e_lr]))
        gaps = [by_lr[s_lr][s]["ce"]["stack"] - by_lr[e_lr][s]["ce"]["e2e_matched_flops"] for s in paired]
        out[preset] = {"arms": arms, "gap_stack_minus_e2e": statistics.mean(gaps) if gaps else None,
                       "gap_seeds": paired, "gap_spread": _spread(gaps),
                       "spread_max": max((a["spread"] for a in (arms["stack"], arms["e2e_matched_flops"])
                                          if a["spread"] is not None), default=None),
                       "rows": len(rs)}
    return out


def _f(x: float | None, spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


def table(summary: dict[str, Any]) -> str:
    lines = ["| preset | arm | best lr (picked on) | seed mean CE (test) | seeds | spread |", "|---|---|---|---|---|---|"]
    for preset, s in summary.items():
        for arm in ARMS:
            a = s["arms"][arm]
            left_out = ", ".join(f"{lr:g}" for lr in a["excluded_incomplete"])
            how = (f"{a['picked_on']}, {len(a['seeds_compared'])} seeds" + (", seeds uneven" if a["uneven"] else "")
                   + (f"; {left_out} left out, seeds missing" if left_out else ""))
            lines.append(f"| {preset} | {arm} | {a['best_lr']:g} ({how}) | {a['mean']:.4f} | {a['seeds']} | "
                         f"{_f(a['spread'], '.4f')} |")
        lines.append(f"| {preset} | gap (stack - E2E), paired seeds | | {_f(s['gap_stack_minus_e2e'], '+.4f')} | "
                     f"{len(s['gap_seeds'])} | {_f(s['gap_spread'], '.4f')} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("rows", help="train every (lr, seed) of a preset not yet in the JSONL")
    t.add_argument("--preset", required=True)
    t.add_argument("--lrs", nargs="+", required=True, help="learning rates as written in the row keys (2e-3)")
    t.add_argument("--seeds", type=int, nargs="+", required=True)
    t.add_argument("--device", default="cuda")
    t.add_argument("--data", type=Path, required=True)
    t.add_argument("--runs", type=Path, required=True, help="folder of the benches' runs, JSONs and logs")
    t.add_argument("--jsonl", type=Path, required=True)
    t.add_argument("--max-eval-bytes", type=int, default=0, help="test bytes scored (0: the whole split)")
    t.add_argument("--timeout", type=float, default=None, help="seconds a row may take (default: no limit)")
    r = sub.add_parser("row")
    r.add_argument("--key", required=True)
    r.add_argument("--preset", required=True)
    r.add_argument("--lr", type=float, required=True)
    r.add_argument("--seed", type=int, required=True)
    r.add_argument("--bench", type=Path, required=True)
    r.add_argument("--jsonl", type=Path, required=True)
    s = sub.add_parser("summary")
    s.add_argument("--jsonl", type=Path, required=True)
    s.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if args.cmd == "rows":
        for lr in args.lrs:
            try:
                if not float(lr) > 0:
                    raise ValueError
            except ValueError:
                ap.error(f"--lrs takes positive numbers, got {lr!r}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.cmd == "rows":
        return 1 if train_rows(args.preset, args.lrs, args.seeds, args.device, args.data, args.runs, args.jsonl,
                               args.max_eval_bytes, args.timeout) else 0
    if args.cmd == "row":
        row = bench_row(args.key, args.preset, args.lr, args.seed, json.loads(args.bench.read_text()))
        append_row(args.jsonl, {**row, "recipe": recipe_of(args.preset)})
        return 0
    rows, left_out = newest_setting(read_rows(args.jsonl))
    if left_out:
        log.warning("left out of the summary, trained under an older recipe or scored on other bytes than the newest "
                    "rows (`rows` trains them again): %s", ", ".join(left_out))
    summary = summarise(rows)
    sys.stdout.write(table(summary) + "\n")
    if args.json:
        write_json(args.json, {"benchmark": "device-depth", "summary": summary, "rows": rows, "left_out": left_out})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
