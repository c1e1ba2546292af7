"""Hostile workers against the coordinator's own defences, in process (issue 44, item 7): one row per attack.

Every row trains block 0 of a ``stack`` run with ``--workers`` honest replicas plus the attack's hostile ones
(:mod:`.attacks`; two for ``colluding``) through the coordinator's round in one process
(:func:`blocktrain.coordinator.simulate.run_local_rounds`: the same parsing, intake, audits, aggregation and outer
step, with the coordinator's default settings). The honest replicas draw the same data streams in every row (a
stream is keyed by the replica's id), so a hostile worker whose every update is refused leaves the run exactly as
the row without it (``clean``): each row's CE difference from ``clean`` is what the attack achieved.

* ``--attack-from``: the version each hostile worker starts attacking at; before it, it trains and pushes honestly.
  The default, ``--probation-pushes`` (3), is a worker that passes its probation first (every push of it audited),
  then cheats; ``0`` attacks from its first push.
* ``p_undetected``: the probability that a worker mounting the attack from ``--attack-from`` on goes undetected
  over one block, from what caught it in this run: 0 where the intake refused its first attacking push (the same
  check refuses every one) or its refusals quarantined it later (``hostile_accepted``: what was applied before),
  (1 - audit_fraction)^n where only a sampled audit catches it (n: its attacking pushes over the block; 0 where it
  attacks on probation, when every push is audited), 1 where nothing did.

    flock /tmp/blocktrain-cpu.lock python -m benchmarks.distributed.hostile_peers --preset cpu-mini --steps 690 --h 6 \\
        --out benchmarks/results/hostile-peers.json

Rows already in ``--out`` are kept (the study resumes); each holds its command.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from benchmarks.distributed.attacks import ATTACKS, COLLUDERS, hostile_replicas
from blocktrain.coordinator.settings import CoordinatorSettings
from blocktrain.coordinator.simulate import LocalRounds, LocalRun, run_local_rounds
from blocktrain.data.dataset import resolve_data_dir
from blocktrain.presets import get_preset
from blocktrain.train.metrics import write_json

CAUGHT_AT_INTAKE = {"claim", "norm", "lazy", "replay", "gate", "stale", "base"}  # refusals that recur on every push


def run_row(kind: str, args: argparse.Namespace, settings: CoordinatorSettings) -> dict[str, Any]:
    commit = _commit()  # as the row starts: the code it runs
    cfg = get_preset(args.preset).with_train(seed=args.seed)
    n_bad = COLLUDERS.get(kind, 1) if kind != "clean" else 0
    opts = LocalRounds(workers=args.workers + n_bad, local_steps=args.h, steps=args.steps)
    data = resolve_data_dir(args.data)
    bad = hostile_replicas(kind, args.attack_from) if kind != "clean" else []
    run = run_local_rounds(cfg, settings, opts, data, progress=not args.no_progress, hostile=bad, audit=True)
    ce = run.test_ce(cfg, data, args.eval_bytes)
    hostile = set(range(args.workers, args.workers + n_bad))
    return {"kind": kind, "attack_from": args.attack_from, "seed": args.seed, "moment_every": settings.moment_every,
            "ce_nats_per_byte": ce,
            **outcome(run, hostile, settings, args.attack_from), "wall_s": run.wall_s,
            "command": f"python -m benchmarks.distributed.hostile_peers {' '.join(args.argv)} --kinds {kind}",
            "commit": commit}


def _commit() -> str:
    """The checkout's commit (the worktree the study runs from), or "unknown" outside git."""
    try:
        done = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=40"], cwd=Path(__file__).parent,
                              capture_output=True, text=True, check=False)
    except OSError:  # no git on this machine
        return "unknown"
    return done.stdout.strip() or "unknown"


