"""Evaluation of a loaded model on a split, as a JSON-ready dict and a text table."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import torch

from blocktrain.data.dataset import ByteSplit
from blocktrain.evaluate.assembled import AssembledModel, E2EModel
from blocktrain.evaluate.scoring import ScoreResult, score_split


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
    """CE of ``model`` on ``split``; with ``blocks_alone`` also each single-block reference and the compositional gain.

    The references are the run objective's (``prefix_ce`` for a stack, scored in the
    same pass as the composed model, whose logits are the last prefix's;
    ``blocks_alone_ce`` for diffusion blocks, one pass per block).
    """
    if chains < 1:
        raise ValueError("chains must be >= 1")
    t0 = time.perf_counter()
    k = 1 if model.deterministic else chains
    assembled = model if isinstance(model, AssembledModel) else None
    # a stack scores every prefix in the pass that scores the composed model (its last prefix)
    one_pass = blocks_alone and assembled is not None and assembled.objective.composed_is_last_reference

    def log_probs(x: torch.Tensor) -> torch.Tensor:
        if one_pass:
            assert assembled is not None
            return assembled.reference_log_probs(x, seed=seed)  # (B, b, t, 256); the last is the composed model
        return model.log_probs(x, chains=k, seed=seed)

    def score(fn: Callable[[torch.Tensor], torch.Tensor], desc: str) -> ScoreResult:
        return score_split(fn, split.data, model.context, batch_size=batch_size, max_bytes=max_bytes, progress=progress,
                           desc=desc, device=model.device)

    res = score(log_probs, f"{model.kind} {split.name}")
    summary = res.to_dict()
    if one_pass:
        composed = res.ce_per_chain[-1]
        summary.update(ce_nats_per_byte=composed, bits_per_byte=composed / math.log(2), perplexity=math.exp(composed),
                       chains=1, ce_mixture_nats_per_byte=None, ce_per_chain=[composed])
    out: dict[str, Any] = {
        "model": model.kind,
        "objective": str(model.cfg.objective) if assembled is not None else "e2e",
        "split": split.name,
        "data_file": str(split.path),
        **summary,
        "forward_flops_per_byte": model.traversal_flops_per_byte(),
        "precision": model.precision.value,
        "device": str(model.device),
    }
    if blocks_alone and assembled is not None:
        if one_pass:
            refs = list(res.ce_per_chain)
        else:
            refs = []
            for b in range(len(assembled.blocks)):

                def alone(x: torch.Tensor, b: int = b) -> torch.Tensor:
                    return assembled.reference_log_probs(x, seed=seed, only=b)

                refs.append(score(alone, f"block {b} alone").ce_nats_per_byte)
        objective = assembled.objective
        # the references under the objective's own key, and that key and how to read it beside them, so that
        # readers of the result (format_eval, bench quality's table) need not know any objective's names
        out[objective.reference_name] = refs
        out.update(reference_name=objective.reference_name, reference_label=objective.reference_label,
                   gain_reference=objective.gain_reference)
        out["compositional_gain_nats_per_byte"] = compositional_gain(out["ce_nats_per_byte"], refs, objective.gain_reference)
    out["wall_s"] = time.perf_counter() - t0
    return out


def compositional_gain(ce: float, refs: list[float], reference: str) -> float:
    """The single-block reference minus the composed model's CE (nats/byte; positive: composing helps).

    ``reference`` is the objective's ``gain_reference``: "first" (the composed stack is its own
    last prefix, so it is measured against the first prefix, block 0 and its head) or "best"
    (a diffusion chain against its best block alone).
    """
    if reference not in ("first", "best"):
        raise ValueError(f"gain reference must be 'first' or 'best', got {reference!r}")
    return (refs[0] if reference == "first" else min(refs)) - ce


LEGACY_REFERENCE_LABELS = {"prefix_ce": "prefixes", "blocks_alone_ce": "blocks alone"}  # the built-ins' keys and
# labels, for results written before they named theirs
LEGACY_REFERENCE_NAMES = tuple(LEGACY_REFERENCE_LABELS)


def reference_key(r: dict[str, Any]) -> str | None:
    """The key of a result's single-block references: the ``reference_name`` it records, else (a result written
    before it was recorded) the key of the built-in objective it holds; None: it holds no references."""
    name = r.get("reference_name")
    if isinstance(name, str):
        return name
    return next((key for key in LEGACY_REFERENCE_NAMES if key in r), None)


def reference_label(r: dict[str, Any], key: str) -> str:
    """How a table names the references under ``key``: the label the result records, else (an older result) the
    built-in's label or the key itself."""
    label = r.get("reference_label")
    return label if isinstance(label, str) else LEGACY_REFERENCE_LABELS.get(key, key)


def format_eval(r: dict[str, Any]) -> str:
    lines = [
        f"model       {r['model']}",
        f"split       {r['split']} ({r['bytes_scored']:,} bytes scored)",
        f"CE          {r['ce_nats_per_byte']:.4f} nats/byte  ({r['bits_per_byte']:.4f} bits/byte, ppl {r['perplexity']:.3f})",
    ]
    if r.get("ce_mixture_nats_per_byte") is not None:
        lines.append(f"K={r['chains']} mix     {r['ce_mixture_nats_per_byte']:.4f} nats/byte")
    key = reference_key(r)
    if key is not None and key in r:
        label = reference_label(r, key)
        lines.append(f"{label:<11} " + ", ".join(f"{c:.4f}" for c in r[key]))
    if "compositional_gain_nats_per_byte" in r:
        which = r.get("gain_reference") or "chosen"  # "first" or "best" (compositional_gain); a result before it: unsaid
        refs = f" ({reference_label(r, key)})" if key is not None else ""
        lines.append(f"gain        {r['compositional_gain_nats_per_byte']:+.4f} nats/byte over the {which} single-block "
                     f"reference{refs}")
    return "\n".join(lines)
