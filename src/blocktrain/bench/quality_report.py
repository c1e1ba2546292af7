"""The result of ``bench quality``: its derived figures (gains, gaps) and its markdown table, one column per model,
rows of CE, composition, cost and speed; the JSON and the table written together."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from blocktrain.evaluate.report import compositional_gain

log = logging.getLogger(__name__)

MIB = 2**20


def _flops(x: float) -> str:
    """FLOPs in the unit that shows them: PFLOPs from 0.1 up, else TFLOPs."""
    return f"{x / 1e15:.2f} PFLOPs" if x >= 1e14 else f"{x / 1e12:.2f} TFLOPs"


def _fmt_list(values: list[float]) -> str:
    return ", ".join(f"{v:.3f}" for v in values)


def format_table(r: dict[str, Any]) -> str:
    """Rows for the E2E reference(s) and each objective measured."""
    e = r["e2e"]
    only_matched = bool(r.get("e2e_is_matched_flops"))  # the one E2E run is at matched FLOPs: one column, not two
    m = None if only_matched else r.get("e2e_matched_flops")
    objs: dict[str, Any] = r["objectives"]
    n_blocks = r["config"]["model"]["n_blocks"]
    cols = ["E2E, matched FLOPs" if only_matched else "E2E, matched steps"] + (["E2E, matched FLOPs"] if m else [])
    cols += [f"{name} (B={n_blocks})" for name in objs]
    rows: list[list[str]] = [["", *cols]]

    def row(label: str, e2e: str, matched: str, per_obj: list[str]) -> None:
        rows.append([label, e2e, *([matched] if m else []), *per_obj])

    row("test CE (nats/byte)", f"{e['ce_nats_per_byte']:.4f}", f"{m['ce_nats_per_byte']:.4f}" if m else "",
        [f"{o['ce_nats_per_byte']:.4f}" for o in objs.values()])
    row("gap to E2E, matched FLOPs" if only_matched else "gap to E2E, matched steps", "",
        f"{m['ce_nats_per_byte'] - e['ce_nats_per_byte']:+.4f}" if m else "", [f"{o['gap_nats_per_byte']:+.4f}" for o in objs.values()])
    if m:
        row("gap to E2E, matched FLOPs", "", "", [f"{o['gap_matched_flops_nats_per_byte']:+.4f}" for o in objs.values()])
    row("single-block references", "", "", [
        ("prefixes " + _fmt_list(o["prefix_ce"])) if "prefix_ce" in o else ("blocks alone " + _fmt_list(o["blocks_alone_ce"]))
        for o in objs.values()
    ])
    row("compositional gain (first prefix or best block alone - composed)", "", "",
        [f"{o['compositional_gain_nats_per_byte']:+.4f}" for o in objs.values()])
    row("training steps", f"{e['train_steps']}", f"{m['steps']}" if m else "",
        ["/".join(str(n) for n in o["train_steps_per_block"]) + " per block" for o in objs.values()])
    row("training FLOPs (model FLOPs)", _flops(e["train_flops"]), _flops(m["train_flops"]) if m else "",
        [f"{_flops(o['train_flops'])} ({o['train_flops_over_e2e']:.2f}x E2E)" for o in objs.values()])
    row(f"seconds per step ({r['precision']})", f"{e['seconds_per_step']:.3f}", f"{m['seconds_per_step']:.3f}" if m else "",
        [f"{o['block_worker']['seconds_per_step']:.3f} (mean of blocks)" for o in objs.values()])
    row("MFU (of the measured peak)", f"{e['mfu']:.1%}", "", [f"{o['block_worker']['mfu']:.1%}" for o in objs.values()])
    if r.get("arms_isolated", True):  # arms trained in one process share its peak RSS: no per-arm memory to show
        row("train memory (MiB, peak RSS - base)", f"{e['train_mem_bytes'] / MIB:.1f}", "",
            [f"{o['block_worker']['train_mem_bytes'] / MIB:.1f} per block worker" for o in objs.values()])
        row("memory ratio (block worker / E2E)", "", "", [f"{o['memory_ratio_block_over_e2e']:.3f}" for o in objs.values()])
    row("train wall (s)", f"{e['train_wall_s']:.0f}", "", [f"{o['train_wall_s_sequential']:.0f} (sum over blocks)" for o in objs.values()])
    row("bytes scored", f"{e['bytes_scored']:,}", "", [f"{o['bytes_scored']:,}" for o in objs.values()])
    width = [max(len(rw[i]) for rw in rows) for i in range(len(rows[0]))]
    lines = ["| " + " | ".join(c.ljust(width[i]) for i, c in enumerate(rw)) + " |" for rw in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in width) + "|")
    peak = r["peak_flops"]
    sweep = r["lr_sweep"]
    lr_note = (
        f"No learning-rate sweep: every arm trains at lr {r['config']['train']['lr']:g}."
        if "e2e_lr" not in sweep else
        f"Learning-rate sweep on validation (x{', x'.join(f'{f:g}' for f in sweep['factors'])} of the preset's lr): "
        f"E2E {sweep['e2e_val_ce']} -> lr {sweep['e2e_lr']:g}"
        + (f"; stack block 0 {sweep['stack_block0_val_prefix_ce']} -> lr {sweep['stack_lr']:g}" if "stack_lr" in sweep else "")
        + "."
    )
    notes = [
        "",
        f"Measured matmul peak: fp32 {peak['fp32'] / 1e9:.0f} GFLOP/s, bf16 {peak['bf16'] / 1e9:.0f} GFLOP/s; MFU is against the "
        f"{r['precision']} peak.",
        lr_note,
    ]
    if r.get("test_bytes_limit"):
        limit, scored = int(r["test_bytes_limit"]), int(r.get("bytes_scored") or e["bytes_scored"])
        notes.append(f"Scored on the first {limit:,} bytes of the test split (the preset's test_bytes)." if scored >= limit
                     else f"Scored on the whole test split, {scored:,} bytes (shorter than the preset's test_bytes, "
                          f"{limit:,}).")
    if r.get("resumed"):
        notes.append("Resumed (--resume): each arm went on from its last checkpoint, so the wall times, seconds per step "
                     "and MFU count this run's steps only (an arm finished before keeps those of the run that finished "
                     "it); the CEs are those of a run without a cut.")
    if not r.get("arms_isolated", True):
        notes.append("Every arm trained in this one process (--isolate no): no per-arm memory rows.")
    mfus = [e["mfu"], *(o["block_worker"]["mfu"] for o in objs.values())]
    if any(u > 1.0 for u in mfus):  # the peak was measured while something else had the cores
        notes.append("MFU above 100%: the machine was shared while this ran, so its peak, seconds-per-step, MFU and wall "
                     "rows are not valid; the CE rows do not depend on load.")
    return "\n".join(lines + notes)


def derive_figures(result: dict[str, Any]) -> dict[str, Any]:
    """Set a result's derived figures (compositional gains, gaps to the E2E rows) from its measured CEs."""
    e2e_ce = result["e2e"]["ce_nats_per_byte"]
    matched = result.get("e2e_matched_flops")
    for sec in result["objectives"].values():
        refs = sec.get("prefix_ce") or sec["blocks_alone_ce"]
        reference = sec.get("gain_reference") or ("first" if "prefix_ce" in sec else "best")  # results before it was recorded
        sec["compositional_gain_nats_per_byte"] = compositional_gain(sec["ce_nats_per_byte"], refs, reference)
        sec["gap_nats_per_byte"] = sec["ce_nats_per_byte"] - e2e_ce
        if matched is not None:
            sec["gap_matched_flops_nats_per_byte"] = sec["ce_nats_per_byte"] - matched["ce_nats_per_byte"]
    primary = result["objectives"][result["primary_objective"]]
    result["blocktrain"] = primary
    result["gap_nats_per_byte"] = primary["gap_nats_per_byte"]
    return result


def rederive(result: dict[str, Any]) -> dict[str, Any]:
    """Recompute an earlier result's derived figures from its measured CEs; trains and scores nothing.

    For result files written before a derived figure's definition changed (the stack's gain is now
    against its first prefix); the measured CEs are untouched.
    """
    result["rederived"] = "derived figures recomputed from the measured CEs by `blocktrain bench quality --rederive`"
    return derive_figures(result)


def write_result(result: dict[str, Any], path: Path, name: str) -> None:
    """The result JSON at ``path`` and its markdown table beside it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    redo = f"Derived figures recomputed with `blocktrain bench quality --rederive {path}`.\n\n" if "rederived" in result else ""
    path.with_suffix(".md").write_text(
        f"# Quality benchmark: {name}\n\n```\n{result['command']}\n```\n\n{redo}{format_table(result)}\n")
    log.info("wrote %s and %s", path, path.with_suffix(".md"))