def outcome(run: LocalRun, hostile: set[int], settings: CoordinatorSettings, attack_from: int) -> dict[str, Any]:
    """What became of every update: the honest ones refused, the hostile ones by outcome, who was quarantined when,
    the norm ratios of honest updates, and the probability that the attack goes undetected over one block."""
    honest = [u for u in run.updates if u.replica not in hostile]
    attacking = [u for u in run.updates if u.replica in hostile and u.hostile]
    by: dict[str, int] = {}
    for u in attacking:
        by[u.outcome] = by.get(u.outcome, 0) + 1
    first = attacking[0].outcome if attacking else None
    rounds = max((u.round for u in run.updates), default=0) + 1
    pushes = max(0, rounds - min((u.round for u in attacking), default=rounds))  # its attacking pushes over the block
    if not attacking:
        p = None
    elif first in CAUGHT_AT_INTAKE or caught_for_sure(by, bool(hostile & set(run.quarantined)), attack_from, settings):
        p = 0.0
    elif "audit" in by:
        p = (1.0 - settings.audit_fraction) ** pushes
    else:
        p = 1.0
    ratios = [u.norm_ratio for u in honest if u.norm_ratio is not None]
    return {"honest_updates": len(honest), "honest_refused": sum(u.outcome not in ("accepted", "screened") for u in honest),
            "honest_screened": sum(u.outcome == "screened" for u in honest),
            "hostile_updates": len(attacking), "hostile_by_outcome": by,
            "hostile_accepted": by.get("accepted", 0), "quarantined_at": {str(i): v for i, v in run.quarantined.items()},
            "p_undetected": p, "honest_norm_ratios": sorted(ratios)[-5:] if ratios else [],
            "honest_norm_ratio_max": max(ratios) if ratios else None, "honest_norm_ratio_count": len(ratios)}


def caught_for_sure(by_outcome: dict[str, int], quarantined: bool, attack_from: int,
                    settings: CoordinatorSettings) -> bool:
    """A quarantined worker was caught for sure unless a sampled audit caught it: its refusals quarantined it (what
    it pushed before is in ``hostile_accepted``), or it attacked on probation, when every push is audited."""
    return quarantined and ("audit" not in by_outcome or attack_from < settings.probation_pushes)


