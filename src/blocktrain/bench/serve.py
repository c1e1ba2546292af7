"""``blocktrain bench serve``: BlockTrain sweep and ar against the AR baseline over three stages.

Setup: three stage processes on loopback, 25 ms one way per hop injected by the
stages on their forward link. The client runs beside stage 0, so one traversal
crosses three hops. Another :class:`~blocktrain.bench.serve_pipeline.Placement`
can be passed in: ``benchmarks/serving/serve_netns.py`` runs the stages in three network
namespaces joined by veth in a ring (netem delay where the kernel has it).

Measured per mode: time to a full output, bytes/s, bytes written by the stages
(frames, acks and results; application bytes, not TCP/IP headers). Quality:
generative CE of the outputs under the E2E model and teacher-forced CE. The scale row (random
weights of the largest shape that fits) is ``benchmarks/serving/serve_scale.py``.

The times are only meaningful when the benchmark runs alone on the machine
(nothing else on its cores); it takes no lock itself, so make sure of that.
"""

from __future__ import annotations

import json
import logging
import shlex
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from blocktrain.bench.machine import machine_info
from blocktrain.bench.serve_options import ServeBenchOptions
from blocktrain.bench.serve_pipeline import Pipeline, Placement, split_blocks, split_layers
from blocktrain.bench.serve_quality import (
    bench_data,
    bench_prompts,
    generative_ce,
    output_quality,
    traversal_compute_s,
)
from blocktrain.bench.serve_report import render_markdown, summarise
from blocktrain.bench.serve_spec import check_stack_run, long_task, run_spec, spec_task
from blocktrain.checkpoint.run import RunDir
from blocktrain.config import RunConfig
from blocktrain.device import resolve_device
from blocktrain.errors import BlockTrainError, ConfigError
from blocktrain.evaluate.assembled import AssembledModel, E2EModel
from blocktrain.evaluate.scoring import score_split
from blocktrain.objectives import get_objective, objective_names
from blocktrain.presets import tiny

log = logging.getLogger(__name__)


def _mode_tasks(sweeps: list[int], draft_min: int, draft_max: int) -> list[dict[str, Any]]:
    tasks = [{"name": f"sweep_k{k}", "mode": "sweep", "sweeps": k, "repeat": 5} for k in sweeps]
    spec = {**spec_task(draft_min, draft_max), "name": "diffusion_spec"}  # block 0 alone drafts, the chain verifies
    return [*tasks, {"name": "ar", "mode": "ar", "repeat": 1}, spec]


def run_main_comparison(opts: ServeBenchOptions, pipe: Pipeline, run: RunDir) -> dict[str, Any]:
    cfg = run.load_config()
    data, pairs, base = bench_prompts(opts)
    sweeps = list(opts.sweeps)
    test_path = str(bench_data(opts).open("test").path)
    pipe.start("blocktrain", split_blocks(cfg.model.n_blocks), ["--run", str(run.root)], threads=1)
    try:
        bt = pipe.client({**base, "tasks": _mode_tasks(sweeps, opts.draft_min, opts.draft_max), "teacher_forced_path": test_path,
                          "teacher_forced_bytes": opts.tf_bytes}, timeout_s=3600)
    finally:
        pipe.stop()
    pipe.start("e2e", split_layers(cfg.model.n_layers), ["--run", str(run.root)], threads=1)
    baseline = [{"name": "baseline", "mode": "baseline", "repeat": 1}, *long_task("baseline", opts)]
    try:
        bl = pipe.client({**base, "tasks": baseline}, timeout_s=3600)
    finally:
        pipe.stop()

    device = resolve_device(opts.device)
    e2e = E2EModel.load(run, cfg, device=device)
    assembled = AssembledModel.load(run, cfg, device=device)
    tasks = {**bt["tasks"], **bl["tasks"]}
    quality = {name: output_quality(e2e, [p for p, _ in pairs], res) for name, res in tasks.items()}
    reference = statistics.mean(generative_ce(e2e, p, c) for p, c in pairs)
    torch.set_num_threads(1)
    tf_local = score_split(lambda x: assembled.log_probs(x, seed=0), data, cfg.model.context,
                           max_bytes=opts.tf_bytes, batch_size=8, device=device).ce_nats_per_byte
    tf_e2e = score_split(e2e.log_probs, data, cfg.model.context, max_bytes=opts.tf_bytes, batch_size=8,
                         device=device).ce_nats_per_byte
    # a traversal carries at most one context window of prompt + output (a longer text is served in windows)
    compute_s = traversal_compute_s(cfg, assembled, min(cfg.model.context, opts.prompt_bytes + opts.output_bytes))
    return {"tasks": tasks, "quality": quality, "reference_continuation_ce": reference,
            "teacher_forced": {"blocktrain_pipeline_score": bt.get("teacher_forced_ce_pipeline"),
                               "blocktrain_local": tf_local, "e2e_local": tf_e2e, "bytes": opts.tf_bytes,
                               "pipeline_seconds": bt.get("teacher_forced_seconds")},
            "traversal_compute_s": compute_s, "model": {"run": str(run.root), **cfg.to_dict()["model"]}}


