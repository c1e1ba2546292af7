"""What sliding the window costs a stack stage past the context: re-prefilling the last window against extending a
KV cache by one position (what shifting the caches would cost per byte, were it exact).

    python benchmarks/serving/serve_window.py [--preset cpu-quick] [--repeat 30] [--json benchmarks/results/serve-window.json]

Random weights of the preset's shape (objective stack), one process, fp32, the blocks' own forward (the code the
stages run). Per byte past the context, ar and baseline re-prefill the last ``context`` bytes through every block;
a windowed spec traversal runs n_draft + 1 such windows. A KV shift would instead extend each cache by one
position, but it is not exact here (the positions are learned absolute embeddings, one per position of the
window, and each cached key and value depends on bytes the window has dropped), so serving re-prefills; this
measures what exactness costs. Runs in seconds.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from blocktrain.config import Objective
from blocktrain.model.layers import Cache
from blocktrain.model.stack import StackBlock
from blocktrain.presets import PRESETS


def best_ms(fn: Callable[[], object], repeat: int) -> tuple[float, float]:
    """(median, min) milliseconds of ``fn`` over ``repeat`` runs after one warm-up."""
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="cpu-quick")
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = replace(PRESETS[args.preset](), objective=Objective.STACK)
    c = cfg.model.context
    torch.manual_seed(0)
    blocks = [StackBlock(cfg.model, k).eval() for k in range(cfg.model.n_blocks)]
    window = torch.randint(0, 256, (1, c), dtype=torch.uint8)

    @torch.inference_mode()
    def prefill(rows: int = 1) -> torch.Tensor:
        h = window.expand(rows, -1)
        for b in blocks:
            h = b(h)
        return blocks[-1].logits(h)[:, -1]

    @torch.inference_mode()
    def fill_cache() -> Cache:
        cache: Cache = {}
        h = window[:, : c - 1]
        for b in blocks:
            h = b(h, cache=cache, pos=0)
        blocks[-1].logits(h, cache=cache)
        return cache

    base = fill_cache()

    @torch.inference_mode()
    def cached_step() -> torch.Tensor:
        cache = {k: (kv[0], kv[1]) for k, kv in base.items()}  # the layers append new tensors: base stays c - 1 long
        h = window[:, c - 1 :]
        for b in blocks:
            h = b(h, cache=cache, pos=c - 1)
        return blocks[-1].logits(h, cache=cache)[:, -1]

    out: dict[str, object] = {"command": "python " + shlex.join(["benchmarks/serving/serve_window.py", *sys.argv[1:]]),
                              "preset": args.preset, "context": c, "d_model": cfg.model.d_model,
                              "n_layers": cfg.model.n_layers, "n_blocks": cfg.model.n_blocks, "threads": args.threads}
    out["reprefill_ms"], out["reprefill_min_ms"] = best_ms(prefill, args.repeat)
    out["cached_step_ms"], out["cached_step_min_ms"] = best_ms(cached_step, args.repeat)
    for rows in (5, 17):  # a windowed spec traversal with n_draft 4 and 16, all windows batched
        out[f"windows_{rows}_batched_ms"], _ = best_ms(lambda r=rows: prefill(r), args.repeat)  # type: ignore[misc]
    out["reprefill_over_cached_step"] = float(out["reprefill_ms"]) / float(out["cached_step_ms"])  # type: ignore[arg-type]
    text = json.dumps(out, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