def table(rows: list[dict[str, Any]]) -> str:
    """One line per row. ``vs clean``: its CE minus the run without the hostile worker. ``vs probation``: minus the
    run whose hostile worker pushes honestly until ``attacks from`` and is refused at every push after (the inflated
    claim's row, refused by the claim check from its first attacking push; without it, a non-colluding row of the
    same start none of whose attacking pushes was applied, ``strong`` say): what the attack added to the honest
    pushes it made on probation."""

    def every(r: dict[str, Any]) -> int:  # a row is read against the references run at its moment cadence
        return int(r.get("moment_every", 1))

    clean = {(r["seed"], every(r)): r["ce_nats_per_byte"] for r in rows if r["kind"] == "clean"}
    probation = {(r["seed"], r["attack_from"], every(r)): r["ce_nats_per_byte"] for r in rows  # any refused-throughout
                 if r["kind"] not in ("clean", "colluding") and r["attack_from"] > 0 and r["hostile_accepted"] == 0}
    probation.update({(r["seed"], r["attack_from"], every(r)): r["ce_nats_per_byte"] for r in rows
                      if r["kind"] == "inflated_claim"})  # the named reference where it was run
    lines = ["| attack | attacks from | CE | vs clean | vs probation | hostile pushes | accepted | caught by "
             "| quarantined at | p undetected | honest refused |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ref = clean.get((r["seed"], every(r)))
        diff = "—" if ref is None or r["kind"] == "clean" else f"{r['ce_nats_per_byte'] - ref:+.4f}"
        pref = probation.get((r["seed"], r["attack_from"], every(r)))
        pdiff = "—" if pref is None or r["kind"] == "clean" else f"{r['ce_nats_per_byte'] - pref:+.4f}"
        caught = ", ".join(f"{k} {n}" for k, n in sorted(r["hostile_by_outcome"].items()) if k != "accepted") or "—"
        quarantined = ", ".join(f"v{v}" for v in r["quarantined_at"].values()) or "—"
        p = "—" if r["p_undetected"] is None else f"{r['p_undetected']:.3g}"
        cadence = f" (moments every {every(r)} rounds)" if every(r) != 1 else ""
        lines.append(f"| {r['kind']}{cadence} | {r['attack_from'] if r['kind'] != 'clean' else '—'} | {r['ce_nats_per_byte']:.4f} "
                     f"| {diff} | {pdiff} | {r['hostile_updates']} | {r['hostile_accepted']} | {caught} | {quarantined} | {p} "
                     f"| {r['honest_refused']} of {r['honest_updates']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="cpu-mini")
    ap.add_argument("--steps", type=int, default=690, help="inner steps per replica")
    ap.add_argument("--h", type=int, default=6, help="H: inner steps per round")
    ap.add_argument("--workers", type=int, default=6, help="honest replicas")
    ap.add_argument("--attack-from", type=int, default=None,
                    help="the version hostile workers start attacking at (default: --probation-pushes, after probation)")
    ap.add_argument("--eval-bytes", type=int, default=32768)
    ap.add_argument("--seed", type=int, default=0, help="train.seed: the blocks' init and every worker's stream")
    ap.add_argument("--kinds", default=",".join(["clean", *ATTACKS]))
    ap.add_argument("--data", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, required=True, help="hostile-peers.json (rows of other kinds are kept)")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--moment-every", type=int, default=None,
                    help="shared moments every this many rounds (default: the coordinator's; the committed rows ran at 1)")
    ap.add_argument("--table-only", action="store_true", help="print the table of the rows in --out; run nothing")
    args = ap.parse_args(argv)
    args.argv = [a for a in (argv if argv is not None else sys.argv[1:])]
    if "--kinds" in args.argv:  # each row names its own kind
        at = args.argv.index("--kinds")
        del args.argv[at:at + 2]
    settings = CoordinatorSettings()  # the coordinator's defaults
    if args.moment_every is not None:
        settings = replace(settings, moment_every=args.moment_every)
    if args.attack_from is None:
        args.attack_from = settings.probation_pushes
    if not args.table_only:
        torch.set_num_threads(args.threads)  # only where it trains: a table is made in its caller's threads
    doc: dict[str, Any] = json.loads(args.out.read_text()) if args.out.is_file() else {}
    if "runs" in doc:  # the study before these rows (other settings and attacks): kept as it was
        doc["earlier_runs"] = {"what": doc.pop("what", None), "command": doc.pop("command", None), "runs": doc.pop("runs")}
    rows = {_key(r): r for r in doc.get("rows", [])}
    for r in rows.values():  # rows written before caught_for_sure counted such a worker as detected
        if caught_for_sure(r["hostile_by_outcome"], bool(r["quarantined_at"]), r["attack_from"], settings):
            r["p_undetected"] = 0.0
    for kind in [] if args.table_only else args.kinds.split(","):
        if kind != "clean" and kind not in ATTACKS:
            ap.error(f"unknown kind {kind!r}; choose from clean, {', '.join(ATTACKS)}")
        key = _key({"kind": kind, "attack_from": args.attack_from, "seed": args.seed, "moment_every": settings.moment_every})
        if key in rows:
            continue
        print("+", key, file=sys.stderr, flush=True)
        rows[key] = run_row(kind, args, settings)
        doc.update({"what": (f"block 0 of a stack run ({args.preset}), {args.workers} honest replicas plus the attack's "
                             "hostile ones, in process with the coordinator's intake, audits, aggregation and outer step "
                             "(its default settings); CE on the first eval bytes of the test split"),
                    "settings": settings.to_dict(),
                    "rows": list(rows.values())})
        write_json(args.out, doc)  # written after every row (whole or not at all): a cut study keeps them
    if rows:  # the rows as they stand (a migrated p_undetected included)
        doc["rows"] = list(rows.values())
        write_json(args.out, doc)
    print(table(list(rows.values())))
    return 0


def _key(r: dict[str, Any]) -> str:
    every = r.get("moment_every", 1)  # rows written before moment_every's default became 3 ran at 1
    return f"{r['kind']}/from{r['attack_from'] if r['kind'] != 'clean' else '-'}/s{r['seed']}" + \
        (f"/every{every}" if every != 1 else "")


if __name__ == "__main__":
    raise SystemExit(main())
