"""``blocktrain bench quality``: the E2E reference against block objectives, scored on the same test bytes.

Arms, each trained in a fresh child process so its peak RSS is its own (memory
is peak RSS minus the RSS just before the model is built), or all in this process
with ``isolate=False`` (torch starts once; the memory rows are then not per arm):

* **E2E at matched steps** -- as many steps as each block gets. With the
  learning-rate sweep, E2E runs at the preset's lr x0.5, x1 and x2 and the
  best on validation is kept; the stack's block 0 gets the same sweep.
* **E2E at matched FLOPs** -- steps scaled so that its training FLOPs equal
  the primary objective's, frozen forward passes included (at the swept lr).
  One run: with ``both``, the other objective's FLOPs differ, and the result
  records the ratio (``matched_e2e_flops_ratio``) and the table says so.
* **diffusion** and/or **stack** -- B blocks; a stack's blocks train in order
  (progressive schedule), block k on frozen copies of blocks 0..k-1.

The result JSON keeps the historic top-level keys for the primary objective
(the one named, or ``stack`` with ``both``) and adds one section per objective.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import shutil
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from blocktrain.bench.machine import machine_info, measure_peak_flops
from blocktrain.bench.quality_report import derive_figures, format_table, write_result
from blocktrain.checkpoint.run import RunDir
from blocktrain.config import Objective, RunConfig
from blocktrain.data.dataset import DataDir
from blocktrain.device import resolve_device, resolve_precision
from blocktrain.errors import ConfigError, RunError
from blocktrain.evaluate.assembled import AssembledModel, E2EModel
from blocktrain.evaluate.report import evaluate_model
from blocktrain.model.e2e import E2ETransformer
from blocktrain.model.flops import train_flops_per_token
from blocktrain.model.layers import recompute_layers
from blocktrain.objectives import get_objective
from blocktrain.progress import MetricsProgress, progress_bar
from blocktrain.train.child import E2E, arm_name, run_summary, train_arm

log = logging.getLogger(__name__)

LR_FACTORS = (0.5, 1.0, 2.0)  # the learning-rate sweep, as multiples of the preset's lr
BENCH_OPTIONS = "bench-options.json"  # in the bench directory: what its arms train, checked by --resume
PRIMARY = "stack"  # with --objective both: the objective the top-level keys report (the default of the presets)


@dataclass(frozen=True)
class QualityOptions:
    cfg: RunConfig  # the preset with the command line's overrides
    data: DataDir  # resolved data directory
    out: Path  # bench directory: one run directory per arm below it
    objective: str = "both"  # "diffusion", "stack" or "both"
    json_path: Path | None = None  # write the result JSON (and a .md table beside it) here
    chains: int = 2  # K of the diffusion chain-mixture row
    max_eval_bytes: int | None = None  # score only the first N test bytes (None: the preset's test_bytes, 0 = whole split)
    fresh: bool = False  # delete ``out`` first
    resume: bool = False  # continue an existing ``out``: each arm from its last checkpoint (its times: this run's only)
    progress: bool = True  # progress bars
    lr_sweep: bool = True  # sweep E2E's and stack block 0's lr over LR_FACTORS on validation
    matched_flops: bool = True  # also train the E2E at the stack's training FLOPs
    matched_steps: bool = True  # train the E2E at matched steps; off, the E2E runs once, at matched FLOPs
    command: str = ""  # the command line, recorded in the JSON
    isolate: bool = True  # a child process per arm (its peak memory its own); False: every arm in this process

    def __post_init__(self) -> None:
        if self.objective not in ("diffusion", "stack", "both"):
            raise ConfigError(f"objective must be diffusion, stack or both, got {self.objective!r}")
        if self.chains < 1:
            raise ConfigError(f"chains must be >= 1, got {self.chains}")
        if not self.matched_steps and not self.matched_flops:
            raise ConfigError("--no-matched-steps and --no-matched-flops leave no E2E reference; drop one of them")
        if self.fresh and self.resume:
            raise ConfigError("fresh deletes the bench directory and resume continues it: pass one of them")
        if self.max_eval_bytes is not None and self.max_eval_bytes < 0:
            raise ConfigError(f"max_eval_bytes must be >= 0, got {self.max_eval_bytes}")
        if not self.matched_steps and self.lr_sweep:
            raise ConfigError("the lr sweep trains the E2E at matched steps; pass --no-lr-sweep with --no-matched-steps")
        if self.lr_sweep and self.cfg.train.eval_bytes == 0:  # every score NaN: the sweep "picked" its first lr, x0.5
            raise ConfigError("the lr sweep picks the lr by validation CE, and --eval-bytes 0 scores none; give "
                              "--eval-bytes > 0 or pass --no-lr-sweep")

    @property
    def objectives(self) -> list[Objective]:
        both = sorted(Objective, key=lambda o: o.value != PRIMARY)  # the primary objective first
        return both if self.objective == "both" else [Objective(self.objective)]

    @property
    def test_bytes(self) -> int | None:
        """Test bytes to score: the first N, or None for the whole split."""
        n = self.cfg.train.test_bytes if self.max_eval_bytes is None else self.max_eval_bytes
        return n or None

    @functools.cached_property
    def e2e_flops_step(self) -> float:
        """Training FLOPs of one E2E step: the E2E trainer's own formula (train/e2e.py), on a model that allocates nothing,
        with its recomputed forward under --recompute (as the trainer and the stack's blocks count it)."""
        m = self.cfg.model
        with torch.device("meta"):
            model = E2ETransformer(m)
            recompute_layers(model, self.cfg.train.recompute)
            per_token = train_flops_per_token(model, m.d_model, m.context)
        return per_token * self.cfg.train.batch_size * m.context


def _analytic(module: Any) -> dict[str, int]:
    params = sum(p.numel() for p in module.parameters() if p.requires_grad)
    return {"params": params, "param_bytes": 4 * params, "grad_bytes": 4 * params,
            "optimizer_bytes": 8 * params, "total_state_bytes": 16 * params}  # AdamW: two fp32 moments


def _largest_block_analytic(cfg: RunConfig, objective: Objective) -> dict[str, int]:
    """Training state of the objective's block with the most trainable parameters: what the biggest block worker
    holds (a stack's block 0 embeds the bytes, and every block but the last may carry aux head layers). Built on the
    meta device: counting parameters allocates nothing."""
    obj = get_objective(replace(cfg, objective=objective))
    with torch.device("meta"):
        blocks = [_analytic(obj.build_block(k)) for k in range(cfg.model.n_blocks)]
    return max(blocks, key=lambda a: a["params"])


class _Bench:
    """Trains the arms (:func:`blocktrain.train.child.train_arm`: a fresh process each, or this one), with a progress
    bar over the planned training FLOPs (so its remaining-time estimate weighs an E2E step and a block step right)."""

    def __init__(self, opts: QualityOptions, planned_flops: float) -> None:
        self.o = opts
        self.cfg = opts.cfg
        self.arms = 0
        self.t0 = time.perf_counter()
        self.bar = progress_bar(total=planned_flops / 1e9, unit="GFLOP", unit_scale=True, desc="bench quality: training",
                                disable=not opts.progress)

    def arm(self, cfg: RunConfig, out: Path, k: int, flops: float) -> dict[str, Any]:
        """Train arm ``k`` (a block, or the E2E reference) of ``cfg`` into ``out``; its summary record."""
        t0 = time.perf_counter()
        log.info("training %s%s into %s (lr %g, %d steps)", "the E2E reference" if k == E2E else f"block {k}",
                 "" if k == E2E else f" ({cfg.objective})", out, cfg.train.lr, cfg.train.steps)
        steps = cfg.train.steps if k == E2E else get_objective(cfg).block_steps(k)
        follow = MetricsProgress(self.bar, RunDir(out).metrics_path(arm_name(k)), steps, flops)
        try:
            result = train_arm(cfg, self.o.data, out, k, isolate=self.o.isolate, progress=False)
        finally:
            follow.close()
        self.arms += 1
        done, total, elapsed = self.bar.n, self.bar.total or 0.0, time.perf_counter() - self.t0
        eta = (total - done) * elapsed / done if 0 < done <= total else None  # None: nothing to extrapolate from
        left = f"; about {eta:.0f} s of training left" if eta is not None and math.isfinite(eta) else ""
        log.info("arm %d done in %.1f s: %s%s", self.arms, time.perf_counter() - t0, result.name, left)
        return dict(result.summary)

    def e2e(self, out: Path, steps: int, lr: float | None = None) -> dict[str, Any]:
        cfg = self.cfg.with_train(steps=steps, **({} if lr is None else {"lr": lr}))
        return self.arm(cfg, out, E2E, self.o.e2e_flops_step * steps)

    def blocks(self, out: Path, objective: Objective, ks: range, lr: float | None = None) -> list[dict[str, Any]]:
        cfg = replace(self.cfg, objective=objective)
        cfg = cfg if lr is None else cfg.with_train(lr=lr)
        return [self.arm(cfg, out, k, _block_flops(self.cfg, objective, k)) for k in ks]

    def sweep(self, name: str, train: Any, key: str) -> tuple[float, dict[str, float], dict[float, Path]]:
        """Train ``train(out, lr)`` at each lr of the sweep; the lr with the lowest validation CE ``key`` wins."""
        lrs = [self.cfg.train.lr * f for f in LR_FACTORS] if self.o.lr_sweep else [self.cfg.train.lr]
        scores: dict[str, float] = {}
        dirs: dict[float, Path] = {}
        for lr in lrs:
            out = self.o.out / f"{name}-lr{lr:g}"
            summary = train(out, lr)
            scores[f"{lr:g}"] = float(summary["eval"].get(key, float("nan"))) if summary["eval"] else float("nan")
            dirs[lr] = out
        best = min(lrs, key=lambda lr: scores[f"{lr:g}"] if scores[f"{lr:g}"] == scores[f"{lr:g}"] else float("inf"))
        log.info("%s lr sweep on validation: %s -> lr %g", name, scores, best)
        return best, scores, dirs


def _block_flops(cfg: RunConfig, objective: Objective, k: int) -> float:
    """Training FLOPs of block k's arm: its steps (the objective's split) x tokens per step x FLOPs per token."""
    obj = get_objective(replace(cfg, objective=objective))
    return obj.train_flops_per_token(k) * cfg.train.batch_size * cfg.model.context * obj.block_steps(k)


def _planned_flops(opts: QualityOptions) -> float:
    """Training FLOPs of every arm the bench will run (the matched-FLOPs E2E equals the primary objective's blocks)."""
    cfg, n_lr = opts.cfg, len(LR_FACTORS) if opts.lr_sweep else 1
    total = n_lr * opts.e2e_flops_step * cfg.train.steps if opts.matched_steps else 0.0
    for i, objective in enumerate(opts.objectives):
        blocks = [_block_flops(cfg, objective, k) for k in range(cfg.model.n_blocks)]
        in_order = get_objective(replace(cfg, objective=objective)).trains_in_order
        sweep_extra = (n_lr - 1) * blocks[0] if in_order else 0.0
        total += sum(blocks) + sweep_extra + (sum(blocks) if i == 0 and opts.matched_flops else 0.0)
    return total


def run_quality_bench(opts: QualityOptions) -> dict[str, Any]:
    cfg = opts.cfg
    device = resolve_device(cfg.train.device)  # before anything is made or deleted
    test = opts.data.open("test")
    resumed = opts.resume and opts.out.exists()
    if opts.out.exists() and not opts.resume:
        if not opts.fresh:
            raise RunError(f"{opts.out} exists; pass --resume to continue it, --fresh to delete it, or choose another "
                           "--out")
        shutil.rmtree(opts.out)
    identity = {"config": json.loads(cfg.to_json()), "objective": opts.objective, "lr_sweep": opts.lr_sweep,
                "matched_flops": opts.matched_flops, "matched_steps": opts.matched_steps}  # what its arms train
    marker = opts.out / BENCH_OPTIONS
    if resumed:
        if not marker.is_file() or json.loads(marker.read_text()) != identity:
            raise RunError(f"{opts.out} holds a bench of other options (config, seed, steps, lr or arms) than this "
                           "command's, or one made before --resume existed; pass --fresh to start it again, or choose "
                           "another --out")
        log.info("bench quality: resuming %s (each arm from its last checkpoint)", opts.out)
    else:
        opts.out.mkdir(parents=True)
        marker.write_text(json.dumps(identity, indent=1, sort_keys=True))
    precision = resolve_precision(cfg.train.precision, device)
    peak = measure_peak_flops(device)
    t0 = time.perf_counter()
    steps = cfg.train.steps
    tokens = cfg.train.batch_size * cfg.model.context

    e2e_flops_step = opts.e2e_flops_step
    bench = _Bench(opts, _planned_flops(opts))
    log.info("bench quality: %s, objective %s, %s, scoring %s test bytes", cfg.name, opts.objective,
             "a child process per arm" if opts.isolate else "every arm in this process",
             f"the first {opts.test_bytes:,}" if opts.test_bytes else "all")
    sweeps: dict[str, Any] = {"factors": list(LR_FACTORS) if opts.lr_sweep else [1.0]}
    lr_e2e = cfg.train.lr
    if opts.matched_steps:
        lr_e2e, e2e_scores, e2e_dirs = bench.sweep("e2e", lambda out, lr: bench.e2e(out, steps, lr), "val_ce")
        e2e_dir = e2e_dirs[lr_e2e]
        sweeps.update(e2e_val_ce=e2e_scores, e2e_lr=lr_e2e)
    sections: dict[str, dict[str, Any]] = {}
    for objective in opts.objectives:
        obj = get_objective(replace(cfg, objective=objective))
        if obj.trains_in_order:  # blocks 1.. train on block 0, so block 0's lr is swept first
            name, key = objective.value, f"val_{obj.reference_name}"
            lr_s, s_scores, s_dirs = bench.sweep(
                name, lambda out, lr, o=objective: bench.blocks(out, o, range(1), lr)[0], key
            )
            sweeps.update({f"{name}_block0_{key}": s_scores, f"{name}_lr": lr_s})
            run_dir = s_dirs[lr_s]  # block 0 is the sweep's winner; blocks 1.. train on it
            bench.blocks(run_dir, objective, range(1, cfg.model.n_blocks), lr_s)
            sums = [dict(run_summary(RunDir(run_dir), f"block_{k}")) for k in range(cfg.model.n_blocks)]
        else:
            run_dir = opts.out / objective.value
            sums = bench.blocks(run_dir, objective, range(cfg.model.n_blocks))
        sections[objective.value] = {"run_dir": str(run_dir), "summaries": sums}

    primary = opts.objectives[0]
    flops_primary = sum(s["flops_per_step"] * s["steps"] for s in sections[primary.value]["summaries"])
    matched: dict[str, Any] | None = None
    if opts.matched_flops:
        m_steps = max(1, round(flops_primary / e2e_flops_step))
        m_dir = opts.out / "e2e-matched-flops"
        m_sum = bench.e2e(m_dir, m_steps, lr_e2e)
        matched = {"run_dir": str(m_dir), "steps": m_steps, "train_flops": e2e_flops_step * m_steps, "lr": lr_e2e,
                   "summary": m_sum, "matched_to": primary.value}
    bench.bar.close()
    train_wall = time.perf_counter() - t0
    log.info("bench quality: %d arms trained in %.0f s; scoring", bench.arms, train_wall)

    def score(model: AssembledModel | E2EModel, **kw: Any) -> dict[str, Any]:
        return evaluate_model(model, test, max_bytes=opts.test_bytes, progress=opts.progress, **kw)

    if matched is not None:
        matched["eval"] = score(E2EModel.load(RunDir(Path(matched["run_dir"])), precision=precision, device=device))
    if opts.matched_steps:
        e2e_eval = score(E2EModel.load(RunDir(e2e_dir), precision=precision, device=device))
    else:  # the one E2E run is the matched-FLOPs run; ``e2e`` reports it (its ``train_steps`` say so)
        assert matched is not None
        e2e_dir, e2e_eval = Path(matched["run_dir"]), matched["eval"]
    e2e_sum = dict(run_summary(RunDir(e2e_dir), "e2e"))
    for sec in sections.values():
        model = AssembledModel.load(RunDir(Path(sec["run_dir"])), precision=precision, device=device)
        sec["eval"] = score(model, chains=opts.chains, blocks_alone=True)  # a deterministic model runs one chain
        if sec["eval"]["bytes_scored"] != e2e_eval["bytes_scored"]:
            raise RunError("E2E and the blocks were scored on different bytes")

    result = _assemble(opts, sections, e2e_eval, e2e_sum, matched, sweeps, peak, precision.value, tokens, steps, device)
    result["e2e"]["run_dir"] = str(e2e_dir)
    result.update(bench_wall_s=time.perf_counter() - t0, train_wall_s=train_wall, resumed=resumed)
    log.info("bench quality: done in %.0f s (training %.0f s, scoring %.0f s)", result["bench_wall_s"], train_wall,
             result["bench_wall_s"] - train_wall)
    table = format_table(result)
    sys.stdout.write(table + "\n")
    if opts.json_path:
        write_result(result, opts.json_path, cfg.name)
    return result


def _val(summary: dict[str, Any], key: str) -> float | None:
    """An arm's validation CE at the end of its training, from its summary (None: it scored no validation)."""
    value = (summary.get("eval") or {}).get(key)
    return None if value is None or not math.isfinite(value) else float(value)


def _assemble(
    opts: QualityOptions, sections: dict[str, dict[str, Any]], e2e_eval: dict[str, Any], e2e_sum: dict[str, Any],
    matched: dict[str, Any] | None, sweeps: dict[str, Any], peak: dict[str, float], precision: str, tokens: int, steps: int,
    device: torch.device,
) -> dict[str, Any]:
    cfg = opts.cfg
    peak_p = peak[precision]
    e2e_train_flops = e2e_sum["flops_per_step"] * e2e_sum["steps"]
    per_objective: dict[str, Any] = {}
    for name, sec in sections.items():
        sums, ev = sec["summaries"], sec["eval"]
        obj = get_objective(replace(cfg, objective=Objective(name)))
        ref_key = obj.reference_name  # the key of its single-block references, recorded in the section for readers
        mem = max(s["train_mem_bytes"] for s in sums) if opts.isolate else None  # one process: no arm's own peak
        sps = [s["seconds_per_step"] for s in sums]
        entry: dict[str, Any] = {
            **ev,
            "run_dir": sec["run_dir"],
            "ce_nats_per_byte": ev["ce_nats_per_byte"],
            "gain_reference": obj.gain_reference,
            "reference_name": ref_key,
            "reference_label": obj.reference_label,
            ref_key: ev[ref_key],
            # each block's own CE on the first eval_bytes of validation at the end of its training (None: no
            # validation): a stack's last is its composed model's; what picks an lr, where the test CE only reports
            f"val_{ref_key}": [_val(s, f"val_{ref_key}") for s in sums],
            "train_flops": sum(s["flops_per_step"] * s["steps"] for s in sums),
            "train_flops_over_e2e": sum(s["flops_per_step"] * s["steps"] for s in sums) / e2e_train_flops,
            "train_wall_s_sequential": sum(s["wall_s"] for s in sums),
            "train_wall_s_per_block": [s["wall_s"] for s in sums],
            "train_steps_per_block": [s["steps"] for s in sums],
            "block_worker": {
                "train_mem_bytes": mem,  # frozen copies of the earlier blocks included (stack)
                "train_mem_bytes_per_block": [s["train_mem_bytes"] for s in sums] if opts.isolate else None,
                "seconds_per_step": sum(sps) / len(sps),
                "seconds_per_step_per_block": sps,
                "mfu": sum(s["achieved_flops"] for s in sums) / len(sums) / peak_p,
                "mfu_per_block": [s["achieved_flops"] / peak_p for s in sums],
                "analytic": _largest_block_analytic(cfg, Objective(name)),
            },
            "memory_ratio_block_over_e2e": None if mem is None else mem / max(1, e2e_sum["train_mem_bytes"]),
        }
        per_objective[name] = entry
    primary = per_objective[opts.objectives[0].value]
    result: dict[str, Any] = {
        "benchmark": "quality",
        "preset": cfg.name,
        "objective": opts.objective,
        "primary_objective": opts.objectives[0].value,
        "config": cfg.to_dict(),
        "command": opts.command,
        "machine": {**machine_info(device), "peak_flops": peak},
        "peak_flops": peak,
        "precision": precision,
        "data_dir": str(opts.data.root),
        "data_flavour": opts.data.flavour,
        "dataset_fingerprint": opts.data.fingerprint(),
        "split": "test",
        "test_bytes_limit": opts.test_bytes,  # None: the whole split
        "arms_isolated": opts.isolate,  # False: every arm trained in one process, so memory rows are not per arm
        "bytes_scored": e2e_eval["bytes_scored"],
        "lr_sweep": sweeps,
        "e2e_is_matched_flops": not opts.matched_steps,  # true: ``e2e`` is the matched-FLOPs run, not matched steps
        "e2e": {
            **e2e_eval,
            "train_wall_s": e2e_sum["wall_s"],
            "train_mem_bytes": e2e_sum["train_mem_bytes"] if opts.isolate else None,
            "train_steps": e2e_sum["steps"],
            "train_flops": e2e_train_flops,
            "seconds_per_step": e2e_sum["seconds_per_step"],
            "bytes_per_s": tokens / e2e_sum["seconds_per_step"],
            "flops_per_step": e2e_sum["flops_per_step"],
            "mfu": e2e_sum["achieved_flops"] / peak_p,
            "analytic": _analytic(E2ETransformer(cfg.model)),
        },
        "block_worker": {**primary["block_worker"], "bytes_per_s": tokens / primary["block_worker"]["seconds_per_step"]},
        "memory_ratio_block_over_e2e": primary["memory_ratio_block_over_e2e"],
        "objectives": per_objective,
        "steps_per_block": steps,
    }
    for sec in per_objective.values():  # each objective's references at the top level too, under its reference name
        result.setdefault(sec["reference_name"], sec[sec["reference_name"]])  # (historic: the diffusion chain's)
    if matched is not None:
        result["e2e_matched_flops"] = {
            "matched_to": matched["matched_to"],  # the objective whose training FLOPs it matches (derive_figures: ratios)
            "ce_nats_per_byte": matched["eval"]["ce_nats_per_byte"], "steps": matched["steps"],
            "train_flops": matched["train_flops"], "lr": matched["lr"], "eval": matched["eval"],
            "seconds_per_step": matched["summary"]["seconds_per_step"],
            "val_ce": _val(matched["summary"], "val_ce"),
        }
    return derive_figures(result)  # gains and gaps: the same code as --rederive
