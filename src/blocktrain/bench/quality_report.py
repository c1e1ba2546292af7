"""The result of ``bench quality``: its derived figures (gains, gaps) and its markdown table, one column per model,
rows of CE, composition, cost and speed; the JSON and the table written together."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from blocktrain.errors import RunError
from blocktrain.evaluate.report import compositional_gain, reference_key, reference_label

log = logging.getLogger(__name__)

MIB = 2**20
FLOPS_MATCH_TOLERANCE = 0.05  # an E2E within 5% of an objective's training FLOPs is at matched FLOPs for it


def _flops(x: float) -> str:
    """FLOPs in the unit that shows them: PFLOPs from 0.1 up, else TFLOPs."""
    return f"{x / 1e15:.2f} PFLOPs" if x >= 1e14 else f"{x / 1e12:.2f} TFLOPs"


def _fmt_list(values: list[float]) -> str:
    return ", ".join(f"{v:.3f}" for v in values)


def _references(sec: dict[str, Any]) -> tuple[str, list[float]]:
    """A result section's single-block references: their key (the objective's reference name) and CEs."""
    key = reference_key(sec)
    if key is None or key not in sec:
        raise RunError("a bench quality result section names no single-block references (no reference_name, or no "
                       "list under it): pass a result file written by 'blocktrain bench quality'")
    return key, list(sec[key])


def matched_flops_ratio(result: dict[str, Any], sec: dict[str, Any]) -> float | None:
    """Training FLOPs of the E2E at matched FLOPs over those of objective section ``sec`` (None: no such E2E).

    The E2E is matched to one objective's FLOPs (``e2e_matched_flops.matched_to``, the primary); with two objectives
    the other's ratio is not 1, and its matched-FLOPs gap is against an E2E that trained that many times its FLOPs."""
    matched = result.get("e2e_matched_flops")
    return None if matched is None else float(matched["train_flops"]) / float(sec["train_flops"])


def _unmatched_ratio(r: dict[str, Any], o: dict[str, Any]) -> float | None:
    """The matched-FLOPs E2E's training FLOPs over objective ``o``'s where they differ by more than the tolerance
    (that E2E is not at this objective's FLOPs), else None."""
    ratio = o.get("matched_e2e_flops_ratio", matched_flops_ratio(r, o))  # a result from before the ratio: from its FLOPs
    return ratio if ratio is not None and abs(ratio - 1.0) > FLOPS_MATCH_TOLERANCE else None


def _gap_at_matched_flops(r: dict[str, Any], o: dict[str, Any], gap: float) -> str:
    """A gap to the matched-FLOPs E2E, saying so where that E2E did not train at this objective's FLOPs."""
    ratio = _unmatched_ratio(r, o)
    return f"{gap:+.4f}" + ("" if ratio is None else f" (E2E at {ratio:.2f}x its FLOPs)")


def _lr_note(r: dict[str, Any]) -> str:
    """The learning-rate sweep's line: E2E's, then the block-0 sweep of every objective that trains in order."""
    sweep = r["lr_sweep"]
    if "e2e_lr" not in sweep:
        return f"No learning-rate sweep: every arm trains at lr {r['config']['train']['lr']:g}."
    blocks = ""
    for name, sec in r["objectives"].items():
        if f"{name}_lr" in sweep:  # its block 0 was swept on validation of its references (their key: its reference name)
            scores = sweep.get(f"{name}_block0_val_{reference_key(sec)}")
            blocks += f"; {name} block 0 {scores} -> lr {sweep[f'{name}_lr']:g}"
    return (f"Learning-rate sweep on validation (x{', x'.join(f'{f:g}' for f in sweep['factors'])} of the preset's lr): "
            f"E2E {sweep['e2e_val_ce']} -> lr {sweep['e2e_lr']:g}{blocks}.")


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
        f"{m['ce_nats_per_byte'] - e['ce_nats_per_byte']:+.4f}" if m else "",
        [_gap_at_matched_flops(r, o, o["gap_nats_per_byte"]) if only_matched else f"{o['gap_nats_per_byte']:+.4f}"
         for o in objs.values()])
    if m:
        row("gap to E2E, matched FLOPs", "", "",
            [_gap_at_matched_flops(r, o, o["gap_matched_flops_nats_per_byte"]) for o in objs.values()])
    refs = [_references(o) for o in objs.values()]
    row("single-block references", "", "", [f"{reference_label(o, key)} {_fmt_list(ces)}"
                                            for o, (key, ces) in zip(objs.values(), refs, strict=True)])
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
    notes = [
        "",
        f"Measured matmul peak: fp32 {peak['fp32'] / 1e9:.0f} GFLOP/s, bf16 {peak['bf16'] / 1e9:.0f} GFLOP/s; MFU is against the "
        f"{r['precision']} peak.",
        _lr_note(r),
    ]
    if any(_unmatched_ratio(r, o) is not None for o in objs.values()):
        # results written before it was recorded: the E2E was always matched to the primary objective
        to = (r.get("e2e_matched_flops") or {}).get("matched_to") or r.get("primary_objective")
        notes.append(f"The E2E at matched FLOPs trained for {f'the {to} arm' if to else 'one arm'}'s training FLOPs; a gap "
                     "marked 'E2E at Nx its FLOPs' is against an E2E that trained N times that objective's FLOPs.")
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
        key, refs = _references(sec)
        # results from before the gain reference was recorded hold a built-in's references: a stack's gain is over its
        # first prefix
        reference = sec.get("gain_reference") or ("first" if key == "prefix_ce" else "best")
        sec["compositional_gain_nats_per_byte"] = compositional_gain(sec["ce_nats_per_byte"], refs, reference)
        sec["gap_nats_per_byte"] = sec["ce_nats_per_byte"] - e2e_ce
        if matched is not None:
            sec["gap_matched_flops_nats_per_byte"] = sec["ce_nats_per_byte"] - matched["ce_nats_per_byte"]
            sec["matched_e2e_flops_ratio"] = matched_flops_ratio(result, sec)
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
