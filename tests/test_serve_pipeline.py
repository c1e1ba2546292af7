"""Pipelined serving equals the local models: score, ar, sweep, the KV-cached baseline, batching, CLI."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import torch

from blocktrain.errors import WireError
from blocktrain.evaluate.generate import generate
from blocktrain.model.e2e import E2ETransformer
from blocktrain.model.layers import Cache
from blocktrain.serve.client.decoding import ar_logits
from blocktrain.serve.client.pipeline import PipelineClient, generate_remote
from blocktrain.serve.runtime.e2e import E2ESpan
from blocktrain.serve.wire.frames import Frame, FrameKind, Mode
from tests.serve_utils import E2E_SPANS, SPANS, block_spans, e2e_spans, local_models, ring, tiny_models

TOL = 1e-5


@pytest.fixture(scope="module")
def models():  # type: ignore[no-untyped-def]
    return tiny_models(seed=0)


def test_score_equals_local(models) -> None:  # type: ignore[no-untyped-def]
    cfg, blocks, e2e = models
    assembled, _ = local_models(cfg, blocks, e2e)
    x = torch.randint(0, 256, (3, 24), dtype=torch.uint8)

    async def run(addr):  # type: ignore[no-untyped-def]
        async with PipelineClient(addr, timeout_s=20) as c:
            return await c.score(x, seed=11)

    with ring(block_spans(cfg, blocks, SPANS)) as stages:
        logits = asyncio.run(run(stages[0].address))
    ref = assembled.log_probs(x, chains=1, seed=11)[0]
    assert torch.allclose(torch.log_softmax(logits, -1), ref, atol=TOL)


def test_ar_equals_local_generate(models) -> None:  # type: ignore[no-untyped-def]
    cfg, blocks, e2e = models
    assembled, _ = local_models(cfg, blocks, e2e)
    prompt = b"The game began"

    async def run(addr):  # type: ignore[no-untyped-def]
        async with PipelineClient(addr, timeout_s=20) as c:
            text = await c.generate_ar(prompt, 24, temperature=0.8, top_k=40, seed=4)  # crosses the context of 32
            ctx = torch.tensor([list(prompt)], dtype=torch.uint8)
            return text, await ar_logits(c, ctx, seed=9)

    with ring(block_spans(cfg, blocks, SPANS)) as stages:
        text, logits = asyncio.run(run(stages[0].address))
    assert text == generate(assembled, prompt, 24, temperature=0.8, top_k=40, seed=4)
    ref = assembled.log_probs(torch.tensor([list(prompt)], dtype=torch.uint8), seed=9)[0, 0, -1]
    assert torch.allclose(torch.log_softmax(logits[0], -1), ref, atol=TOL)


def test_kv_cached_layers_equal_full_forward(models) -> None:  # type: ignore[no-untyped-def]
    _, _, e2e = models
    x = torch.randint(0, 256, (1, 12))
    with torch.no_grad():
        h = e2e.tok_emb(x) + e2e.pos_emb(torch.arange(12))
        full = h
        for layer in e2e.layers:
            full = layer(full)
        past: Cache = {}
        outs = []
        for a, b in ((0, 5), (5, 8), (8, 9), (9, 12)):  # prefill, a chunk, single tokens
            y = h[:, a:b]
            for i, layer in enumerate(e2e.layers):
                y = layer(y, cache=past, name=str(i))
            outs.append(y)
    assert torch.allclose(torch.cat(outs, dim=1), full, atol=TOL)


def test_baseline_equals_local_e2e(models) -> None:  # type: ignore[no-untyped-def]
    """The KV-cached baseline equals local generate, its window sliding past the context as generate's does."""
    cfg, blocks, e2e = models
    _, local = local_models(cfg, blocks, e2e)
    prompt = b"Valkyria"

    long = b"Valkyria Chronicles III is a tactical role"  # 42 bytes: past the context of 32

    async def run(addr):  # type: ignore[no-untyped-def]
        async with PipelineClient(addr, timeout_s=20) as c:
            slid = await c.generate_baseline(long, 20, temperature=0.8, top_k=40, seed=2, top_p=0.9)
            return await c.generate_baseline(prompt, 30, temperature=0.8, top_k=40, seed=2), slid

    spans = e2e_spans(e2e, E2E_SPANS)
    with ring(spans) as stages:
        text, slid = asyncio.run(run(stages[0].address))
        for _ in range(100):  # RELEASE travels asynchronously and drops every KV cache
            if all(not s.cache for s in spans if isinstance(s, E2ESpan)):
                break
            time.sleep(0.02)
        assert all(not s.cache for s in spans if isinstance(s, E2ESpan))
    assert text == generate(local, prompt, 30, temperature=0.8, top_k=40, seed=2)  # 8 + 30: the window slides
    assert slid == generate(local, long, 20, temperature=0.8, top_k=40, seed=2, top_p=0.9)


