"""Serving a stack run: score/ar equal the local model, KV caches roll back and evict, sweep is refused."""

from __future__ import annotations

import argparse
import asyncio
from dataclasses import replace
from pathlib import Path
from typing import cast

import pytest
import torch

from blocktrain.checkpoint.run import RunDir
from blocktrain.config import Objective, Precision, RunConfig
from blocktrain.data.dataset import open_data_dir
from blocktrain.errors import WireError
from blocktrain.evaluate.assembled import AssembledModel
from blocktrain.evaluate.generate import generate
from blocktrain.presets import tiny
from blocktrain.serve.client.pipeline import PipelineClient
from blocktrain.serve.runtime.kvcache import CacheEntry, CacheOptions, KVCache
from blocktrain.serve.runtime.loading import load_run_span
from blocktrain.serve.runtime.stack import StackSpan
from blocktrain.serve.wire.frames import Frame, FrameKind, Mode, UnknownRequestError
from blocktrain.train.block import train_block
from tests.conftest import write_data_dir
from tests.serve_utils import ring

STACK_SPANS = ((0, 1), (2, 3))  # B=4 blocks over two stages
TOL = 1e-5  # fp32: the pipeline and the local model run the same kernels; cached attention differs by rounding
BF16_TOL = 0.1  # bf16 autocast: cached single-position steps round differently from the full-sequence forward


def train_stack_run(root: Path, steps: int = 30, head_layers: int = 0) -> Path:
    # fp32 pinned: the fixture's model (and whether its prefixes draft well) must not depend on the CPU's bf16
    cfg = replace(tiny(), objective=Objective.STACK).with_train(steps=steps, eval_bytes=0, precision=Precision.FP32)
    cfg = replace(cfg, stack=replace(cfg.stack, head_layers=head_layers))
    data = open_data_dir(write_data_dir(root / "data"))
    for k in range(cfg.model.n_blocks):
        train_block(cfg, data, root / "run", k, progress=False)
    return root / "run"


@pytest.fixture(scope="module")
def stack_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_stack_run(tmp_path_factory.mktemp("stack"), head_layers=1)


def spans(
    run: Path, precision: Precision = Precision.FP32, layout: tuple[tuple[int, int], ...] = STACK_SPANS, **cache: object
) -> list[StackSpan]:
    opts = CacheOptions(**cache)  # type: ignore[arg-type]
    return [cast(StackSpan, load_run_span(RunDir(run), lo, hi, precision, opts)) for lo, hi in layout]


def local(run: Path, precision: Precision = Precision.FP32) -> AssembledModel:
    return AssembledModel.load(RunDir(run), precision=precision)


def test_serve_picks_the_stack_span(stack_run: Path) -> None:
    span = load_run_span(RunDir(stack_run), 0, 1)
    assert isinstance(span, StackSpan) and (span.lo, span.hi, span.family) == (0, 1, "stack")


@pytest.mark.parametrize("precision", [Precision.FP32, Precision.BF16])
def test_score_equals_assembled_log_probs(stack_run: Path, precision: Precision) -> None:
    x = torch.randint(0, 256, (3, 24), dtype=torch.uint8)

    async def run(addr):  # type: ignore[no-untyped-def]
        async with PipelineClient(addr, timeout_s=30) as c:
            return await c.score(x)

    with ring(spans(stack_run, precision)) as stages:
        logits = asyncio.run(run(stages[0].address))
    ref = local(stack_run, precision).log_probs(x)[0]
    assert torch.equal(torch.log_softmax(logits, -1), ref)  # same blocks' own forward, same autocast: bit-identical


@pytest.mark.parametrize(("precision", "tol"), [(Precision.FP32, TOL), (Precision.BF16, BF16_TOL)])
def test_cached_ar_equals_local_generate(stack_run: Path, precision: Precision, tol: float) -> None:
    prompt = b"The game began"
    model = local(stack_run, precision)

    async def run(addr):  # type: ignore[no-untyped-def]
        async with PipelineClient(addr, timeout_s=30) as c:
            text = await c.generate_ar(prompt, 24, temperature=0.8, top_k=40, seed=4)  # 14 + 24 crosses the context of 32
            f = Frame(FrameKind.SUBMIT, c.new_id(), Mode.AR, params={"pos": 0},
                      tensors={"x": torch.tensor([list(prompt)], dtype=torch.uint8)})
            return text, (await c.call(f)).tensors["logits"]

    with ring(spans(stack_run, precision)) as stages:
        text, logits = asyncio.run(run(stages[0].address))
        cached = [len(cast(StackSpan, s.server.span).cache) for s in stages]
    ref = model.log_probs(torch.tensor([list(prompt)], dtype=torch.uint8))[0, 0, -1]
    assert (torch.log_softmax(logits[0], -1) - ref).abs().max() <= tol
    if precision is Precision.FP32:
        assert text == generate(model, prompt, 24, temperature=0.8, top_k=40, seed=4)
    assert cached == [1, 1]  # the generation was released; only the last single frame's cache is left


