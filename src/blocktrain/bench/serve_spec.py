"""The ``spec`` row of ``blocktrain bench serve``: speculative decoding on a stack run's pipeline.

The stack run (``--stack-run``) is served by as many stages as the main
comparison, on the same network; the entry stage drafts with its prefix model
(blocks 0..hi of its span) and every traversal verifies a whole draft. Measured
as the other rows: time to the full output, bytes written by the stages, and the
generative CE of outputs for the same prompts, temperature and top-k under the
main run's E2E model; plus the mean bytes per traversal.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from blocktrain.bench.serve_options import ServeBenchOptions
from blocktrain.bench.serve_pipeline import Pipeline, split_blocks
from blocktrain.bench.serve_quality import bench_prompts, output_quality
from blocktrain.checkpoint.run import RunDir
from blocktrain.device import resolve_device
from blocktrain.errors import BlockTrainError
from blocktrain.evaluate.assembled import E2EModel
from blocktrain.objectives import get_objective


def spec_task(draft_min: int, draft_max: int) -> dict[str, Any]:
    """The bench client's task for the spec row (timed once, plus one output per prompt for the quality)."""
    return {"name": "spec", "mode": "spec", "repeat": 1, "draft_min": draft_min, "draft_max": draft_max}


def long_task(name: str, opts: ServeBenchOptions, **task: Any) -> list[dict[str, Any]]:
    """The long row of a task (``name``_long: ``opts.long_output_bytes`` per output, several windows), if asked for."""
    if opts.long_output_bytes == 0:
        return []
    mode = task.pop("mode", name)
    return [{"name": f"{name}_long", "mode": mode, "repeat": 1, "output_bytes": opts.long_output_bytes, **task}]


def long_summary(name: str, task: dict[str, Any], quality: dict[str, Any]) -> dict[str, Any]:
    """A long row's keys of the result JSON: ``name``_long_seconds, _generative_ce (with its per-prompt values and the
    standard error of their mean), _wire_bytes (and spec's bytes per traversal)."""
    ces = quality["generative_ce_per_prompt"]
    out = {f"{name}_long_seconds": task["seconds"], f"{name}_long_generative_ce": quality["generative_ce"],
           f"{name}_long_generative_ce_per_prompt": ces,
           f"{name}_long_generative_ce_sem": statistics.stdev(ces) / len(ces) ** 0.5 if len(ces) > 1 else None,
           f"{name}_long_wire_bytes": task["stage_bytes_out"]}
    if "traversals" in task:
        out[f"{name}_long_bytes_per_traversal"] = len(task["timing_output"]) / float(task["traversals"])
    return out


def spec_summary(task: dict[str, Any], generative_ce: float, baseline_seconds: float, output_bytes: int) -> dict[str, Any]:
    """The spec row's keys of the result JSON, from the bench client's task result."""
    traversals = float(task["traversals"])
    return {
        "spec_seconds": task["seconds"],
        "spec_bytes_per_traversal": output_bytes / traversals,
        "spec_wire_bytes": task["stage_bytes_out"],
        "spec_generative_ce": generative_ce,
        "speedup_spec_vs_baseline": baseline_seconds / task["seconds"],
    }


def check_stack_run(run: RunDir) -> None:
    cfg = run.load_config()
    if not get_objective(cfg).prefix_drafts:
        raise BlockTrainError(f"--stack-run {run.root} is a {cfg.objective} run, whose first block is no prefix of the "
                              "composed model; spec needs a run whose first stage drafts for it "
                              "(train one with 'blocktrain train --objective stack')")
    if not run.has_blocks(cfg.model.n_blocks):
        raise BlockTrainError(f"--stack-run {run.root} needs all {cfg.model.n_blocks} blocks; train them first")


def run_spec_row(
    opts: ServeBenchOptions, pipe: Pipeline, stack_run: RunDir, base: dict[str, Any], prompts: list[bytes], e2e: E2EModel,
    baseline_seconds: float,
) -> dict[str, Any]:
    """Serve ``stack_run`` over ``pipe``, time spec, score its outputs."""
    check_stack_run(stack_run)
    cfg = stack_run.load_config()
    pipe.start("blocktrain", split_blocks(cfg.model.n_blocks), ["--run", str(stack_run.root)], threads=1)
    ar_task = {"name": "stack_ar", "mode": "ar", "repeat": 1}  # the same model, one traversal per byte
    spec = spec_task(opts.draft_min, opts.draft_max)
    tasks = [spec, ar_task, *long_task("spec", opts, **{k: spec[k] for k in ("mode", "draft_min", "draft_max")}),
             *long_task("stack_ar", opts, mode="ar")]
    try:
        out = pipe.client({**base, "tasks": tasks}, timeout_s=3600)
    finally:
        pipe.stop()
    task = out["tasks"]["spec"]
    quality = output_quality(e2e, prompts, out["tasks"]["spec"])
    ar_quality = output_quality(e2e, prompts, out["tasks"]["stack_ar"])
    long: dict[str, Any] = {}
    for name in ("spec", "stack_ar"):
        if f"{name}_long" in out["tasks"]:
            task_long = out["tasks"][f"{name}_long"]
            long.update(long_summary(name, task_long, output_quality(e2e, prompts, task_long)))
    return {**long, "task": task, "quality": quality, "stack_run": str(stack_run.root),
            "stack_ar": {"task": out["tasks"]["stack_ar"], "quality": ar_quality},
            "stack_ar_seconds": out["tasks"]["stack_ar"]["seconds"],
            "stack_ar_generative_ce": ar_quality["generative_ce"],
            "spec_minus_stack_ar_generative_ce": quality["generative_ce"] - ar_quality["generative_ce"],
            **spec_summary(task, quality["generative_ce"], baseline_seconds, int(base["output_bytes"]))}


def run_spec(opts: ServeBenchOptions, pipe: Pipeline, run: RunDir, stack_run: Path, baseline_seconds: float) -> dict[str, Any]:
    """The spec row on the same prompts, temperature and top-k as the other rows; CE under ``run``'s E2E model."""
    _, pairs, base = bench_prompts(opts)
    e2e = E2EModel.load(run, run.load_config(), device=resolve_device(opts.device))
    return run_spec_row(opts, pipe, RunDir(stack_run), base, [p for p, _ in pairs], e2e, baseline_seconds)


def spec_markdown(r: dict[str, Any]) -> list[str]:
    """The spec row of the markdown table, when the result has one."""
    if "spec_seconds" not in r:
        return []
    n = r["output_bytes"]
    rows = [f"| stack spec (speculative, {r['spec_bytes_per_traversal']:.2f} bytes/traversal) | {r['spec_seconds']:.3f} "
            f"| {n / r['spec_seconds']:.1f} | {r['spec_wire_bytes']:,} | {r['spec_generative_ce']:.3f} |"]
    if "stack_ar_seconds" in r:  # ar on the same stack model: the CE spec must match
        ar = r["spec"]["stack_ar"]["task"]
        rows.append(f"| stack ar (same model as spec) | {r['stack_ar_seconds']:.3f} | {n / r['stack_ar_seconds']:.1f} "
                    f"| {ar['stage_bytes_out']:,} | {r['stack_ar_generative_ce']:.3f} |")
    return rows
