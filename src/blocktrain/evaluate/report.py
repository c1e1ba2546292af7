"""Evaluation of a loaded model on a split, as a JSON-ready dict and a text table."""

from __future__ import annotations

import time
from typing import Any

import torch

from blocktrain.data.dataset import ByteSplit
from blocktrain.evaluate.assembled import AssembledModel, E2EModel
from blocktrain.evaluate.scoring import score_split


def evaluate_model(
    model: AssembledModel | E2EModel,
    split: ByteSplit,
    *,
    chains: int = 1,
    max_bytes: int | None = None,
    blocks_alone: bool = False,
    progress: bool = False,
    batch_size: int = 32,
    seed: int = 0,
) -> dict[str, Any]:
    if chains < 1:
        raise ValueError("chains must be >= 1")
    t0 = time.perf_counter()
    k = chains if isinstance(model, AssembledModel) else 1
    res = score_split(
        lambda x: model.log_probs(x, chains=k, seed=seed),
        split.data, model.context, batch_size=batch_size, max_bytes=max_bytes, progress=progress,
        desc=f"{model.kind} {split.name}",
    )
    out: dict[str, Any] = {
        "model": model.kind,
        "split": split.name,
        "data_file": str(split.path),
        **res.to_dict(),
        "forward_flops_per_byte": model.traversal_flops_per_byte(),
        "wall_s": time.perf_counter() - t0,
    }
    if blocks_alone and isinstance(model, AssembledModel):
        alone_ce: list[float] = []
        assembled = model
        for b in range(len(model.blocks)):

            def alone(x: torch.Tensor, b: int = b) -> torch.Tensor:
                return assembled.block_alone_log_probs(b, x, seed=seed)

            r = score_split(
                alone,
                split.data, model.context, batch_size=batch_size, max_bytes=max_bytes, progress=progress,
                desc=f"block {b} alone",
            )
            alone_ce.append(r.ce_nats_per_byte)
        out["blocks_alone_ce"] = alone_ce
        out["compositional_gain_nats_per_byte"] = min(alone_ce) - res.ce_nats_per_byte
    return out


def format_eval(r: dict[str, Any]) -> str:
    lines = [
        f"model       {r['model']}",
        f"split       {r['split']} ({r['bytes_scored']:,} bytes scored)",
        f"CE          {r['ce_nats_per_byte']:.4f} nats/byte  ({r['bits_per_byte']:.4f} bits/byte, ppl {r['perplexity']:.3f})",
    ]
    if r.get("ce_mixture_nats_per_byte") is not None:
        lines.append(f"K={r['chains']} mix     {r['ce_mixture_nats_per_byte']:.4f} nats/byte")
    if "blocks_alone_ce" in r:
        lines.append("blocks alone " + ", ".join(f"{c:.4f}" for c in r["blocks_alone_ce"]))
    return "\n".join(lines)