def _sweep_frame(prompt: bytes, n: int, sweeps: int, seed: int) -> Frame:
    x = torch.tensor([list(prompt)], dtype=torch.uint8)
    params = {"seed": seed, "n_new": n, "prompt_len": len(prompt), "sweeps": sweeps, "temperature": 0.8, "top_k": 40}
    return Frame(FrameKind.SUBMIT, "s", Mode.SWEEP, 0, params, {"x": x})


def test_sweep_equals_one_local_span(models) -> None:  # type: ignore[no-untyped-def]
    """A sweep through three stages gives the bytes of running all blocks in one place."""
    cfg, blocks, _ = models
    whole = block_spans(cfg, blocks, [(0, 3)])[0]
    for sweeps in (1, 3):
        f = _sweep_frame(b"Senjo no", 16, sweeps, seed=5)
        out = whole.run([f])[0]
        while out.kind is FrameKind.WORK:  # further sweeps re-enter at block 0
            out = whole.run([out])[0]
        expected = bytes(out.tensors["bytes"][0].tolist())

        async def run(addr, sweeps=sweeps):  # type: ignore[no-untyped-def]
            async with PipelineClient(addr, timeout_s=20) as c:
                return await c.sweep(b"Senjo no", 16, sweeps=sweeps, temperature=0.8, top_k=40, seed=5)

        with ring(block_spans(cfg, blocks, SPANS)) as stages:
            got = asyncio.run(run(stages[0].address))
        assert got == expected and len(got) == 16


def test_concurrent_requests_are_batched(models) -> None:  # type: ignore[no-untyped-def]
    cfg, blocks, e2e = models
    assembled, _ = local_models(cfg, blocks, e2e)
    xs = [torch.randint(0, 256, (1, t), dtype=torch.uint8) for t in (9, 17, 17, 30, 5, 12)]

    async def run(addr):  # type: ignore[no-untyped-def]
        async with PipelineClient(addr, timeout_s=20) as c:
            return await asyncio.gather(*(c.score(x, seed=i) for i, x in enumerate(xs)))

    with ring(block_spans(cfg, blocks, SPANS), batch_window_s=0.02) as stages:
        outs = asyncio.run(run(stages[0].address))
        assert stages[0].server.counters.max_batch > 1  # frames of different lengths ran together
    for i, (x, logits) in enumerate(zip(xs, outs, strict=True)):
        ref = assembled.log_probs(x, seed=i)[0]
        assert torch.allclose(torch.log_softmax(logits, -1), ref, atol=TOL)


def test_too_long_request_is_rejected_with_advice(models) -> None:  # type: ignore[no-untyped-def]
    cfg, blocks, _ = models

    async def run(addr):  # type: ignore[no-untyped-def]
        async with PipelineClient(addr, timeout_s=20) as c:
            with pytest.raises(WireError, match="exceed the model context"):
                await c.score(torch.zeros(1, 40, dtype=torch.uint8))
            return await c.score(torch.zeros(1, 8, dtype=torch.uint8))  # and it keeps serving

    with ring(block_spans(cfg, blocks, SPANS)) as stages:
        assert asyncio.run(run(stages[0].address)).shape == (1, 8, 256)


def test_generate_remote_cli_path(models) -> None:  # type: ignore[no-untyped-def]
    cfg, blocks, e2e = models
    assembled, _ = local_models(cfg, blocks, e2e)
    with ring(block_spans(cfg, blocks, SPANS)) as stages:
        host, port = stages[0].address
        sampling: dict[str, Any] = {"temperature": 0.5, "top_k": 10, "seed": 1}
        got = generate_remote(f"{host}:{port}", "ar", b"Sega", 6, **sampling)
        assert got == generate(assembled, b"Sega", 6, **sampling)
        assert len(generate_remote(f"{host}:{port}", "sweep", b"Sega", 6, sweeps=2, **sampling)) == 6


def test_e2e_span_rejects_wrong_mode() -> None:
    e2e = E2ETransformer(tiny_models()[0].model)
    span = e2e_spans(e2e, [(0, 3)])[0]
    with pytest.raises(WireError, match="baseline"):
        span.validate(Frame(FrameKind.SUBMIT, "a", Mode.AR, tensors={"x": torch.zeros(1, 3, dtype=torch.uint8)}))
    span.validate(Frame(FrameKind.SUBMIT, "a", Mode.SCORE, tensors={"x": torch.zeros(2, 3, dtype=torch.uint8)}))
    with pytest.raises(WireError, match="exceed the model context"):  # a window longer than the context
        span.validate(Frame(FrameKind.SUBMIT, "a", Mode.SCORE, tensors={"x": torch.zeros(1, 999, dtype=torch.uint8)}))