def test_sweep_and_baseline_refused(stack_run: Path) -> None:
    span = spans(stack_run)[0]
    x = torch.zeros(1, 4, dtype=torch.uint8)
    with pytest.raises(WireError, match="sweep is a diffusion mode"):
        span.validate(Frame(FrameKind.SUBMIT, "r", Mode.SWEEP, params={"n_new": 4, "prompt_len": 4}, tensors={"x": x}))
    with pytest.raises(WireError, match="not one of score/ar/spec"):
        span.validate(Frame(FrameKind.SUBMIT, "r", Mode.BASELINE, tensors={"x": x}))
    with pytest.raises(UnknownRequestError):
        span.validate(Frame(FrameKind.SUBMIT, "r", Mode.AR, params={"pos": 3}, tensors={"x": x}))


def test_cached_steps_equal_full_forward(stack_run: Path) -> None:
    """Chunks through both spans with rollback equal one full forward of the accepted text."""
    first, last = spans(stack_run)
    model = local(stack_run)
    text = torch.randint(0, 256, (1, 20), dtype=torch.uint8)
    e0, e1 = CacheEntry(), CacheEntry()
    with torch.inference_mode():
        outs = []
        for a, b in ((0, 7), (7, 12), (12, 13)):
            h, _ = first.cached_step(e0, text[:, a:b], a)
            outs.append(last.cached_step(e1, h, a)[1])
        junk = torch.randint(0, 256, (1, 5), dtype=torch.uint8)  # rejected positions 13..17
        last.cached_step(e1, first.cached_step(e0, junk, 13)[0], 13)
        e0.truncate(13)
        e1.truncate(13)
        h, _ = first.cached_step(e0, text[:, 13:], 13)
        outs.append(last.cached_step(e1, h, 13)[1])
    ref = model.log_probs(text)[0, 0]
    logits = cast(list[torch.Tensor], outs)  # the last span runs the head: its logits are never None
    assert torch.allclose(torch.log_softmax(torch.cat(logits, dim=1)[0], -1), ref, atol=TOL)


def test_cache_eviction_by_count_bytes_and_idle(caplog: pytest.LogCaptureFixture) -> None:
    def entry(n: int) -> CacheEntry:
        return CacheEntry(n, {"0.0": (torch.zeros(1, 2, n, 4), torch.zeros(1, 2, n, 4))})  # 64 n bytes

    cache = KVCache(CacheOptions(max_requests=2, max_bytes=10_000, ttl_s=60))
    for rid in ("a", "b", "c"):
        cache.put(rid, entry(4))
    assert "a" not in cache and len(cache) == 2 and cache.evictions == 1
    cache = KVCache(CacheOptions(max_requests=8, max_bytes=64 * 10, ttl_s=60))
    cache.put("a", entry(4))
    cache.put("b", entry(4))
    cache.put("c", entry(4))  # 768 bytes > 640: the least recently used goes
    assert ("a" in cache, "b" in cache, "c" in cache) == (False, True, True)
    assert "KV caches hold 768 bytes (cap 640): dropped the least recently used request a" in caplog.text
    cache.put("d", entry(20))  # alone over the cap: everything goes, itself last
    assert len(cache) == 0
    cache = KVCache(CacheOptions(ttl_s=0.01))
    cache.put("a", entry(2))
    cache.peek("a").used -= 1.0  # type: ignore[union-attr]
    assert cache.expire_idle() == 1 and len(cache) == 0
    with pytest.raises(UnknownRequestError):
        cache.checkout("a", 2)


def test_cli_serve_precision_flag() -> None:
    from blocktrain.cli.main import build_parser
    from blocktrain.cli.serving import cache_options
    from blocktrain.serve.runtime.kvcache import CacheOptions

    args = build_parser().parse_args(["serve", "--run", "r", "--blocks", "0-1", "--precision", "bf16", "--cache-mib", "8"])
    assert args.precision == "bf16" and cache_options(args) == CacheOptions(max_bytes=8 * 2**20, ttl_s=600.0)
    gen = build_parser().parse_args(["generate", "--pipeline", "h:1", "--mode", "spec", "--draft-max", "8"])
    assert isinstance(gen, argparse.Namespace) and (gen.mode, gen.draft_min, gen.draft_max) == ("spec", 1, 8)


def test_stack_config_roundtrip_guard(stack_run: Path) -> None:
    cfg: RunConfig = RunDir(stack_run).load_config()
    assert cfg.objective is Objective.STACK and cfg.stack.head_layers == 1


def test_diffusion_span_precision_bf16() -> None:
    """--precision bf16 on diffusion blocks: a span's score equals AssembledModel under the same precision."""
    from tests.serve_utils import SPANS, block_spans, tiny_models

    cfg, blocks, _ = tiny_models(seed=0)
    x = torch.randint(0, 256, (2, 16), dtype=torch.uint8)
    got = []
    for precision in (Precision.FP32, Precision.BF16):
        stages = block_spans(cfg, blocks, SPANS)
        frame = Frame(FrameKind.SUBMIT, "r", Mode.SCORE, params={"seed": 3}, tensors={"x": x})
        for span in stages:
            span.precision = precision
            frame = span.run([frame])[0]
        got.append(torch.log_softmax(frame.tensors["logits"], -1))
        ref = AssembledModel(blocks, cfg, precision).log_probs(x, seed=3)[0]
        assert torch.allclose(got[-1], ref, atol=1e-5)
    assert not torch.equal(got[0], got[1])  # bf16 did change the arithmetic