def run_serve_bench(opts: ServeBenchOptions, placement: Placement | None = None, command: str | None = None) -> dict[str, Any]:
    """The whole benchmark, its stages placed by ``placement`` (default: loopback); ``command`` is recorded."""
    resolve_device(opts.device)  # a device this machine lacks fails before any stage starts
    run = RunDir(opts.run)
    check_serve_run(opts, run)  # and a run this bench cannot serve
    if opts.stack_run is not None:
        check_stack_run(RunDir(opts.stack_run))
    placement = placement or Placement()
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="bt-serve-bench-") as tmp:
        pipe = Pipeline(placement, opts.hop_delay_ms, opts.base_port, Path(tmp), opts.device)
        try:
            main = run_main_comparison(opts, pipe, run)
            result = summarise(opts, main, placement.describe())
            if opts.stack_run is not None:
                result["spec"] = run_spec(opts, pipe, run, opts.stack_run, result["ar_baseline_seconds"])  # bench.serve_spec
                result.update({k: v for k, v in result["spec"].items() if k.startswith(("spec_", "speedup_spec", "stack_ar_"))})
        finally:
            pipe.stop()
    return _finish(opts, result, t0, echo=True, command=command)


def _sweep_objective(cfg: RunConfig | None) -> str:
    """The objective to train a run for this bench: the run's own where it serves the sweep mode, else those that do
    (``serves_sweep``), as ``a|b``."""
    if cfg is not None and get_objective(cfg).serves_sweep:
        return str(cfg.objective)
    base = cfg or tiny()  # a stand-in config, only to ask each objective whether it serves sweep
    return "|".join(name for name in objective_names() if get_objective(replace(base, objective=name)).serves_sweep)


def _how_to_make_run(root: Path, cfg: RunConfig | None, data: str | None = None) -> str:
    """The commands that make the run directory ``bench serve --run`` reads: one objective's blocks and the E2E
    reference trained into the same --out. (``bench quality`` trains every arm into a directory of its own, so none
    of its directories holds both.) ``root`` is the --out where its run may go on (no run, or a sweep-serving one)."""
    mine = cfg is None or get_objective(cfg).serves_sweep  # else another objective's run: a new directory
    preset = cfg.name if cfg is not None else "PRESET"
    flags = f"--preset {preset} --objective {_sweep_objective(cfg)} --data {data or 'DATA'} --out {root if mine else 'RUN'}"
    return ("'blocktrain bench serve --run' reads one run directory holding the blocks of a run whose objective serves "
            "the sweep mode and, beside them, the E2E reference ('blocktrain bench quality' writes each arm to a "
            f"directory of its own, so none of its directories is one); make it with 'blocktrain train {flags}', then "
            "'blocktrain train-e2e' with the same flags")


def check_serve_run(opts: ServeBenchOptions, run: RunDir) -> RunConfig:
    """The run's config, once the run is one this bench can serve with these options; else a BlockTrainError that
    says how to make one. Called before any stage starts."""
    if not run.config_path.is_file():
        raise BlockTrainError(f"{run.root} is not a run directory (no run.json). {_how_to_make_run(run.root, None)}")
    cfg = run.load_config()
    context = cfg.model.context
    if opts.output_bytes >= context:  # sweep writes the whole output in one window, after at least one prompt byte
        raise ConfigError(f"output_bytes ({opts.output_bytes}) must be below the run's context ({context}): sweep "
                          f"writes the output in one window; set --output-bytes {context - 1} or less")
    data = (run.recorded_data() or {}).get("dir")
    objective = get_objective(cfg)
    if not objective.serves_sweep:  # the bench times sweep first: a stage of this run would refuse it mid-bench
        spec = f"; to time its spec mode, pass it as --stack-run {run.root} beside such a --run" if objective.prefix_drafts else ""
        raise ConfigError(f"{run.root} is a {cfg.objective} run, whose stages do not serve the sweep mode that "
                          f"'bench serve' times{spec}. {_how_to_make_run(run.root, cfg, data)}")
    blocker = objective.serving_blocker()
    if blocker is not None:
        raise ConfigError(f"{run.root} cannot be served by a pipeline of stages: {blocker}")
    if not run.has_blocks(cfg.model.n_blocks) or not run.has_e2e():
        raise BlockTrainError(f"{run.root} needs all {cfg.model.n_blocks} blocks and the E2E reference. "
                              f"{_how_to_make_run(run.root, cfg, data)}")
    return cfg


def _finish(opts: ServeBenchOptions, result: dict[str, Any], t0: float, echo: bool = False,
            command: str | None = None) -> dict[str, Any]:
    result["wall_seconds"] = time.time() - t0
    result["machine"] = machine_info(resolve_device(opts.device))
    result["commands"] = {
        "bench": command or shlex.join(["blocktrain", *sys.argv[1:]]),
        "stage": "blocktrain serve --run RUN --blocks 0-1 --listen 0.0.0.0:47100 --next HOST1:47101 [--delay-ms 25]",
        "client": "blocktrain generate --pipeline 127.0.0.1:47100 --mode sweep --bytes 128",
    }
    text = json.dumps(result, indent=2)
    if opts.json is not None:
        opts.json.parent.mkdir(parents=True, exist_ok=True)
        opts.json.write_text(text + "\n")
        opts.json.with_suffix(".md").write_text(render_markdown(result))
    if echo:
        sys.stdout.write(text + "\n")
    return result
