"""Speculative decoding: the acceptance rule's distribution, greedy equality with local generation, rollback."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import subprocess
import time
from pathlib import Path
from typing import cast

import pytest
import torch

from blocktrain.bench.serve_client import draft_settings, timed_output
from blocktrain.bench.serve_spec import check_stack_run, spec_markdown, spec_summary, spec_task
from blocktrain.checkpoint.run import RunDir
from blocktrain.cli.main import main
from blocktrain.config import Objective, RunConfig
from blocktrain.data.stream import mix_seed
from blocktrain.diffusion.partition import NoisePartition
from blocktrain.diffusion.sampler import chain_step, position_noise
from blocktrain.errors import BlockTrainError, ConfigError, WireError
from blocktrain.evaluate.generate import generate
from blocktrain.model.block import BlockDenoiser
from blocktrain.sampling import filtered_probs, sample_probs
from blocktrain.serve.client.decoding import Sampling
from blocktrain.serve.client.pipeline import PipelineClient, generate_remote
from blocktrain.serve.runtime.kvcache import CacheEntry
from blocktrain.serve.runtime.loading import load_run_span
from blocktrain.serve.runtime.stack import StackSpan
from blocktrain.serve.wire.frames import Frame, FrameKind, Mode
from blocktrain.serve.wire.speculative import SpecParams, accept_draft, next_draft_len, update_rate, windows
from tests.forked_cli import spawn
from tests.serve_utils import SPANS, block_spans, entry_name, ring, tiny_models, wait_port
from tests.test_serve_stack import local, spans, train_stack_run

CHI2_7DOF_99_99 = 29.88  # the 0.9999 quantile of chi-square with 7 degrees of freedom
LONG_PROMPT = b"Valkyria Chronicles III is a tactical role"  # 42 bytes: longer than the tiny context of 32


@pytest.fixture(scope="module")
def stack_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_stack_run(tmp_path_factory.mktemp("spec"), steps=80)


# --- the acceptance rule ----------------------------------------------------------------
def chi_square(samples: torch.Tensor, p: torch.Tensor) -> float:
    counts = torch.bincount(samples, minlength=p.numel()).double()
    expected = p.double() * samples.numel()
    return float(((counts - expected) ** 2 / expected).sum())


def first_bytes(p: torch.Tensor, q: torch.Tensor, draws: int, seed: int) -> torch.Tensor:
    """The first byte speculative sampling emits, x ~ q drafted and judged against p, over ``draws`` trials."""
    g = torch.Generator().manual_seed(seed)
    drafts = torch.multinomial(q.expand(draws, -1), 1, replacement=True, generator=g).squeeze(-1)
    pp, qq = torch.stack([p, p]), q.unsqueeze(0)  # p_1 for the draft byte, p_2 for the bonus (not read here)
    out = [accept_draft([int(x)], pp, qq, g).emitted([int(x)])[0] for x in drafts]
    return torch.tensor(out)


def test_acceptance_rule_samples_from_p() -> None:
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(8, generator=g) * 1.5, -1)
    q = torch.softmax(torch.randn(8, generator=g) * 1.5, -1)
    out = first_bytes(p, q, 20_000, seed=1)
    assert chi_square(out, p) < CHI2_7DOF_99_99
    drafts_alone = torch.multinomial(q.expand(20_000, -1), 1, replacement=True, generator=g).squeeze(-1)
    assert chi_square(drafts_alone, p) > 10 * CHI2_7DOF_99_99  # the draft's own distribution fails the same test


def test_acceptance_rule_greedy_and_bonus() -> None:
    g = torch.Generator().manual_seed(0)
    logits_p = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0], [0.0, 0.0, 5.0]])
    p = filtered_probs(logits_p, 0.0)
    q = filtered_probs(torch.tensor([[0.0, 3.0, 1.0], [0.0, 4.0, 1.0]]), 0.0)
    v = accept_draft([1, 1], p, q, g)
    assert (v.accepted, v.next_byte, v.emitted([1, 1])) == (1, 0, [1, 0])  # keep argmax, reject, emit argmax p
    v = accept_draft([1, 0], p, filtered_probs(logits_p[:2], 0.0), g)
    assert (v.accepted, v.next_byte) == (2, 2)  # all kept: bonus argmax of p_3


def test_filters_top_k_top_p() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert torch.allclose(filtered_probs(logits, 1.0, top_p=0.7), torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    assert torch.allclose(filtered_probs(logits, 1.0, top_k=3), torch.tensor([[0.5, 0.3, 0.15, 0.0]]) / 0.95)
    assert torch.allclose(filtered_probs(logits, 1.0, top_p=0.4), torch.tensor([[1.0, 0.0, 0.0, 0.0]]))


def test_the_sampler_draws_what_multinomial_draws_without_reading_the_device() -> None:
    """sample_probs (the exponential race on the host generator's noise) equals torch.multinomial(probs, 1) bit for
    bit on the CPU, the generator left in the same state, for rows with zeros; on the meta device it runs through,
    so it reads no value back (multinomial reads its validity check); a generator off the host is refused."""
    for trial in range(200):
        probs = torch.softmax(3 * torch.randn(1 + trial % 5, 256), -1)
        probs[:, : trial % 200] = 0.0
        g, h = torch.Generator().manual_seed(trial), torch.Generator().manual_seed(trial)
        assert torch.equal(sample_probs(probs, g), torch.multinomial(probs, 1, generator=h).squeeze(-1))
        assert torch.equal(torch.rand(4, generator=g), torch.rand(4, generator=h))
    drawn = sample_probs(torch.full((3, 256), 1 / 256, device="meta"), torch.Generator().manual_seed(0))
    assert drawn.device.type == "meta" and drawn.shape == (3,)
    with pytest.raises(ValueError, match="CPU generator"):
        sample_probs(torch.ones(1, 256), cast(torch.Generator, FakeGenerator()))


class FakeGenerator:
    device = torch.device("meta")


def test_the_draft_loop_reads_each_byte_after_the_draft_before_it() -> None:
    """SpecParams.draft: byte i comes from logits_for(draft[:i]); greedy takes the argmax; q is carried per byte."""
    seen: list[list[int]] = []

    def logits_for(draft: torch.Tensor) -> torch.Tensor:
        seen.append(draft.tolist())
        logits = torch.zeros(256)
        logits[(7 * len(draft) + 3) % 256] = 9.0  # a distinct argmax per prefix length
        return logits

    sp = SpecParams(n_draft=4, temperature=0.0, top_k=0, top_p=1.0, seed=0)
    draft, carried = sp.draft(10, logits_for, torch.device("cpu"))
    assert draft.tolist() == [3, 10, 17, 24]
    assert seen == [[], [3], [3, 10], [3, 10, 17]]
    assert carried["draft"].tolist() == [draft.tolist()] and carried["draft"].dtype == torch.uint8
    assert carried["q"].shape == (4, 256) and carried["q"].argmax(dim=1).tolist() == draft.tolist()
    sampled = SpecParams(n_draft=4, temperature=1.0, top_k=0, top_p=1.0, seed=5)
    assert torch.equal(sampled.draft(10, logits_for, torch.device("cpu"))[0],
                       sampled.draft(10, logits_for, torch.device("cpu"))[0])
    empty, tensors = SpecParams(0, 0.0, 0, 1.0, 0).draft(10, logits_for, torch.device("cpu"))
    assert empty.shape == (0,) and tensors == {}


def test_draft_length_follows_acceptance() -> None:
    assert next_draft_len(0.0, 1, 16) == 1
    assert next_draft_len(0.5, 1, 16) == 2
    assert next_draft_len(0.9, 1, 16) == 10
    assert next_draft_len(1.0, 1, 16) == 16 and next_draft_len(1.0, 1, 8) == 8 and next_draft_len(0.0, 3, 8) == 3
    assert update_rate(0.5, 4, 4) == 0.75 and update_rate(0.5, 0, 0) == 0.5
    with pytest.raises(ConfigError):
        Sampling(draft_min=4, draft_max=2)


# --- over the pipeline ------------------------------------------------------------------
def wait_released(stages: list, timeout_s: float = 5.0) -> list[int]:  # type: ignore[type-arg]
    """Cached requests per stage, once RELEASE (sent without a reply) has reached every stage or the time is up."""
    deadline = time.monotonic() + timeout_s
    while any(len(s.server.span.cache) for s in stages) and time.monotonic() < deadline:
        time.sleep(0.02)
    return [len(s.server.span.cache) for s in stages]


@pytest.mark.parametrize("draft", [1, 4, 16])
def test_greedy_spec_equals_local_greedy(stack_run: Path, draft: int) -> None:
    prompt, n = b"The game began", 18  # 14 + 18 = the context of 32

    async def run(addr):  # type: ignore[no-untyped-def]
        async with PipelineClient(addr, timeout_s=30) as c:
            res = await c.generate_spec(prompt, n, temperature=0.0, draft_min=draft, draft_max=draft)
            chunks = [b async for b in c.iter_spec(prompt, n, temperature=0.0, draft_min=draft, draft_max=draft)]
            return res, chunks

    layout = ((0, 0), (1, 2), (3, 3)) if draft == 16 else ((0, 1), (2, 3))  # three stages: a middle one passes q on
    with ring(spans(stack_run, layout=layout)) as stages:
        res, chunks = asyncio.run(run(stages[0].address))
        left = wait_released(stages)
    assert res.data == generate(local(stack_run), prompt, n, temperature=0.0)
    assert b"".join(chunks) == res.data and len(chunks) == res.traversals
    assert len(res.data) == res.accepted + res.traversals  # each traversal: the kept drafts and one more byte
    assert res.drafted >= res.accepted and (draft != 4 or res.traversals < n)  # blocks 0-1 draft well enough to gain
    assert left == [0] * len(layout)  # released


@pytest.mark.parametrize(("prompt", "draft", "layout"), [(b"The game began", 4, ((0, 1), (2, 3))),
                                                      (b"The game began", 16, ((0, 0), (1, 2), (3, 3))),
                                                      (LONG_PROMPT, 4, ((0, 1), (2, 3)))])
def test_greedy_spec_slides_its_window_as_local_generate(
    stack_run: Path, prompt: bytes, draft: int, layout: tuple[tuple[int, int], ...]
) -> None:
    """Past the context (14 + 60 and 42 + 60 bytes against 32) greedy spec, greedy ar and local generate agree."""
    n = 60

    async def run(addr):  # type: ignore[no-untyped-def]
        async with PipelineClient(addr, timeout_s=30) as c:
            res = await c.generate_spec(prompt, n, temperature=0.0, draft_min=draft, draft_max=draft)
            return res, await c.generate_ar(prompt, n, temperature=0.0)

    with ring(spans(stack_run, layout=layout)) as stages:
        res, ar = asyncio.run(run(stages[0].address))
        left = wait_released(stages)
    assert res.data == ar == generate(local(stack_run), prompt, n, temperature=0.0)
    assert len(res.data) == res.accepted + res.traversals and res.traversals < n  # the drafts still pay off
    assert left == [0] * len(layout)


def windowed_step(first: StackSpan, last: StackSpan, text: list[int], **params: object) -> Frame:
    """One windowed spec frame through two stack spans, in process."""
    frame = Frame(FrameKind.SUBMIT, "w", Mode.SPEC, params={"window": True, "pos": 10, **params},
                  tensors={"x": torch.tensor([text], dtype=torch.uint8)})
    first.validate(frame)
    (work,) = first.run([frame])
    last.validate(work)
    (out,) = last.run([work])
    return out


def test_windowed_spec_frame_verifies_each_byte_on_the_window_generate_reads(stack_run: Path) -> None:
    """The exactness argument, tested: row i of a windowed frame's logits is the model's on the last 32 bytes before
    draft byte i (what local generate reads), and q_i is the entry prefix's filtered distribution on that same
    window, from which draft byte i was drawn. The acceptance rule then emits bytes distributed as p
    (test_acceptance_rule_samples_from_p)."""
    first, last = spans(stack_run)
    model = local(stack_run)
    text, n, temp = list(LONG_PROMPT[-32:]), 6, 0.9
    out = windowed_step(first, last, text, n_draft=n, temperature=temp, top_k=0, top_p=1.0, seed=3)
    draft, q, logits = out.tensors["draft"][0].tolist(), out.tensors["q"], out.tensors["logits"]
    assert (tuple(q.shape), tuple(logits.shape)) == ((n, 256), (n + 1, 256))
    rows = windows(torch.tensor(text, dtype=torch.uint8), torch.tensor(draft), 32)  # (n + 1, 32)
    assert rows.shape == (n + 1, 32) and rows[-1].tolist() == (text + draft)[-32:]
    with torch.inference_mode():
        want = model.log_probs(rows)[0][:, -1]  # (n + 1, 256)
        h = rows
        for k in (0, 1):
            h = first.blocks[k](h)
        prefix = first.blocks[1].logits(h)[:, -1].float()
    torch.testing.assert_close(torch.log_softmax(logits, -1), want, atol=1e-5, rtol=0)
    torch.testing.assert_close(q, filtered_probs(prefix[:n], temp), atol=1e-6, rtol=0)
    assert all(q[i, b] > 0 for i, b in enumerate(draft))


def test_windowed_spec_emits_bytes_distributed_as_the_window_s_p(stack_run: Path) -> None:
    """Sampled spec past the context keeps the model's distribution: the first byte a windowed traversal emits,
    over 1500 seeds, against p (top-k 8, temperature 1) on the last 32 bytes; chi-square at its 0.9999 quantile."""
    first, last = spans(stack_run)
    text = list(LONG_PROMPT[-32:])
    g = torch.Generator().manual_seed(0)
    emitted, rejected = [], 0
    with torch.inference_mode():
        for seed in range(1500):
            out = windowed_step(first, last, text, n_draft=1, temperature=1.0, top_k=8, top_p=1.0, seed=seed)
            draft, q = out.tensors["draft"][0].tolist(), out.tensors["q"]
            verdict = accept_draft(draft, filtered_probs(out.tensors["logits"], 1.0, 8), q, g)
            emitted.append(verdict.emitted(draft)[0])
            rejected += verdict.accepted == 0
        p = filtered_probs(local(stack_run).log_probs(torch.tensor([text], dtype=torch.uint8))[0, 0, -1:], 1.0, 8)[0]
    support = p.nonzero().flatten().tolist()
    assert len(support) == 8 and set(emitted) <= set(support)
    index = torch.tensor([support.index(b) for b in emitted])
    assert chi_square(index, p[support]) < CHI2_7DOF_99_99
    assert rejected > 0  # the prefix's q is not p: the rule had work to do


def test_spec_with_the_whole_model_as_draft_accepts_everything(stack_run: Path) -> None:
    """One stage holding all blocks drafts with the target itself: p = q, so every draft byte is kept."""
    whole = load_run_span(RunDir(stack_run), 0, 3)

    async def run(addr):  # type: ignore[no-untyped-def]
        async with PipelineClient(addr, timeout_s=30) as c:
            return await c.generate_spec(b"Sega", 20, temperature=0.8, top_k=40, top_p=0.9, seed=3, draft_max=8)

    async def slid(addr):  # type: ignore[no-untyped-def]
        async with PipelineClient(addr, timeout_s=30) as c:
            return await c.generate_spec(LONG_PROMPT, 30, temperature=0.8, top_k=40, top_p=0.9, seed=3, draft_max=8)

    with ring([whole]) as stages:
        res = asyncio.run(run(stages[0].address))
        windowed = asyncio.run(slid(stages[0].address))
    assert len(windowed.data) == 30 and windowed.accepted == windowed.drafted > 0  # windowed frames: p = q too
    assert len(res.data) == 20 and res.accepted == res.drafted > 0
    # the draft grows with the acceptance rate: 4 (+1), then 8 (+1), then the 5 (+1) left; a fixed 4 would take 4
    assert (res.traversals, res.drafted) == (3, 17)


def test_rejection_rolls_back_every_stage_cache(stack_run: Path) -> None:
    """After a rejection at draft position m = 3 of 8, the next frame (pos = accepted length) leaves each stage's
    cache equal to a fresh prefill of the accepted text plus the correction byte."""
    n, m, word = 8, 3, b"The game"

    async def run(addr, stages):  # type: ignore[no-untyped-def]
        async with PipelineClient(addr, timeout_s=30) as c:
            rid = c.new_id()
            params = {"pos": 0, "n_draft": n, "temperature": 1.0, "top_k": 0, "top_p": 1.0, "seed": 5}
            x = torch.tensor([list(word)], dtype=torch.uint8)
            reply = await c.call(Frame(FrameKind.SUBMIT, rid, Mode.SPEC, params=params, tensors={"x": x}))
            draft = reply.tensors["draft"][0].tolist()
            name = entry_name(stages[0], rid)  # the stages' caches key the request by the entry's name for it
            held = [s.server.span.cache.positions(name) for s in stages]
            correction = (draft[m] + 1) % 256  # the client rejected draft byte m and drew another byte
            params.update(pos=len(word) + m, n_draft=0)
            x = torch.tensor([[correction]], dtype=torch.uint8)
            await c.call(Frame(FrameKind.SUBMIT, rid, Mode.SPEC, params=params, tensors={"x": x}))
            return name, word + bytes(draft[:m]) + bytes([correction]), held

    with ring(spans(stack_run)) as stages:
        name, text, held = asyncio.run(run(stages[0].address, stages))
        entries = [cast(StackSpan, s.server.span).cache.peek(name) for s in stages]
        fresh = [CacheEntry(), CacheEntry()]
        first, last = spans(stack_run)
        with torch.inference_mode():
            h, _ = first.cached_step(fresh[0], torch.tensor([list(text)], dtype=torch.uint8), 0)
            last.cached_step(fresh[1], h, 0)
    assert held == [len(word) + n] * 2  # every drafted position was cached before the rollback
    for got, want in zip(entries, fresh, strict=True):
        assert got is not None and got.pos == want.pos == len(text) == len(word) + m + 1
        assert sorted(got.kv) == sorted(want.kv) and len(want.kv) >= 2
        for name, (k, v) in want.kv.items():
            assert got.kv[name][0].shape == k.shape == (1, 2, len(text), 16)
            assert torch.allclose(got.kv[name][0], k, atol=1e-5) and torch.allclose(got.kv[name][1], v, atol=1e-5)


def fixed_noise_greedy(cfg: RunConfig, blocks: list[BlockDenoiser], prompt: bytes, n: int, seed: int) -> bytes:
    """Local greedy AR generation with the diffusion chain, the noise a function of (seed, position in the window)
    only; each byte is read off the last ``context`` bytes, as ``generate`` reads it."""
    part = NoisePartition(cfg.diffusion, cfg.model.n_blocks)
    eps = position_noise(1, cfg.model.context, cfg.model.context, cfg.model.d_model,
                         torch.Generator().manual_seed(mix_seed(seed, 0)))  # (1, context, d)
    text = bytearray(prompt)
    with torch.inference_mode():
        for _ in range(n):
            x = torch.tensor([list(text[-cfg.model.context:])], dtype=torch.uint8)  # the window slides as generate's
            z = cfg.diffusion.sigma_max * eps[:, : x.shape[1]]
            for k, block in enumerate(blocks):
                z, logits = chain_step(block.eval(), k, x, z, part, cfg.diffusion, k == len(blocks) - 1)
            text.append(int(logits[0, -1].argmax()))
    return bytes(text[len(prompt):])


@pytest.mark.parametrize(("prompt", "draft"), [(b"The game", 1), (b"The game", 4), (b"The game", 16), (LONG_PROMPT, 4)])
def test_greedy_spec_on_diffusion_blocks_equals_local_greedy(prompt: bytes, draft: int) -> None:
    """Diffusion stages draft with block 0 alone; the verified text equals the chain's own greedy text, across
    window boundaries too (8 + 40 and 42 + 40 bytes against a context of 32)."""
    cfg, blocks, _ = tiny_models(seed=0)
    n, seed = 40, 7

    async def run(addr):  # type: ignore[no-untyped-def]
        async with PipelineClient(addr, timeout_s=30) as c:
            return await c.generate_spec(prompt, n, temperature=0.0, seed=seed, draft_min=draft, draft_max=draft)

    with ring(block_spans(cfg, blocks, SPANS)) as stages:
        res = asyncio.run(run(stages[0].address))
    assert res.data == fixed_noise_greedy(cfg, blocks, prompt, n, seed)
    assert len(res.data) == res.accepted + res.traversals and res.drafted >= res.accepted
    assert res.drafted >= res.traversals - 1  # every traversal but possibly the last drafts at least one byte


def test_diffusion_spec_drafts_with_block_zero_and_scores_every_draft_position() -> None:
    """One spec frame through a stage holding every diffusion block, against a local recomputation: q_i is block 0
    alone (its first chain evaluation, at sigma_max on the request's per-position noise) filtered at temperature 0.9,
    each draft byte is drawn from it, and logits row i is the whole chain's at the text plus draft bytes < i."""
    cfg, blocks, _ = tiny_models(seed=0)
    whole = block_spans(cfg, blocks, ((0, 3),))[0]
    prompt, n, seed, temp = list(b"The game"), 5, 11, 0.9
    frame = Frame(FrameKind.SUBMIT, "r", Mode.SPEC, params={"n_draft": n, "temperature": temp, "top_k": 0, "top_p": 1.0,
                                                            "seed": seed}, tensors={"x": torch.tensor([prompt], dtype=torch.uint8)})
    whole.validate(frame)
    (out,) = whole.run([frame])
    draft, q, logits = out.tensors["draft"][0].tolist(), out.tensors["q"], out.tensors["logits"]
    assert (out.kind, tuple(q.shape), tuple(logits.shape)) == (FrameKind.RESULT, (n, 256), (n + 1, 256))
    ctx, sigma_max = cfg.model.context, cfg.diffusion.sigma_max
    eps = position_noise(1, ctx, ctx, cfg.model.d_model, torch.Generator().manual_seed(mix_seed(seed, 0)))
    part = NoisePartition(cfg.diffusion, cfg.model.n_blocks)
    text = list(prompt)
    with torch.inference_mode():
        for i in range(n + 1):
            x, z = torch.tensor([text], dtype=torch.uint8), sigma_max * eps[:, : len(text)]
            if i < n:
                alone = blocks[0].eval()(x, z, torch.tensor(sigma_max))[0, -1]
                torch.testing.assert_close(q[i], filtered_probs(alone.unsqueeze(0), temp)[0], rtol=1e-5, atol=1e-6)
                assert q[i, draft[i]] > 0
            for k, block in enumerate(blocks):
                z, chain = chain_step(block.eval(), k, x, z, part, cfg.diffusion, k == len(blocks) - 1)
            torch.testing.assert_close(logits[i], chain[0, -1].float(), rtol=1e-4, atol=1e-4)
            if i < n:
                text.append(draft[i])
    assert len(set(draft)) > 1  # sampled at temperature 0.9 from an untrained block: not one repeated byte


def test_diffusion_spec_frame_validation() -> None:
    cfg, blocks, _ = tiny_models(seed=0)
    first, middle, _ = block_spans(cfg, blocks, SPANS)
    x = torch.zeros(1, 4, dtype=torch.uint8)
    with pytest.raises(WireError, match="context"):
        first.validate(Frame(FrameKind.SUBMIT, "r", Mode.SPEC, params={"n_draft": 29}, tensors={"x": x}))
    with pytest.raises(WireError, match="one sequence"):
        first.validate(Frame(FrameKind.SUBMIT, "r", Mode.SPEC, tensors={"x": torch.zeros(2, 4, dtype=torch.uint8)}))
    with pytest.raises(WireError, match="starts at block 0"):
        middle.validate(Frame(FrameKind.SUBMIT, "r", Mode.SPEC, 2, tensors={"x": x}))
    z = torch.zeros(1, 4, 32)
    with pytest.raises(WireError, match="carry 'draft'"):
        middle.validate(Frame(FrameKind.WORK, "r", Mode.SPEC, 2, params={"n_draft": 2}, tensors={"x": x, "z": z}))
    first.validate(Frame(FrameKind.SUBMIT, "r", Mode.SPEC, params={"n_draft": 28}, tensors={"x": x}))  # 4 + 28 = 32


def test_spec_frame_validation(stack_run: Path) -> None:
    first, last = spans(stack_run)
    x = torch.zeros(1, 4, dtype=torch.uint8)
    with pytest.raises(WireError, match="n_draft"):
        first.validate(Frame(FrameKind.SUBMIT, "r", Mode.SPEC, params={"n_draft": 65}, tensors={"x": x}))
    with pytest.raises(WireError, match="context"):
        first.validate(Frame(FrameKind.SUBMIT, "r", Mode.SPEC, params={"n_draft": 30}, tensors={"x": x}))
    with pytest.raises(WireError, match="top_p"):
        first.validate(Frame(FrameKind.SUBMIT, "r", Mode.SPEC, params={"top_p": 0.0}, tensors={"x": x}))
    h = torch.zeros(1, 6, 32)
    with pytest.raises(WireError, match="carry 'draft'"):
        last.validate(Frame(FrameKind.WORK, "r", Mode.SPEC, 2, params={"n_draft": 2}, tensors={"h": h}))
    assert isinstance(first, StackSpan)


def test_generate_remote_spec_and_streaming_ar(stack_run: Path) -> None:
    """`blocktrain generate --pipeline --mode spec` and PipelineClient.iter_ar (one byte per yield, top_p)."""
    model = local(stack_run)

    async def stream(addr):  # type: ignore[no-untyped-def]
        async with PipelineClient(addr, timeout_s=30) as c:
            plain = [b async for b in c.iter_ar(b"Sega", 6, temperature=0.7, top_k=20, seed=2)]
            nucleus = [b async for b in c.iter_ar(b"Sega", 6, temperature=0.7, top_k=0, seed=2, top_p=0.5)]
            return plain, nucleus

    with ring(spans(stack_run)) as stages:
        host, port = stages[0].address
        got = generate_remote(f"{host}:{port}", "spec", b"Sega", 10, temperature=0.0, top_k=0, seed=1, draft_min=2,
                              draft_max=4)
        assert got == generate(model, b"Sega", 10, temperature=0.0)
        plain, nucleus = asyncio.run(stream(stages[0].address))
    assert [len(b) for b in plain] == [1] * 6
    assert b"".join(plain) == generate(model, b"Sega", 6, temperature=0.7, top_k=20, seed=2)
    assert len(b"".join(nucleus)) == 6
    # the one sampler: local generate with top_p draws the bytes the remote ar draws
    assert b"".join(nucleus) == generate(model, b"Sega", 6, temperature=0.7, top_k=0, seed=2, top_p=0.5)


def test_bench_spec_row_helpers(stack_run: Path) -> None:
    """The bench client's spec task reports traversals; the summary turns them into the result JSON's spec keys."""
    task = spec_task(2, 8)
    assert draft_settings(task) == {"draft_min": 2, "draft_max": 8} and draft_settings({"mode": "ar"}) == {}

    async def run(addr):  # type: ignore[no-untyped-def]
        async with PipelineClient(addr, timeout_s=30) as c:
            return await timed_output(c, task, b"Sega", 12, 0, temperature=0.0, top_k=0)

    with ring(spans(stack_run)) as stages:
        text, traversals = asyncio.run(run(stages[0].address))
    assert text == generate(local(stack_run), b"Sega", 12, temperature=0.0) and traversals is not None
    assert 1 <= traversals <= 12
    row = spec_summary({"seconds": 2.0, "traversals": traversals, "stage_bytes_out": 5000}, 1.5, 8.0, 12)
    assert row == {"spec_seconds": 2.0, "spec_bytes_per_traversal": 12 / traversals, "spec_wire_bytes": 5000,
                   "spec_generative_ce": 1.5, "speedup_spec_vs_baseline": 4.0}
    md = spec_markdown({"output_bytes": 12, **row})
    assert len(md) == 1 and md[0].startswith("| stack spec") and "| 2.000 | 6.0 | 5,000 | 1.500 |" in md[0]
    assert spec_markdown({"output_bytes": 12}) == []


def test_spec_row_takes_only_a_run_whose_first_stage_drafts(stack_run: Path, tmp_path: Path) -> None:
    """The objective says whether its first block is a prefix of the composed model; the bench asks it."""
    check_stack_run(RunDir(stack_run))
    cfg = RunDir(stack_run).load_config()
    diffusion = RunDir(tmp_path / "diffusion")
    diffusion.init(dataclasses.replace(cfg, objective=Objective.DIFFUSION))
    with pytest.raises(BlockTrainError, match="no prefix of the composed model"):
        check_stack_run(diffusion)
    missing = RunDir(tmp_path / "untrained")
    missing.init(cfg)
    with pytest.raises(BlockTrainError, match="needs all 4 blocks"):
        check_stack_run(missing)


def test_spec_recovers_from_an_evicted_cache(stack_run: Path) -> None:
    """A last stage whose KV cap (1 byte) drops every cache after its frame: the client prefills again, same text."""
    first = spans(stack_run)[0]
    last = spans(stack_run, max_bytes=1)[1]
    prompt = b"The game began"

    async def run(addr):  # type: ignore[no-untyped-def]
        async with PipelineClient(addr, timeout_s=30) as c:
            spec = await c.generate_spec(prompt, 12, temperature=0.0, draft_min=3, draft_max=3)
            ar = await c.generate_ar(prompt, 6, temperature=0.8, top_k=40, seed=1)
            return spec, ar

    with ring([first, last]) as stages:
        spec, ar = asyncio.run(run(stages[0].address))
        evicted = cast(StackSpan, stages[1].server.span).cache.evictions
    model = local(stack_run)
    assert spec.data == generate(model, prompt, 12, temperature=0.0)
    assert ar == generate(model, prompt, 6, temperature=0.8, top_k=40, seed=1)
    assert evicted >= spec.traversals + 6  # every frame's cache was dropped at the last stage


def test_cli_serve_stack_run_and_generate_spec(stack_run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`blocktrain serve --run STACK --blocks 0-3` serves a stack span; `generate --mode spec` equals local greedy."""
    from tests.serve_utils import free_ports

    (port,) = free_ports(1)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    serve = spawn(["serve", "--run", str(stack_run), "--blocks", "0-3", "--listen", f"127.0.0.1:{port}", "--cache-mib",
                   "4", "--cache-ttl", "30"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)  # forked
    try:
        wait_port(port, serve)
        # the client runs in this process; the stage is the process under test
        assert main(["generate", "--pipeline", f"127.0.0.1:{port}", "--mode", "spec", "--bytes", "10", "--prompt", "Sega",
                     "--temperature", "0", "--draft-min", "2", "--draft-max", "4"]) == 0
        want = b"Sega" + generate(local(stack_run), b"Sega", 10, temperature=0.0) + b"\n"
        assert capsys.readouterr().out == want.decode("utf-8", errors="replace")
        assert main(["generate", "--pipeline", f"127.0.0.1:{port}", "--mode", "sweep", "--bytes", "4",
                     "--prompt", "Sega"]) != 0
        assert "sweep is a diffusion mode" in capsys.readouterr().err
    finally:
        serve.terminate()
        serve.wait(10)
