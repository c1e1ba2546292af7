"""Each training-speed lever of issue 10, measured on its own before it is adopted (cpu-small shapes).

Times one optimiser step of the E2E model and of a diffusion block, in-process,
with one lever changed at a time against the adopted default (bf16 autocast,
explicit CPU attention, fused AdamW, 2 threads). Prints a table and writes JSON.

    python benchmarks/quality/speed_ablation.py --json benchmarks/results/speed-ablation-cpu-small.json

Run it alone on the machine: every figure is a wall-clock time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from blocktrain.config import Precision
from blocktrain.data.dataset import resolve_data_dir
from blocktrain.data.stream import TrainStream
from blocktrain.model import layers
from blocktrain.model.e2e import E2ETransformer
from blocktrain.model.loss import lm_loss
from blocktrain.objectives import get_objective
from blocktrain.presets import get_preset
from blocktrain.train.loop import train_steps
from blocktrain.train.step import decay_groups, lr_at, make_optimizer

CPU = torch.device("cpu")


def plain_modulated_norm(self: layers.AdaLayerNorm, x: torch.Tensor, shift: Any = None, scale: Any = None) -> torch.Tensor:
    """The modulated LayerNorm as a plain autograd expression (keeps LN(x) for the backward)."""
    if shift is None or scale is None:
        return self.norm(x)
    return torch.nn.functional.layer_norm(x, x.shape[-1:], eps=self.norm.eps) * (1 + scale) + shift


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """SDPA also where ``layers.causal_attention`` takes its explicit form (bf16 on CPU)."""
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


def time_steps(step: Callable[[int], None], n: int) -> float:
    for i in range(2):
        step(i)
    times = []
    for i in range(2, 2 + n):
        t0 = time.perf_counter()
        step(i)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def make_step(kind: str, cfg: Any, precision: Precision, opt_kind: str, compiled: bool, clip: bool) -> Callable[[int], None]:
    torch.manual_seed(0)
    if kind == "e2e":
        model: nn.Module = E2ETransformer(cfg.model)
    else:
        model = get_objective(cfg).build_block(0)
    opt, _ = make_optimizer(model, cfg.train)
    if opt_kind != "fused":  # the same groups (weight decay on matrices only) and betas, another implementation
        groups, _ = decay_groups(model, cfg.train)
        opt = torch.optim.AdamW(groups, lr=cfg.train.lr, betas=(0.9, 0.95), foreach=opt_kind == "foreach")
    if compiled:  # in place: the block's loss calls the module itself (a torch.compile wrapper it never used)
        model.compile()
    obj = get_objective(cfg)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (cfg.train.batch_size, cfg.model.context), generator=g, dtype=torch.uint8)
    y = torch.randint(0, 256, x.shape, generator=g)

    def loss_at(i: int) -> tuple[torch.Tensor, dict[str, float | torch.Tensor]]:
        loss = lm_loss(model(x), y) if kind == "e2e" else obj.block_loss(model, 0, x, y, torch.Generator().manual_seed(i)).loss
        return loss, {}

    def step(i: int) -> None:
        train_steps(model, opt, loss_at, range(i, i + 1), lr=lambda s: lr_at(s, cfg.train),
                    grad_clip=cfg.train.grad_clip if clip else 0.0, precision=precision)

    return step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="cpu-small")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per row (after 2 warm-up steps)")
    ap.add_argument("--data", default=None, help="data directory (for the batch-assembly row)")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile rows (slow to compile)")
    ap.add_argument("--no-malloc", action="store_true", help="skip the mallopt rows")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    cfg = get_preset(args.preset)
    torch.set_num_threads(2)
    rows: list[dict[str, Any]] = []

    def row(trainer: str, lever: str, **kw: Any) -> None:
        setting = {"precision": Precision.BF16, "opt_kind": "fused", "compiled": False, "clip": True, **kw}
        s = time_steps(make_step(trainer, cfg, **setting), args.steps)
        rows.append({"trainer": trainer, "lever": lever, "s_per_step": s})
        print(f"{trainer:6s} {lever:40s} {s:.3f} s/step", flush=True)

    for trainer in ("e2e", "block"):
        row(trainer, "adopted: bf16, explicit attention, fused AdamW")
        row(trainer, "fp32 (SDPA)", precision=Precision.FP32)
        adopted = layers.causal_attention
        layers.causal_attention = sdpa_attention  # the name CausalSelfAttention calls
        row(trainer, "bf16 with SDPA attention")
        layers.causal_attention = adopted
        row(trainer, "foreach AdamW", opt_kind="foreach")
        row(trainer, "single-tensor AdamW", opt_kind="single")
        row(trainer, "no gradient clipping (norm not computed)", clip=False)
        torch.set_num_threads(1)
        row(trainer, "1 thread")
        torch.set_num_threads(2)
        if not args.no_compile:
            row(trainer, "torch.compile", compiled=True)
    real = layers.AdaLayerNorm.forward
    layers.AdaLayerNorm.forward = plain_modulated_norm  # type: ignore[method-assign,assignment]
    row("block", "plain modulated LayerNorm (no recompute)")
    layers.AdaLayerNorm.forward = real  # type: ignore[method-assign]
    data = resolve_data_dir(args.data).open("train")
    stream = TrainStream(data.data, cfg.model.context, cfg.train.batch_size, 0)
    t0 = time.perf_counter()
    for i in range(50):
        stream.batch(i)
    rows.append({"trainer": "data", "lever": "batch assembly (TrainStream.batch)", "s_per_step": (time.perf_counter() - t0) / 50})
    print(f"data   batch assembly: {rows[-1]['s_per_step'] * 1e3:.2f} ms per batch")
    if not args.no_malloc:
        # Last: mallopt cannot be undone. Large activations then stay in the heap instead of being mmap'd and
        # unmapped every step (each first touch of a fresh mapping page-faults).
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3
        libc.mallopt(m_mmap_threshold, 32 << 20)  # the largest glibc accepts on 64-bit
        libc.mallopt(m_trim_threshold, (1 << 31) - 1)
        for trainer in ("e2e", "block"):
            row(trainer, "glibc malloc without mmap/trim (mallopt)")
    if args.json:
        Path(args.json).write_text(json.dumps({"preset": args.preset, "rows": rows, "torch": torch.__version__,
                                               "command": "python benchmarks/quality/speed_ablation.py " + " ".join(
                                                   a for a in __import__("sys").argv[1:])}, indent=2) + "\n")


if __name__ == "__main__":
    main()
