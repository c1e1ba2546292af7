"""Averaging scaling: M workers on a block against one machine at M times the batch, at >= 100 outer steps.

Each row trains one block with :func:`blocktrain.coordinator.simulate.run_local_rounds` (the coordinator's round in
one process: the worker's streams and persistent inner AdamW, int8 pushes with error feedback, the coordinator's
intake and ``next_version``), ``--steps`` inner steps per worker whatever M, and scores the block's own prefix
(the stack's next-byte CE through block k) on the first ``--eval-bytes`` test bytes.

* ``cold``: block 0 from its random init.
* ``warm``: block 1 initialised as the stack does it (``stack.init copy``: a copy of block 0), on a frozen block 0
  that one machine trained first for ``--steps`` at the workers' batch (cached under ``--cache``).

For every M there are two rows: ``mM`` (M workers, H inner steps per round, the outer step of ``--outer-lr`` and
``--outer-momentum``) and ``xM`` (one machine: one round of all the steps at M times the batch, plain, lossless).
The recovered fraction is (CE(x1) - CE(mM)) / (CE(x1) - CE(xM)): 1 means M workers are worth one machine with their
samples, 0 that they are worth one worker.

    flock /tmp/blocktrain-cpu.lock python benchmarks/distributed/averaging_scaling.py --preset depth-proxy --steps 1000 --h 10 \\
        --workers 1,2,4,6,12 --blocks cold,warm --seeds 0,1 --jsonl benchmarks/results/averaging-scaling.jsonl

Rows already in ``--jsonl`` are skipped (the study resumes). Prints the table; ``--plot`` writes the curve.

``--stack`` trains the whole stack instead, progressively, as a run does: every block k with the preset's own step
budget (``Objective.block_steps``: ``stack.step_ratio`` splits the steps), copy-initialised from block k-1 and trained
on frozen copies of blocks 0..k-1, in three arms: ``m{M}`` (M workers per block), ``x1`` (one worker, one machine) and
``x{M}`` (one machine at M times the batch). It scores every prefix, and the summary's ``stack`` holds the composed
model's recovered fraction:

    flock /tmp/blocktrain-cpu.lock python benchmarks/distributed/averaging_scaling.py --preset depth-proxy --stack --workers 6 \
        --h 10 --outer-lr 0.7 --outer-momentum 0.9 --reset-inner --seeds 0 --jsonl benchmarks/results/averaging-scaling.jsonl
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from blocktrain.checkpoint.safetensors_io import load_file, save_file
from blocktrain.config import CompileMode, Objective, RunConfig
from blocktrain.coordinator.settings import Aggregation, CoordinatorSettings, OuterOptimizer, per_block_h
from blocktrain.coordinator.simulate import LocalRounds, LocalRun, run_local_rounds
from blocktrain.data.dataset import DataDir, resolve_data_dir
from blocktrain.objectives import get_objective
from blocktrain.presets import get_preset
from blocktrain.protocol.delta import Compression
from blocktrain.protocol.moments import InnerStart, MomentCodec
from blocktrain.protocol.weights import load_trainable
from blocktrain.train.metrics import append_jsonl, read_jsonl


def settings_for(row: dict[str, Any]) -> tuple[CoordinatorSettings, LocalRounds]:
    """The coordinator settings and the local rounds a row names."""
    if row["kind"] == "x":  # one machine at M times the batch: one round of every step, plain and lossless
        settings = CoordinatorSettings(outer=OuterOptimizer.AVERAGE, outer_lr=1.0, step_compression=Compression.NONE,
                                       gate=False)
        inner = row.get("inner", "adamw")  # one round: another inner optimiser starts fresh (it has no shared moments)
        rounds = LocalRounds(workers=1, local_steps=row["steps"], steps=row["steps"], compression=Compression.NONE,
                             batch_size=row["batch"] * row["workers"], inner=inner,
                             reset_inner=True if inner != "adamw" else None)
        return settings, rounds
    settings = CoordinatorSettings(outer=OuterOptimizer(row.get("outer", "nesterov")), outer_lr=row["outer_lr"],
                                   outer_momentum=row["outer_momentum"], gate=False,
                                   aggregation=Aggregation(row.get("aggregation", "mean")),
                                   outer_eps=row.get("outer_eps", 1e-8), outer_cap=row.get("outer_cap"),
                                   moment_mean_v=row.get("mean_v", False), moment_every=row.get("share_every", 1),
                                   moment_codec=MomentCodec(row.get("moment_codec", "int8")))
    early = row.get("early")  # [steps, H] of an H schedule's early phase
    start = row.get("inner_start")  # a shared start replaces reset_inner's fresh/carried choice
    rounds = LocalRounds(workers=row["workers"], local_steps=row["h"], steps=row["steps"], compression=Compression.INT8,
                         batch_size=row["batch"], reset_inner=None if start else row["reset_inner"],
                         inner_start=InnerStart(start) if start else None,
                         inner=row.get("inner", "adamw"),
                         early_steps=early[0] if early else 0, early_h=early[1] if early else 0)
    return settings, rounds


def row_key(row: dict[str, Any]) -> str:
    base = f"{_stem(row)}/{row['kind']}{row['workers']}"
    if row["kind"] == "x":
        return base + (f"/inner={row['inner']}" if row.get("inner", "adamw") != "adamw" else "")
    h = "" if row.get("rounds") else f"/h{row['h']}"  # a per-block H is named by its rounds, in the stem
    return base + f"{h}/lr{row['outer_lr']}/mu{row['outer_momentum']}" + ("/reset" if row["reset_inner"] else "") \
        + _levers(row, "/")


def _stem(row: dict[str, Any]) -> str:
    """What a row and its references share: preset, block, seed, steps (and a stack's rounds per block)."""
    rounds = f"/rounds{row['rounds']}" if row.get("rounds") else ""
    compiled = f"/compile={row['compile']}" if row.get("compile", "off") != "off" else ""  # eager rows keep their keys
    return f"{row['preset']}/{row['block']}/s{row['seed']}/steps{row['steps']}{rounds}{compiled}"


def stack_h(steps: int, row: dict[str, Any]) -> int:
    """H of a stack block with ``steps`` inner steps: the row's H, or with ``rounds`` the coordinator's
    ``--local-steps 0`` rule (the largest H that still gives that block at least ``rounds`` outer steps)."""
    return per_block_h(steps, row["rounds"]) if row.get("rounds") else int(row["h"])


def _levers(row: dict[str, Any], sep: str) -> str:
    """The levers a row sets beyond H, the outer step and the reset (empty at their defaults: old keys stay)."""
    out = ""
    if row.get("inner", "adamw") != "adamw":
        out += f"{sep}inner={row['inner']}"
    if row.get("aggregation", "mean") != "mean":
        out += f"{sep}{row['aggregation']}"
    if row.get("early"):
        out += f"{sep}early={row['early'][0]}@H{row['early'][1]}"
    if row.get("outer", "nesterov") != "nesterov":
        out += f"{sep}outer={row['outer']}"
    if row.get("outer_eps", 1e-8) != 1e-8:
        out += f"{sep}eps={row['outer_eps']:g}"
    if row.get("outer_cap") is not None:
        out += f"{sep}cap={row['outer_cap']:g}"
    if row.get("inner_start"):
        out += f"{sep}start={row['inner_start']}"
    if row.get("share_every", 1) != 1:
        out += f"{sep}every={row['share_every']}"
    if row.get("mean_v"):
        out += f"{sep}mean_v"
    if row.get("moment_codec", "int8") != "int8":
        out += f"{sep}codec={row['moment_codec']}"
    return out


def warm_start(cfg: RunConfig, data: DataDir, steps: int, cache: Path) -> nn.Module:
    """Block 0 trained by one machine for ``steps`` at the run's batch (seed 0), cached as safetensors."""
    objective = get_objective(cfg)
    path = cache / f"{cfg.name}-block0-{steps}.safetensors"
    block = objective.build_block(0)
    if path.is_file():
        load_trainable(block, load_file(path)[0])
        return block
    settings, rounds = settings_for({"kind": "x", "workers": 1, "steps": steps, "batch": cfg.train.batch_size})
    run = run_local_rounds(replace(cfg, train=replace(cfg.train, seed=0)), settings, rounds, data, progress=True)
    cache.mkdir(parents=True, exist_ok=True)
    save_file(path, run.weights, {"kind": "block", "block_index": "0"})
    load_trainable(block, run.weights)
    return block


def measure(cfg: RunConfig, row: dict[str, Any], data: DataDir, args: argparse.Namespace) -> dict[str, Any]:
    cfg = replace(cfg, train=replace(cfg.train, seed=row["seed"]))
    objective = get_objective(cfg)
    settings, rounds = settings_for(row)
    k, frozen, earlier = 0, [], []
    if row["block"] == "warm":
        first = warm_start(cfg, data, row["steps"], args.cache)
        k, earlier = 1, [first]
        frozen = [objective.freeze(first, torch.float32)]
    run: LocalRun = run_local_rounds(cfg, settings, rounds, data, k=k, frozen=frozen, earlier=earlier,
                                     progress=not args.no_progress)
    ce = run.test_ce(cfg, data, args.eval_bytes, k=k, frozen=frozen)
    return {**row, "key": row_key(row), "k": k, "outer_steps": rounds.rounds, "ce_nats_per_byte": ce,
            "eval_split": "test", "eval_bytes": args.eval_bytes, "wall_s": run.wall_s,
            "refused": sum(1 for u in run.updates if u.outcome != "accepted"), **traffic(run), **norm_ratios(run)}


def norm_ratios(run: LocalRun) -> dict[str, Any]:
    """Every update's norm per unit of lr over the median of the block's recent ones, as the intake saw it: the
    spread of honest norms that the norm bound is set from (issue 44)."""
    ratios = sorted(u.norm_ratio for u in run.updates if u.norm_ratio is not None)
    return {"norm_ratios": [round(r, 4) for r in ratios]}


def traffic(run: LocalRun) -> dict[str, float]:
    """Bytes one worker moves per round (pushed: delta plus moments; pulled: the step plus published moments), on the
    wire (deflated) and raw, over the block's fp32 size."""
    fp32 = 4 * sum(t.numel() for t in run.weights.values())
    mean = statistics.fmean
    return {"block_fp32_bytes": fp32,
            "push_ratio": mean(run.push_bytes) / fp32 if run.push_bytes else 0.0,
            "push_ratio_raw": mean(run.raw_push_bytes) / fp32 if run.raw_push_bytes else 0.0,
            "pull_ratio": mean(run.pull_bytes) / fp32 if run.pull_bytes else 0.0,
            "pull_ratio_raw": mean(run.raw_pull_bytes) / fp32 if run.raw_pull_bytes else 0.0}


def measure_stack(cfg: RunConfig, row: dict[str, Any], data: DataDir, args: argparse.Namespace) -> dict[str, Any]:
    """One arm of the stack study: every block in turn with its own step budget; the CE of every prefix."""
    cfg = replace(cfg, train=replace(cfg.train, seed=row["seed"], steps=row["steps"]))
    objective = get_objective(cfg)
    trained: list[nn.Module] = []
    prefix_ce, outer_steps, block_steps, wall = [], [], [], 0.0
    hs = []
    for k in range(cfg.model.n_blocks):
        h = stack_h(objective.block_steps(k), row)
        steps = objective.block_steps(k) // h * h  # whole rounds of H
        settings, rounds = settings_for({**row, "kind": row["kind"], "steps": steps, "h": h})
        frozen = [objective.freeze(b, torch.float32) for b in trained]
        run = run_local_rounds(cfg, settings, rounds, data, k=k, frozen=frozen, earlier=trained,
                               progress=not args.no_progress)
        trained.append(run.block)
        prefix_ce.append(run.test_ce(cfg, data, args.eval_bytes, k=k, frozen=frozen))
        outer_steps.append(rounds.rounds)
        block_steps.append(steps)
        hs.append(h)
        wall += run.wall_s
        print(f"  block {k}: {steps} steps, {rounds.rounds} rounds, prefix CE {prefix_ce[-1]:.4f}", file=sys.stderr,
              flush=True)
    return {**row, "key": row_key(row), "ce_nats_per_byte": prefix_ce[-1], "prefix_ce": prefix_ce,
            "outer_steps": outer_steps, "block_steps": block_steps, "block_h": hs, "eval_split": "test", "eval_bytes": args.eval_bytes,
            "wall_s": wall}


def stack_summary(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The composed stack's M workers against one worker and one machine at M x the batch, per seed and mean."""
    per_seed = []
    by = {x["key"]: x for x in rows}
    for r in rows:
        if r["block"] != "stack" or r["kind"] != "m":
            continue
        stem = _stem(r)
        one, big = by.get(f"{stem}/x1"), by.get(f"{stem}/x{r['workers']}")
        if one is None or big is None:
            continue
        gain = one["ce_nats_per_byte"] - big["ce_nats_per_byte"]
        per_seed.append({"seed": r["seed"], "workers": r["workers"], "setting": _setting(r),
                         "six_worker_ce": r["ce_nats_per_byte"], "single_ce": one["ce_nats_per_byte"],
                         "batch96_ce": big["ce_nats_per_byte"], "outer_steps": r["outer_steps"], "eval_bytes": r["eval_bytes"],
                         "prefix_ce": {"m": r["prefix_ce"], "x1": one["prefix_ce"], "xM": big["prefix_ce"]},
                         "recovered_fraction": (one["ce_nats_per_byte"] - r["ce_nats_per_byte"]) / gain if gain > 0 else None,
                         "command": r["command"]})
    if not per_seed:
        return None
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for p in per_seed:
        groups.setdefault((p["setting"], tuple(p["outer_steps"])), []).append(p)
    settings = []
    for seeds in groups.values():
        fr = [p["recovered_fraction"] for p in seeds if p["recovered_fraction"] is not None]
        settings.append({
            "preset": rows[0]["preset"], "workers": seeds[0]["workers"], "setting": seeds[0]["setting"],
            "batch96_note": "one machine at M x the batch (M = workers), the same steps per block, the same recipe",
            "six_worker_ce": statistics.fmean(p["six_worker_ce"] for p in seeds),
            "single_ce": statistics.fmean(p["single_ce"] for p in seeds),
            "batch96_ce": statistics.fmean(p["batch96_ce"] for p in seeds),
            "outer_steps": seeds[0]["outer_steps"], "recovered_fraction": statistics.fmean(fr) if fr else None,
            "seeds": seeds})
    chosen = max(settings, key=lambda g: (len(g["seeds"]), g["recovered_fraction"] or float("-inf")))
    return {**chosen, "chosen_by": "the setting run on the most seeds, then the highest mean recovered fraction, "
                                   "on the test split (the stack rows record no validation CE): a best-of-settings "
                                   "figure, an upper estimate of what a setting fixed beforehand recovers; "
                                   "'settings' holds every setting run, losing ones included",
            "settings": settings}


def write_reference(summary: dict[str, Any] | None, path: Path) -> None:
    """The big-batch arm of the chosen stack setting, per seed: the equal-samples reference of M workers."""
    if summary is None:
        raise SystemExit(f"no whole-stack arms of this preset to write to {path}: run --stack first")
    seeds = summary["seeds"]
    doc = {"what": f"one machine at {summary['workers']} times the batch, the same steps per block and recipe as the "
                   f"{summary['workers']} workers of the whole {summary['preset']} stack (in process, "
                   "benchmarks/distributed/averaging_scaling.py --stack)",
           "preset": summary["preset"], "split": "test", "bytes_scored": seeds[0]["eval_bytes"],
           "ce_nats_per_byte": summary["batch96_ce"], "six_worker_ce_nats_per_byte": summary["six_worker_ce"],
           "single_batch16_ce_nats_per_byte": summary["single_ce"],
           "six_worker_setting": summary["setting"], "recovered_fraction": summary["recovered_fraction"],
           "per_seed": [{"seed": p["seed"], "ce_nats_per_byte": p["batch96_ce"], "prefix_ce": p["prefix_ce"]["xM"],
                         "six_worker_ce_nats_per_byte": p["six_worker_ce"], "single_ce_nats_per_byte": p["single_ce"],
                         "command": p["command"]} for p in seeds]}
    path.write_text(json.dumps(doc, indent=1) + "\n")


def recovered(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (block, seed, settings, M): the recovered fraction against x1 and xM of the same block, seed and steps."""
    by = {r["key"]: r for r in rows}
    out = []
    for r in rows:
        if r["kind"] != "m" or r["block"] == "stack":
            continue
        stem = _stem(r)
        inner = r.get("inner", "adamw")
        own = "" if inner == "adamw" else f"/inner={inner}"  # the references with the row's own optimiser, if run
        one, big = by.get(f"{stem}/x1{own}"), by.get(f"{stem}/x{r['workers']}{own}")
        ref_inner = inner
        if one is None or big is None:
            one, big, ref_inner = by.get(f"{stem}/x1"), by.get(f"{stem}/x{r['workers']}"), "adamw"
        if one is None or big is None:
            continue
        gain = one["ce_nats_per_byte"] - big["ce_nats_per_byte"]
        frac = (one["ce_nats_per_byte"] - r["ce_nats_per_byte"]) / gain if r["workers"] > 1 and gain > 0 else None
        out.append({**r, "single_ce": one["ce_nats_per_byte"], "big_batch_ce": big["ce_nats_per_byte"],
                    "recovered_fraction": frac, "reference_inner": ref_inner})
    return out


def _setting(r: dict[str, Any]) -> str:
    ref = r.get("reference_inner", "adamw")
    h = f"H per block ({'/'.join(map(str, r['block_h']))}, >= {r['rounds']} rounds)" if r.get("rounds") else f"H={r['h']}"
    return f"{h} lr={r['outer_lr']} mu={r['outer_momentum']}" + (" reset" if r["reset_inner"] else "") \
        + _levers(r, " ") + (f" (references {ref})" if ref != r.get("inner", "adamw") else "")


def table(rows: list[dict[str, Any]]) -> str:
    rec = recovered(rows)
    lines = ["| block | steps | outer steps | setting | M | seeds | CE one worker | CE M workers | CE one machine M× batch "
             "| recovered (mean) | spread |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for r in rec:
        groups.setdefault((r["preset"], r["block"], r["steps"], _setting(r), r["workers"]), []).append(r)
    for (_, block, steps, setting, m), rs in sorted(groups.items()):
        fr = [r["recovered_fraction"] for r in rs if r["recovered_fraction"] is not None]
        mean = f"{statistics.fmean(fr):.2f}" if fr else "—"
        spread = f"{min(fr):.2f}..{max(fr):.2f}" if len(fr) > 1 else "—"
        lines.append(
            f"| {block} | {steps} | {rs[0]['outer_steps']} | {setting} | {m} | {','.join(str(r['seed']) for r in rs)} "
            f"| {statistics.fmean(r['single_ce'] for r in rs):.4f} | {statistics.fmean(r['ce_nats_per_byte'] for r in rs):.4f} "
            f"| {statistics.fmean(r['big_batch_ce'] for r in rs):.4f} | {mean} | {spread} |")
    return "\n".join(lines)


def stack_table(rows: list[dict[str, Any]]) -> str:
    """The whole-stack arms, prefix by prefix, with each prefix's recovered fraction."""
    summary = stack_summary(rows)
    if summary is None:
        return ""
    lines = ["| seed | arm | outer steps per block | prefix CEs (blocks 0..k) | composed CE | recovered |",
             "|---|---|---|---|---|---|"]
    shown = set()  # a seed's references are printed once, whatever the settings run against them
    for s in (p for g in summary["settings"] for p in g["seeds"]):
        pre = s["prefix_ce"]
        rec = [(a - m) / (a - b) if a > b else float("nan") for a, m, b in zip(pre["x1"], pre["m"], pre["xM"], strict=True)]
        for arm, name in (("x1", "one worker (batch 16)"), ("xM", f"one machine at {s['workers']}x the batch"),
                          ("m", f"{s['workers']} workers, {s['setting']}")):
            if arm != "m" and (s["seed"], arm, tuple(pre[arm])) in shown:
                continue
            shown.add((s["seed"], arm, tuple(pre[arm])))
            steps = ", ".join(str(x) for x in s["outer_steps"]) if arm == "m" else "1 (all steps)"
            frac = ", ".join(f"{x:.2f}" for x in rec) if arm == "m" else ""
            lines.append(f"| {s['seed']} | {name} | {steps} | {', '.join(f'{c:.4f}' for c in pre[arm])} | {pre[arm][-1]:.4f} "
                         f"| {frac} |")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[str, dict[int, list[float]]] = {}
    for r in recovered(rows):
        if r["recovered_fraction"] is not None:
            key = f"{r['block']} ({_setting(r)}, {r['outer_steps']} outer steps)"
            series.setdefault(key, {}).setdefault(r["workers"], []).append(r["recovered_fraction"])
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, pts in sorted(series.items()):
        if len(pts) < 2:  # a lever measured at one M is in the table, not on the curve
            continue
        ms = sorted(pts)
        ax.plot(ms, [statistics.fmean(pts[m]) for m in ms], marker="o", label=key)
    ax.axhline(1.0, color="k", lw=0.5, label="one machine at M x the batch")
    ax.set(xlabel="workers M", ylabel="recovered fraction of the M× batch gain", title="averaging: what M workers are worth")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def planned_rows(args: argparse.Namespace, cfg: RunConfig) -> list[dict[str, Any]]:
    """The rows the flags ask for: per block, seed and M, the references and the M-worker row with its levers."""
    todo: list[dict[str, Any]] = []
    for block in ["stack"] if args.stack else args.blocks.split(","):
        for seed in (int(s) for s in args.seeds.split(",")):
            for m in (int(x) for x in args.workers.split(",")):
                steps = args.steps or (cfg.train.steps if block == "stack" else 1000)  # a stack splits train.steps
                common = {"preset": cfg.name, "block": block, "seed": seed, "steps": steps, "workers": m,
                          "batch": cfg.train.batch_size,
                          **({"compile": args.compile} if args.compile != CompileMode.OFF.value else {})}
                if block == "stack":  # the one-worker arm of the stack runs at the workers' H, for its rounds
                    common.update({"h": args.h, **({"rounds": args.rounds} if args.rounds else {})})
                    todo.append({**common, "kind": "x", "workers": 1})
                todo.append({**common, "kind": "x", **({"inner": args.inner} if args.refs_inner else {})})
                if not args.refs_only:
                    levers: dict[str, Any] = {"inner": args.inner, "aggregation": args.aggregation}
                    if args.outer != "nesterov":
                        levers["outer"] = args.outer
                    if args.outer_eps != 1e-8:
                        levers["outer_eps"] = args.outer_eps
                    if args.outer_cap is not None:
                        levers["outer_cap"] = args.outer_cap
                    if args.inner_start:
                        levers["inner_start"] = args.inner_start
                    if args.share_every != 1:
                        levers["share_every"] = args.share_every
                    if args.mean_v:
                        levers["mean_v"] = True
                    if args.moment_codec != "int8":
                        levers["moment_codec"] = args.moment_codec
                    if args.early:
                        levers["early"] = [int(x) for x in args.early.split("@")]
                    todo.append({**common, "kind": "m", "h": args.h, "outer_lr": args.outer_lr,
                                 "outer_momentum": args.outer_momentum, "reset_inner": args.reset_inner, **levers})
    return todo


def winner_section(ap: argparse.ArgumentParser, cfg: RunConfig, flags: str, every: list[dict[str, Any]],
                   http: Path | None) -> dict[str, Any]:
    """The chosen setting (``--winner FLAGS``: the study's own flags): its recovered fraction per seed on block 0 and
    on the whole stack, the live HTTP run, and its traffic per worker and round over the block's fp32 size."""
    by = {r["key"]: r for r in recovered(every)}
    summary = stack_summary([r for r in every if r["preset"] == cfg.name])

    def part(extra: str) -> dict[str, Any]:
        wanted = planned_rows(ap.parse_args([*shlex.split(flags), *shlex.split(extra), "--jsonl", "-"]), cfg)
        rows = [by[row_key(w)] for w in wanted if w["kind"] == "m" and row_key(w) in by]
        fr = {r["seed"]: r["recovered_fraction"] for r in rows if r["recovered_fraction"] is not None}
        return {"seeds": sorted(fr), "recovered": [fr[s] for s in sorted(fr)],
                "mean": statistics.fmean(fr.values()) if fr else None, "worst": min(fr.values()) if fr else None,
                "keys": [r["key"] for r in rows]}

    block0 = part("--blocks cold --steps 690 --workers 6 --seeds 0,1,2,3,4")
    stack: dict[str, Any] = {"seeds": [], "recovered": [], "mean": None, "worst": None}
    wanted = planned_rows(ap.parse_args([*shlex.split(flags), "--stack", "--rounds", "100", "--workers", "6",
                                         "--seeds", "0,1,2,3,4", "--jsonl", "-"]), cfg)
    keys = {row_key(w) for w in wanted if w["kind"] == "m"}
    arms = [r for r in every if r["key"] in keys]
    if summary is not None and arms:
        group = next((g for g in summary["settings"] if g["setting"] == _setting(arms[0])), None)
        fr = {p["seed"]: p["recovered_fraction"] for p in (group or {}).get("seeds", [])
              if p["recovered_fraction"] is not None}
        stack = {"seeds": sorted(fr), "recovered": [fr[x] for x in sorted(fr)],
                 "mean": statistics.fmean(fr.values()) if fr else None, "worst": min(fr.values()) if fr else None,
                 "six_worker_ce": group["six_worker_ce"] if group else None,
                 "single_ce": group["single_ce"] if group else None, "batch96_ce": group["batch96_ce"] if group else None}
    traffic = [by[k] for k in block0["keys"]]
    return {"setting": flags, "block0": block0, "stack": stack,
            "http": http_section(http, stack.get("batch96_ce")) if http is not None and http.is_file() else None,
            "traffic_ratio": statistics.fmean(r["push_ratio"] for r in traffic) if traffic else None,
            "traffic_ratio_note": "bytes pushed per worker per round (delta plus moments, deflated as sent) over the "
                                  "block's fp32 bytes; pull_ratio in the rows: the published step plus moments"}


def http_section(path: Path, batch96_ce: float | None) -> dict[str, Any]:
    """The live run (``scripts/exp_six_workers.sh``'s JSON: six worker processes over HTTP on the coordinator's
    defaults, and ``blocktrain train`` as its single machine) against the in-process one-machine-at-6x-batch reference
    of the same stack: recovered = (single - six) / (single - batch96)."""
    run = json.loads(path.read_text())
    six, single = run["six_worker_ce_nats_per_byte"], run["single_machine_ce_nats_per_byte"]
    gain = None if batch96_ce is None else single - batch96_ce
    return {"six_worker_ce": six, "single_ce": single, "batch96_ce": batch96_ce,
            "recovered": (single - six) / gain if gain else None, "command": run["command"], "file": str(path),
            "batch96_note": "the in-process reference's mean over the stack's seeds (one machine at 6x the batch)"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="depth-proxy")
    ap.add_argument("--steps", type=int, default=None,
                    help="inner steps per worker, whatever M (default 1000; --stack: the preset's train.steps)")
    ap.add_argument("--h", type=int, default=10, help="inner steps per round")
    ap.add_argument("--outer-lr", type=float, default=0.7)
    ap.add_argument("--outer-momentum", type=float, default=0.9)
    ap.add_argument("--reset-inner", action="store_true", help="fresh inner AdamW moments every round")
    ap.add_argument("--inner", default="adamw", choices=["adamw", "muon"], help="inner optimiser")
    ap.add_argument("--aggregation", default="mean", choices=[a.value for a in Aggregation])
    ap.add_argument("--outer", default="nesterov", choices=[o.value for o in OuterOptimizer], help="outer step")
    ap.add_argument("--outer-eps", type=float, default=1e-8, help="outer adam: tau added to sqrt(u)")
    ap.add_argument("--outer-cap", type=float, default=None, help="cap the outer step's norm at this x ||mean delta||")
    ap.add_argument("--inner-start", default=None, choices=[x.value for x in InnerStart],
                    help="what each round's inner AdamW starts from (replaces --reset-inner; shared_*: moments pushed "
                         "and published)")
    ap.add_argument("--share-every", type=int, default=1,
                    help="shared moments every this many rounds (DES-LOC; the coordinator's --moment-every, whose "
                         "default is 3; 1 here, as in the rows before it)")
    ap.add_argument("--moment-codec", default="int8", choices=[c.value for c in MomentCodec],
                    help="encoding of shared moments on the wire")
    ap.add_argument("--mean-v", action="store_true",
                    help="with shared m and v: publish the v of the workers' mean gradient (moment_mean_v)")
    ap.add_argument("--early", default=None, metavar="STEPS@H",
                    help="H schedule: the first STEPS inner steps in rounds of H, then --h (e.g. 250@5)")
    ap.add_argument("--workers", default="1,2,4,6,12", help="comma-separated M")
    ap.add_argument("--blocks", default="cold,warm")
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--refs-only", action="store_true", help="only the one-machine rows")
    ap.add_argument("--refs-inner", action="store_true",
                    help="the one-machine rows train with --inner too (the reference of a lever that changes the optimiser)")
    ap.add_argument("--stack", action="store_true", help="the whole stack, progressively, with the stack objective whatever the preset's "
                         "(--blocks is ignored)")
    ap.add_argument("--rounds", type=int, default=0,
                    help="--stack: H per block, the largest that gives every block at least this many outer steps "
                         "(0: --h for every block)")
    ap.add_argument("--data", default=None, help="data directory (default: $BLOCKTRAIN_DATA)")
    ap.add_argument("--eval-bytes", type=int, default=65536, help="test bytes scored")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cache", type=Path, default=Path("/tmp/blocktrain-averaging-scaling"),
                    help="where the warm block's trained block 0 is kept")
    ap.add_argument("--jsonl", type=Path, required=True, help="append rows here; rows already in it are skipped")
    ap.add_argument("--json", type=Path, default=None, help="write the summary (rows with recovered fractions) here")
    ap.add_argument("--stack-preset", default=None,
                    help="the preset whose whole-stack arms the summary's 'stack' holds (default: --preset); "
                         "'stacks' holds every preset's")
    ap.add_argument("--plot", type=Path, default=None)
    ap.add_argument("--batch96-json", type=Path, default=None,
                    help="write the --preset stack's M x batch machine here, as the six-worker stack's reference")
    ap.add_argument("--table-only", action="store_true")
    ap.add_argument("--winner", default=None, metavar="FLAGS",
                    help="with --json: the chosen setting, as this study's flags; its summary goes under 'winner'")
    ap.add_argument("--http-json", type=Path, default=None, help="the winner's live HTTP run (for 'winner')")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--device", default="cpu", help="where the replicas and the references train: cpu, cuda, auto")
    ap.add_argument("--compile", default=CompileMode.OFF.value, choices=[m.value for m in CompileMode],
                    help="torch.compile of each replica's block and its frozen inputs, as `blocktrain worker --compile`")
    args = ap.parse_args()
    cfg = get_preset(args.preset)
    cfg = replace(cfg, train=replace(cfg.train, device=args.device, compile=CompileMode(args.compile)))
    if args.stack:  # the whole stack, whatever the preset's own objective (tiny's is diffusion)
        cfg = replace(cfg, objective=Objective.STACK)
    elif not args.table_only and "warm" in args.blocks.split(",") and cfg.objective != Objective.STACK:
        ap.error(f"--blocks warm trains block 1 on a frozen block 0, which only the stack objective has; the preset "
                 f"{args.preset!r} trains {Objective(cfg.objective).value}: use --blocks cold, or a stack preset (cpu-mini, cpu-small)")
    done = {r["key"] for r in _read(args.jsonl)}
    command = "python benchmarks/distributed/averaging_scaling.py " + " ".join(sys.argv[1:])
    todo = planned_rows(args, cfg)
    if not args.table_only:
        torch.set_num_threads(args.threads)  # only where it trains: a table is made in its caller's threads
        data = resolve_data_dir(args.data)
        for row in todo:
            if row_key(row) in done:
                continue
            print("+", row_key(row), file=sys.stderr, flush=True)
            out = (measure_stack if row["block"] == "stack" else measure)(cfg, row, data, args)
            out["command"] = command
            append_jsonl(args.jsonl, out)
            done.add(out["key"])
            print(f"{out['key']}: CE {out['ce_nats_per_byte']:.4f} in {out['wall_s']:.0f} s", file=sys.stderr, flush=True)
    every = _read(args.jsonl)
    rows = [r for r in every if r["preset"] == cfg.name]
    print(table(rows))
    print(stack_table(rows))
    if args.json:
        stacks = {p: stack_summary([r for r in every if r["preset"] == p]) for p in sorted({r["preset"] for r in every})}
        doc = {"rows": recovered(every),  # every preset's rows, each naming its preset
               "stack": stacks.get(args.stack_preset or cfg.name),
               "stacks": {p: s for p, s in stacks.items() if s is not None}}
        if args.winner:
            doc["winner"] = winner_section(ap, cfg, args.winner, [r for r in every if r["preset"] == cfg.name],
                                           args.http_json)
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
    if args.batch96_json:
        write_reference(stack_summary(rows), args.batch96_json)
    if args.plot:
        plot(rows, args.plot)
    return 0


def _read(path: Path) -> list[dict[str, Any]]:
    return read_jsonl(path) if path.is_file() else []


if __name__ == "__main__":
    raise SystemExit(main())
