"""A whole resumable training run of one module (a block, or the E2E reference), on :func:`.loop.train_steps`.

Resumable: model weights and AdamW state are checkpointed together
(:class:`.checkpointing.Checkpointer`), and all randomness (data windows, noise)
is a pure function of (seed, stream, step), so a resumed run continues exactly
where the killed one stopped. Ctrl-C saves a checkpoint before exiting.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
from torch import nn

from blocktrain.config import Precision, RunConfig
from blocktrain.data.dataset import ByteSplit
from blocktrain.device import CPU, autocast, compile_module
from blocktrain.evaluate.scoring import score_split
from blocktrain.progress import progress_bar
from blocktrain.train.checkpointing import Checkpointer
from blocktrain.train.loop import EvalHook, Hook, LossFn, MetricsHook, ProgressHook, train_steps
from blocktrain.train.memory import peak_rss_bytes
from blocktrain.train.metrics import JsonlWriter, drop_after, read_jsonl
from blocktrain.train.profile import ProfileHook
from blocktrain.train.step import lr_at, make_optimizer, optimizer_bytes

__all__ = ["TrainSummary", "run_training"]

log = logging.getLogger(__name__)

EvalLogits = Callable[[torch.Tensor, torch.Generator], torch.Tensor]  # x (b, t) on the device, generator -> (b, t, 256)


@dataclass(frozen=True)
class TrainSummary:
    name: str  # "block_k" or "e2e"
    steps: int  # steps completed in total (including resumed ones)
    wall_s: float  # wall-clock seconds of this process's training
    final_loss: float  # last training loss (NaN if no step ran)
    params: int  # trainable parameters
    optimizer_bytes: int  # bytes of AdamW state
    baseline_rss: int  # RSS just before the model was built
    peak_rss: int  # peak RSS of the process
    train_mem_bytes: int  # peak_rss - baseline_rss
    eval: dict[str, float]  # final evaluation figures
    precision: str  # arithmetic of the forward/backward pass ("bf16" or "fp32")
    device: str  # where it trained
    seconds_per_step: float  # median wall time of one step (data, forward, backward, update), first step excluded
    flops_per_step: float  # model FLOPs of one step (6 N tokens + attention; frozen forwards included)
    achieved_flops: float  # flops_per_step / seconds_per_step, FLOP/s


def finished_summary(metrics_path: Path, steps: int) -> TrainSummary | None:
    """The last summary ``metrics_path`` records for a run of ``steps`` steps, or None."""
    if not metrics_path.exists():
        return None
    names = {f.name for f in fields(TrainSummary)}
    for record in reversed(read_jsonl(metrics_path)):
        if record.get("event") == "summary" and record.get("steps") == steps and names <= record.keys():
            return TrainSummary(**{k: record[k] for k in names})
    return None


def run_training(
    *,
    name: str,
    module: nn.Module,
    cfg: RunConfig,
    step_fn: LossFn,
    ckpt_path: Path,
    state_path: Path,
    metrics_path: Path,
    baseline_rss: int,
    save_meta: dict[str, str],
    valid: ByteSplit | None,
    evaluate: tuple[str, EvalLogits],
    progress: bool = True,
    device: torch.device | None = None,
    precision: Precision = Precision.FP32,
    flops_per_token: float = 0.0,
) -> TrainSummary:
    """Train ``module`` (already on ``device``) for cfg.train.steps steps of ``step_fn`` under ``precision``.

    ``evaluate``: the name of the validation figure and the logits whose CE on the first ``eval_bytes`` of ``valid``
    it is (the generator seeded by the run's seed at each evaluation); no evaluation without ``valid``.
    """
    tc = cfg.train
    device = device or CPU
    tokens = tc.batch_size * cfg.model.context

    def eval_fn() -> dict[str, float]:
        assert valid is not None
        key, logits = evaluate
        module.eval()
        gen = torch.Generator().manual_seed(tc.seed)

        def lp(x: torch.Tensor) -> torch.Tensor:
            with torch.no_grad(), autocast(precision, device):
                out = logits(x.to(device), gen)
            return torch.log_softmax(out.float(), dim=-1).unsqueeze(0)

        return {key: score_split(lp, valid.data, cfg.model.context, max_bytes=tc.eval_bytes,
                                 device=device).ce_nats_per_byte}

    opt, names = make_optimizer(module, tc)
    compile_module(module, tc.compile)
    ckpt = Checkpointer(name, module, opt, names, cfg, ckpt_path, state_path, save_meta, every=tc.checkpoint_every)
    start = ckpt.resume()
    if start >= tc.steps and (done := finished_summary(metrics_path, tc.steps)) is not None:
        log.info("%s: already trained its %d steps; its summary is the one recorded when it finished", name, tc.steps)
        return done  # a summary of no step had NaN timings, ~0 s of wall time and the memory of a load
    if ckpt_path.exists():
        log.info("%s: resuming at step %d of %d", name, start, tc.steps)
    if dropped := drop_after(metrics_path, start):  # start 0 too: a kill after the step-0 save left later steps
        log.info("%s: dropped %d metrics records of steps after %d, which this run logs again", name, dropped, start)
    if start == 0:
        ckpt.save(0)  # step-0 weights: initial state is reproducible and resumable
    metrics = JsonlWriter(metrics_path)
    bar = progress_bar(total=tc.steps, initial=start, desc=name, unit="step", disable=not progress, dynamic_ncols=True)
    shown = ProgressHook(bar, tokens)
    hooks: list[Hook] = [shown, MetricsHook(metrics, tc.log_every, last=tc.steps, progress=shown), ckpt]
    if valid is not None:
        hooks.append(EvalHook(eval_fn, tc.eval_every, metrics, module))
    first_profiled = max(start, tc.steps - tc.profile_steps)
    if tc.profile_steps and first_profiled < tc.steps:  # the run's last steps: after warm-up and compilation
        # first: its report is written before a checkpoint or an evaluation the last step triggers
        hooks.insert(0, ProfileHook(first_profiled, tc.steps - first_profiled, device, metrics_path))
    t0 = time.perf_counter()
    try:
        result = train_steps(module, opt, step_fn, range(start, tc.steps), lr=lambda s: lr_at(s, tc),
                             grad_clip=tc.grad_clip, precision=precision, device=device, hooks=hooks)
    finally:
        bar.close()
    ckpt.save(result.done)
    wall = time.perf_counter() - t0
    peak = peak_rss_bytes()
    final_eval = eval_fn() if valid is not None else {}
    if final_eval:
        metrics.write(step=result.done, event="eval", **final_eval)
    timed = result.step_seconds[1:] or result.step_seconds  # the first step of a process pays one-off kernel set-up
    s_per_step = statistics.median(timed) if timed else float("nan")
    summary = TrainSummary(
        name=name,
        steps=result.done,
        wall_s=wall,
        final_loss=result.last_loss,
        params=sum(p.numel() for p in module.parameters() if p.requires_grad),
        optimizer_bytes=optimizer_bytes(module),
        baseline_rss=baseline_rss,
        peak_rss=peak,
        train_mem_bytes=peak - baseline_rss,
        eval=final_eval,
        precision=precision.value,
        device=str(device),
        seconds_per_step=s_per_step,
        flops_per_step=flops_per_token * tokens,
        achieved_flops=flops_per_token * tokens / s_per_step if timed else float("nan"),
    )
    metrics.write(event="summary", **asdict(summary))
    return summary
