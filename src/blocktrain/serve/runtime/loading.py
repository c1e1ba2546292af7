"""Build a stage's span from a run directory, or with random weights for a scale run.

A stage loads only the blocks (or E2E layers) it serves. Random-weight spans
are seeded per block/layer, so the three stages of a scale run agree on the
model without exchanging weights.
"""

from __future__ import annotations

import importlib
import logging
import re
from dataclasses import replace

import torch
from torch import nn

from blocktrain.checkpoint.blocks import load_block
from blocktrain.checkpoint.run import RunDir
from blocktrain.config import VOCAB_SIZE, ModelConfig, Objective, Precision, RunConfig
from blocktrain.device import CPU
from blocktrain.errors import ConfigError
from blocktrain.evaluate.assembled import E2EModel
from blocktrain.model.e2e import E2ETransformer
from blocktrain.model.layers import TransformerLayer
from blocktrain.objectives import get_objective
from blocktrain.presets import get_preset
from blocktrain.seeds import Seed
from blocktrain.serve.runtime import Span
from blocktrain.serve.runtime.e2e import E2ESpan
from blocktrain.serve.runtime.kvcache import CacheOptions

log = logging.getLogger(__name__)


def parse_span(text: str) -> tuple[int, int]:
    """``"0-1"`` -> (0, 1); ``"2"`` -> (2, 2)."""
    m = re.fullmatch(r"(\d+)(?:-(\d+))?", text.strip())
    if not m:
        raise ConfigError(f"span {text!r} must look like 'LO-HI' or 'K', e.g. --blocks 0-1")
    lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
    if hi < lo:
        raise ConfigError(f"span {text!r}: the end {hi} is before the start {lo}")
    return lo, hi


def parse_shape(text: str, base: str = "cpu-small", objective: Objective = Objective.DIFFUSION) -> RunConfig:
    """``"d_model=2048,n_layers=16,n_heads=16"`` -> the preset ``base`` with those model fields, for ``objective``."""
    cfg = get_preset(base)
    changes: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, _, value = part.partition("=")
        if key not in ModelConfig.__dataclass_fields__ or not value.isdigit():
            raise ConfigError(f"shape field {part!r} must be NAME=INT with NAME a ModelConfig field")
        changes[key] = int(value)
    try:
        model = replace(cfg.model, **changes)
    except ConfigError as exc:
        raise ConfigError(f"shape {text!r}: {exc}") from exc
    return replace(cfg, name="random", objective=objective, model=model)


def _check_span(lo: int, hi: int, n: int, what: str) -> None:
    if not 0 <= lo <= hi < n:
        raise ConfigError(f"{what} {lo}-{hi} is outside 0-{n - 1} of this model")


def load_run_span(
    run: RunDir, lo: int, hi: int, precision: Precision = Precision.FP32, cache: CacheOptions | None = None,
    device: torch.device = CPU,
) -> Span:
    """Blocks lo..hi of a run, as the serving span its objective names (:func:`build_span`), on ``device``."""
    cfg = run.load_config()
    blocker = get_objective(cfg).serving_blocker()
    if blocker is not None:
        raise ConfigError(f"{run.root} cannot be served: {blocker}")
    _check_span(lo, hi, cfg.model.n_blocks, "blocks")
    return build_span(cfg, {k: load_block(run, cfg, k) for k in range(lo, hi + 1)}, precision, cache, device)


def build_span(
    cfg: RunConfig, blocks: dict[int, nn.Module], precision: Precision = Precision.FP32, cache: CacheOptions | None = None,
    device: torch.device = CPU,
) -> Span:
    """The serving span of trained ``blocks`` on ``device``: the class the run's objective names in ``serving_span``
    (objectives never import serving code, so they name it)."""
    module, _, name = get_objective(cfg).serving_span.partition(":")
    span = getattr(importlib.import_module(module), name)(blocks, cfg, precision, cache, device)
    return span  # type: ignore[no-any-return]


Parts = tuple[
    dict[int, TransformerLayer], tuple[nn.Embedding, nn.Embedding] | None, tuple[nn.LayerNorm, nn.Linear] | None
]


def _e2e_parts(model: E2ETransformer, lo: int, hi: int) -> Parts:
    layers = {i: model.layers[i] for i in range(lo, hi + 1)}
    embed = (model.tok_emb, model.pos_emb) if lo == 0 else None
    head = (model.ln_f, model.head) if hi == model.cfg.n_layers - 1 else None
    return layers, embed, head  # type: ignore[return-value]


def load_e2e_span(
    run: RunDir, lo: int, hi: int, precision: Precision = Precision.FP32, cache: CacheOptions | None = None,
    device: torch.device = CPU,
) -> E2ESpan:
    cfg = run.load_config()
    _check_span(lo, hi, cfg.model.n_layers, "layers")
    return E2ESpan(cfg.model, *_e2e_parts(E2EModel.load(run, cfg).model, lo, hi), precision=precision, device=device,
                   cache=cache)


def _seeded(seed: int, role: Seed, *indices: int) -> None:
    torch.manual_seed(role.derive(seed, *indices))


def random_run_span(
    cfg: RunConfig, lo: int, hi: int, seed: int = 0, cache: CacheOptions | None = None, device: torch.device = CPU,
) -> Span:
    """Blocks lo..hi of ``cfg``'s objective with random weights (seeded per block), as its serving span. For scale
    runs and tests, where no run exists."""
    _check_span(lo, hi, cfg.model.n_blocks, "blocks")
    objective = get_objective(cfg)
    blocks: dict[int, nn.Module] = {}
    for k in range(lo, hi + 1):
        _seeded(seed, Seed.RANDOM_BLOCK, k)
        blocks[k] = objective.build_block(k).eval()
        z_in = getattr(blocks[k], "z_in", None)  # a denoiser's input projection: untrained, let z matter
        if z_in is not None:
            nn.init.normal_(z_in.weight, std=0.02)
    return build_span(cfg, blocks, Precision.FP32, cache, device)


def random_e2e_span(
    cfg: RunConfig, lo: int, hi: int, seed: int = 0, cache: CacheOptions | None = None, device: torch.device = CPU,
) -> E2ESpan:
    """E2E layers lo..hi (+ embeddings/head where they belong) with random weights."""
    m = cfg.model
    _check_span(lo, hi, m.n_layers, "layers")
    layers = {}
    for i in range(lo, hi + 1):
        _seeded(seed, Seed.RANDOM_LAYER, i)
        layers[i] = TransformerLayer(m.d_model, m.n_heads, m.mlp_ratio, conditioned=False)
    embed = head = None
    if lo == 0:
        _seeded(seed, Seed.RANDOM_EMBED)
        embed = (nn.Embedding(VOCAB_SIZE, m.d_model), nn.Embedding(m.context, m.d_model))
        for e in embed:
            nn.init.normal_(e.weight, std=0.02)
    if hi == m.n_layers - 1:
        _seeded(seed, Seed.RANDOM_HEAD)
        head = (nn.LayerNorm(m.d_model), nn.Linear(m.d_model, VOCAB_SIZE))
    return E2ESpan(m, layers, embed, head, device=device, cache=cache)
