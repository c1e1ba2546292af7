"""Fixes of the serving review: stale answers of retried steps, overlapping spans, unbounded sweeps, spec ``pos``."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import pytest
import torch

from blocktrain.config import Objective, RunConfig
from blocktrain.errors import ConfigError, WireError
from blocktrain.presets import tiny
from blocktrain.serve.client.decoding import Sampling
from blocktrain.serve.client.pipeline import PipelineClient
from blocktrain.serve.gateway import protocol
from blocktrain.serve.runtime import Span
from blocktrain.serve.runtime.kvcache import CacheEntry
from blocktrain.serve.runtime.loading import random_e2e_span, random_run_span
from blocktrain.serve.runtime.stack import StackSpan
from blocktrain.serve.stage.entry import Entry
from blocktrain.serve.stage.options import StageOptions
from blocktrain.serve.stage.server import StageThread
from blocktrain.serve.wire import limits
from blocktrain.serve.wire.frames import ErrorCode, Frame, FrameKind, Mode, UnknownRequestError
from tests.serve_utils import block_spans, free_ports, ring, tiny_models

STACK = replace(tiny(), objective=Objective.STACK)


def _bytes(text: bytes) -> torch.Tensor:
    return torch.tensor([list(text)], dtype=torch.uint8)


@contextmanager
def chain(spans: Sequence[Span], **opts: object) -> Iterator[list[StageThread]]:
    """Stages in a line on loopback: the last has no --next and answers the stage before it (not a ring)."""
    ports = free_ports(len(spans))
    stages: list[StageThread] = []
    try:
        for i, span in enumerate(spans):
            nxt = (("127.0.0.1", ports[i + 1]),) if i + 1 < len(spans) else ()
            stages.append(StageThread(span, "127.0.0.1", ports[i], StageOptions(next_stages=nxt, **opts)))  # type: ignore[arg-type]
        yield stages
    finally:
        for s in stages:
            s.stop()


# --- 1. a retried step's late RESULT never answers the next step -----------------------------------------------
def _two_stack_spans() -> list[Span]:
    return [random_run_span(STACK, 0, 1), random_run_span(STACK, 2, STACK.model.n_blocks - 1)]


def _reference_two_steps() -> tuple[torch.Tensor, torch.Tensor]:
    """The logits after b"hello" and after b"hello!", computed on the spans without a network."""
    a, b = (s for s in _two_stack_spans() if isinstance(s, StackSpan))
    with torch.inference_mode():
        ea, eb = CacheEntry(), CacheEntry()
        h, _ = a.cached_step(ea, _bytes(b"hello"), 0)
        _, first = b.cached_step(eb, h, 0)
        h, _ = a.cached_step(ea, _bytes(b"!"), 5)
        _, second = b.cached_step(eb, h, 5)
    assert first is not None and second is not None
    return first[0, -1], second[0, -1]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("layout", ["ring", "chain"])
def test_a_retried_steps_late_result_does_not_answer_the_next_step(layout: str) -> None:
    """AR on stack stages sends every step under one id. With links slower than the entry's deadline each step is
    retried; the first copy answered the step, and the retry's late RESULT was then delivered as the answer to the
    *next* step: the client got the first step's logits twice. The entry numbers each step (``seq``) and delivers
    only a RESULT of the step it waits for. The last stage answers through the entry (ring) or back along the line
    (chain): both paths of a RESULT into the entry."""
    want1, want2 = _reference_two_steps()

    async def run(addr: tuple[str, int]) -> tuple[torch.Tensor, torch.Tensor]:
        async with PipelineClient(addr, timeout_s=20) as c:
            rid = c.new_id()
            r1 = await c.call(Frame(FrameKind.SUBMIT, rid, Mode.AR, params={"pos": 0, "seed": 0},
                                    tensors={"x": _bytes(b"hello")}))
            r2 = await c.call(Frame(FrameKind.SUBMIT, rid, Mode.AR, params={"pos": 5, "seed": 0},
                                    tensors={"x": _bytes(b"!")}))
            assert "seq" not in r1.params and "seq" not in r2.params  # the entry's bookkeeping stays at the entry
            return r1.tensors["logits"][0], r2.tensors["logits"][0]

    # a one-way delay of 0.2 s per link: a ring's round trip (0.4 s) outlasts the 0.3 s deadline, so each step is
    # retried once and both copies come back; a chain's only delay is forward (0.2 s) plus the 0.15 s deadline
    delay, deadline = (0.2, 0.3) if layout == "ring" else (0.2, 0.15)
    pipeline = ring if layout == "ring" else chain
    logging.disable(logging.WARNING)  # the retries' warnings
    try:
        with pipeline(_two_stack_spans(), link_delay_s=delay, request_timeout_s=deadline, retries=4) as stages:
            got1, got2 = asyncio.run(run(stages[0].address))
    finally:
        logging.disable(logging.NOTSET)
    assert torch.allclose(got1, want1, atol=1e-4)
    assert not torch.allclose(got2, want1, atol=1e-4), "step 2 was answered with step 1's logits"
    assert torch.allclose(got2, want2, atol=1e-4)


class _Whole:
    """A span holding index 0 that takes any frame (the entry's bookkeeping alone)."""

    def holds(self, k: int) -> bool:
        return True

    def validate(self, frame: Frame) -> None:
        pass


class _Client:
    def __init__(self) -> None:
        self.got: list[Frame] = []

    async def send(self, frame: Frame) -> bool:
        self.got.append(frame)
        return True


def test_the_entry_drops_results_and_errors_of_an_earlier_step_of_the_same_request() -> None:
    """Unit view of the fix: a RESULT or ERROR answers a request only when it carries the ``seq`` of the step the
    entry waits for; the retry of a step keeps its number (either copy may answer it)."""
    async def run() -> list[Frame]:
        tasks: list[Any] = []
        entry = Entry(_Whole(), StageOptions(retries=1), "entry", lambda item: None, tasks.append)  # type: ignore[arg-type]
        client = _Client()

        async def submit(pos: int) -> tuple[str, int]:
            await entry.submit(Frame(FrameKind.SUBMIT, "r", Mode.AR, params={"pos": pos, "seq": 999},
                                     tensors={"x": _bytes(b"a")}), client)  # type: ignore[arg-type]
            (name,) = entry.pending
            return name, entry.pending[name].seq

        def result(name: str, seq: int, value: float) -> Frame:
            return Frame(FrameKind.RESULT, name, Mode.AR, params={"seq": seq}, tensors={"logits": torch.full((1, 4), value)})

        name, step1 = await submit(0)
        assert step1 != 999  # a client's seq is overwritten
        await entry.fail_or_retry(name, Frame(FrameKind.ERROR, name, code=ErrorCode.TIMEOUT, error="slow"), step1)
        assert entry.pending[name].seq == step1  # the retry keeps the step's number
        await entry.deliver(result(name, step1, 1.0))  # step 1 answered by one of its copies
        _, step2 = await submit(1)
        assert step2 > step1
        await entry.deliver(result(name, step1, 1.0))  # the other copy of step 1, late
        await entry.fail_or_retry(name, Frame(FrameKind.ERROR, name, code=ErrorCode.INTERNAL, error="old"), step1)
        await entry.fail_or_retry(name, Frame(FrameKind.ERROR, name, code=ErrorCode.INTERNAL, error="?"), None)
        assert entry.holds(name)  # neither stale answer touched step 2
        await entry.deliver(result(name, step2, 2.0))
        assert not entry.holds(name)
        entry.stop()
        for coro in tasks:
            await coro
        return client.got

    got = asyncio.run(run())
    assert [f.kind for f in got] == [FrameKind.RESULT, FrameKind.RESULT]
    assert [float(f.tensors["logits"][0, 0]) for f in got] == [1.0, 2.0]
    assert all(f.request_id == "r" and "seq" not in f.params for f in got)


def _cached_frame(span_lo: int, pos: int, seq: int, text: bytes) -> Frame:
    kind = FrameKind.SUBMIT if span_lo == 0 else FrameKind.WORK
    return Frame(kind, "req", Mode.AR, span_lo, {"pos": pos, "seed": 0, "seq": seq}, {"x": _bytes(text)})


@pytest.mark.parametrize("family", ["stack", "e2e"])
def test_a_stale_copy_of_an_earlier_step_cannot_rewind_a_kv_cache(family: str) -> None:
    """A retried step's late copy (or a link's resend) reaching a stage after the request's next step ran there
    truncated the cache back to its ``pos`` (a prefill's copy at pos 0 replaced it): the next step then failed, or
    ran on a cache the entry's own disagreed with. A cache now remembers the newest step (``seq``) that ran on it
    and refuses older ones, in ``validate`` and, for one that raced past it, in ``run``; copies of the same step
    still run."""
    if family == "stack":
        span: Any = random_run_span(STACK, 0, STACK.model.n_blocks - 1)
        mode = Mode.AR
    else:
        span = random_e2e_span(STACK, 0, STACK.model.n_layers - 1)
        mode = Mode.BASELINE

    def frame(pos: int, seq: int, text: bytes) -> Frame:
        return replace(_cached_frame(0, pos, seq, text), mode=mode)

    for f in (frame(0, 1, b"hello"), frame(0, 1, b"hello"), frame(5, 2, b"!")):  # step 1 twice (a retry), step 2
        span.validate(f)
        assert span.run([f])[0].kind is FrameKind.RESULT
    assert span.cache.positions("req") == 6
    for stale in (frame(0, 1, b"hello"), frame(5, 1, b"?")):
        with pytest.raises(UnknownRequestError, match="stale copy of an earlier step"):  # a StaleFrameError
            span.validate(stale)
        out = span.run([stale])[0]  # one that passed validate before step 2 ran
        assert out.kind is FrameKind.ERROR and out.code is ErrorCode.UNKNOWN_REQUEST, out
        assert span.cache.positions("req") == 6  # nothing rewound or replaced
    span.validate(frame(6, 3, b"?"))  # the request goes on
    assert span.run([frame(6, 3, b"?")])[0].kind is FrameKind.RESULT


# --- 2. overlapping spans are refused, not run twice ----------------------------------------------------------
@pytest.mark.timeout(60)
@pytest.mark.parametrize("family", ["stack", "e2e"])
def test_overlapping_spans_are_refused_as_misrouted(family: str) -> None:
    """Stages holding blocks (layers) 0-2 and 2-3: the second got WORK for index 3, which it holds, and ran index 2
    a second time, answering wrong logits silently. A stack or E2E span runs every block it holds, so it refuses
    WORK that does not start at its first one (MISROUTED, naming both indices)."""
    make = random_run_span if family == "stack" else random_e2e_span
    last = STACK.model.n_blocks - 1 if family == "stack" else STACK.model.n_layers - 1

    async def score(addr: tuple[str, int]) -> None:
        async with PipelineClient(addr, timeout_s=20) as c:
            await c.score(_bytes(b"hello world"))

    what = "block" if family == "stack" else "layer"
    with (ring([make(STACK, 0, 2), make(STACK, 2, last)]) as stages,
          pytest.raises(WireError, match=rf"misrouted.*starts at {what} 2 but was sent work for {what} 3")):
        asyncio.run(score(stages[0].address))


@pytest.mark.parametrize("family", ["stack", "e2e"])
def test_a_span_takes_work_only_at_its_first_index(family: str) -> None:
    span: Any = (random_run_span(STACK, 2, STACK.model.n_blocks - 1) if family == "stack"
                 else random_e2e_span(STACK, 2, STACK.model.n_layers - 1))
    h = torch.zeros(1, 4, STACK.model.d_model)
    mode = Mode.SCORE
    span.validate(Frame(FrameKind.WORK, "r", mode, 2, {}, {"h": h}))
    with pytest.raises(WireError, match="spans overlap or leave a gap"):
        span.validate(Frame(FrameKind.WORK, "r", mode, 3, {}, {"h": h}))


# --- 3. sweeps are bounded at the stages ---------------------------------------------------------------------
def _sweep_span() -> tuple[RunConfig, Any]:
    cfg, blocks, _ = tiny_models()
    return cfg, block_spans(cfg, blocks, [(0, cfg.model.n_blocks - 1)])[0]


def _sweep(sweeps: int, sweep_index: int = 0) -> Frame:
    params = {"seed": 0, "n_new": 4, "prompt_len": 4, "sweeps": sweeps, "sweep_index": sweep_index}
    return Frame(FrameKind.SUBMIT, "s", Mode.SWEEP, 0, params, {"x": _bytes(b"abcd")})


def test_a_diffusion_stage_refuses_more_sweeps_than_the_cap() -> None:
    """Only the gateway capped ``sweeps``: a frame asking for 10**15 looped through the pipeline until the entry's
    deadline, and its client got a TIMEOUT. The cap is the wire's (the gateway's is the same) and stages refuse more."""
    _, span = _sweep_span()
    cap = protocol.MAX_SWEEPS
    span.validate(_sweep(cap))
    for bad in (cap + 1, 10**15):
        with pytest.raises(WireError, match=f"'sweeps' must be at most {cap}"):
            span.validate(_sweep(bad))
    with pytest.raises(WireError, match="'sweep_index' must be below"):
        span.validate(_sweep(2, sweep_index=2))
    with pytest.raises(ConfigError, match=rf"sweeps must be in 1\.\.{cap}"):
        Sampling(sweeps=cap + 1)
    assert getattr(limits, "MAX_SWEEPS", None) is cap == 16  # one cap, the wire's: the gateway imports it


@pytest.mark.timeout(60)
def test_too_many_sweeps_are_a_bad_request_at_once() -> None:
    _, span = _sweep_span()

    async def run(addr: tuple[str, int]) -> None:
        async with PipelineClient(addr, timeout_s=20) as c:
            await c.call(_sweep(10**15))

    with ring([span], request_timeout_s=20) as stages:
        with pytest.raises(WireError, match=r"bad_request.*'sweeps' must be at most"):
            asyncio.run(run(stages[0].address))
        assert stages[0].server.counters.batches == 0


# --- 4. spec frames' pos at diffusion stages -----------------------------------------------------------------
def _spec(pos: Any, window: bool = False, n: int = 2) -> tuple[Any, Frame]:
    cfg, span = _sweep_span()
    c = cfg.model.context
    x = _bytes(bytes(range(65, 65 + c)) if window else b"abcd")
    params: dict[str, Any] = {"n_draft": n, "temperature": 0.0, "pos": pos}
    if window:
        params["window"] = True
    return span, Frame(FrameKind.SUBMIT, "r", Mode.SPEC, 0, params, {"x": x})


@pytest.mark.parametrize(("pos", "window", "match"), [
    ("x", False, "'pos' must be a int"),
    (1.5, False, "'pos' must be a int"),
    (True, True, "'pos' must be a int"),
    (10**30, True, "'pos' must be a 64-bit integer"),
    (-5, True, r"'pos' \(where the window starts in the text\) must be in 0\.\."),
    ((1 << 63) - 3, True, r"'pos' \(where the window starts in the text\) must be in 0\.\."),
    (-5, False, "'pos' must be 0 on diffusion stages"),
    (5, False, "'pos' must be 0 on diffusion stages"),
])
def test_a_diffusion_spec_frame_with_a_bad_pos_is_refused(pos: Any, window: bool, match: str) -> None:
    """Diffusion spec frames never validated ``pos``: 'x', 10**30 or 1.5 became INTERNAL errors in ``run``, and
    -5 (or any pos on an unwindowed frame, which carries the whole text) silently seeded another draft."""
    span, frame = _spec(pos, window)
    with pytest.raises(WireError, match=match):
        span.validate(frame)


@pytest.mark.parametrize(("pos", "window"), [(0, False), (0, True), (123, True)])
def test_a_diffusion_spec_frame_with_a_good_pos_runs(pos: int, window: bool) -> None:
    span, frame = _spec(pos, window)
    span.validate(frame)
    assert span.run([frame])[0].kind is FrameKind.RESULT
