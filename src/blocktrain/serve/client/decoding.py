"""Client-side decoding loops over a pipeline (ar and baseline byte at a time, spec, sweep) and :func:`decode`,
the one place a generation mode becomes its loop.

The loops ask of a pipeline connection only what :class:`Traversal` names (the entry stage's
:class:`~blocktrain.serve.client.stage_info.StageInfo`, request ids, one frame out and its answer back, a
RELEASE); :class:`~blocktrain.serve.client.pipeline.PipelineClient` is one.

Where the speculative loop runs: in the *client*. Each traversal is one SPEC
frame sent to the entry stage with params ``pos`` (positions every stage may
keep cached: the text accepted so far, minus its last byte(s) not yet fed),
``n_draft``, ``temperature``, ``top_k``, ``top_p`` and ``seed``, and tensor
``x`` (1, t), the accepted bytes from ``pos`` on. The entry stage truncates its
cache to ``pos`` (rollback), drafts ``n_draft`` bytes locally with its prefix
model, and sends h for the tail plus the draft down the pipeline in ONE
traversal; every later stage truncates to ``pos`` and appends; the last stage
returns the raw logits (n_draft + 1, 256) with the draft and its q. The client
filters the logits into p and applies the speculative-sampling rule
(:func:`blocktrain.serve.wire.speculative.accept_draft`), appends the kept draft
prefix and the correction (or bonus) byte, and sets ``pos`` of the next frame
to the accepted length before that byte: positions of rejected draft bytes
are overwritten by the next frame. The draft length follows the running
acceptance rate within ``draft_min..draft_max``
(:func:`~blocktrain.serve.wire.speculative.next_draft_len`), and never runs past the
requested bytes or the model context. A RELEASE frame drops the caches at the end.
Diffusion stages keep no cache: there ``pos`` is always 0 and ``x`` the whole
accepted text, and the entry stage drafts with block 0 alone
(:meth:`blocktrain.serve.runtime.diffusion.BlockSpan._run_spec`).

Every mode slides its window as :func:`blocktrain.evaluate.generate.generate` does: each byte is read off
the last ``context`` bytes before it. KV-cached ``ar`` and ``baseline`` prefill the last ``context`` bytes
afresh for each byte once the text is longer than the context (a KV cache cannot be shifted exactly: the
positions are learned absolute embeddings, and each cached key depends on bytes the window drops). ``spec``
drafts no further than the context's end while the text fits it; once the text fills it, each frame is
*windowed*: it carries the text's last ``context`` bytes, and every stage runs row i, the window before draft
byte i, whole and without a cache (:func:`~blocktrain.serve.wire.speculative.windows`), so each byte is
still verified on exactly the window ``generate`` reads, n_draft + 1 windows in one traversal.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from blocktrain.config import VOCAB_SIZE
from blocktrain.errors import ConfigError, ServeError, WireError
from blocktrain.sampling import EMPTY_PROMPT, filtered_probs, sample_byte
from blocktrain.seeds import Seed
from blocktrain.serve.client.stage_info import StageInfo
from blocktrain.serve.wire.frames import Frame, FrameKind, Mode, UnknownRequestError
from blocktrain.serve.wire.limits import MAX_SWEEPS
from blocktrain.serve.wire.modes import GENERATION_MODES, MODE_RULES, modes_taking
from blocktrain.serve.wire.speculative import accept_draft, next_draft_len, update_rate, windowed_draft_cap

log = logging.getLogger(__name__)

INITIAL_RATE = 0.75  # acceptance rate assumed before the first traversal (first draft: 4 bytes)


class Traversal(Protocol):
    """What the decoding loops ask of a connection to a pipeline's entry stage."""

    @property
    def stage(self) -> StageInfo:
        """The entry stage's description, read when the connection opened."""

    @property
    def max_frame_bytes(self) -> int:
        """Bytes: the largest frame the connection carries."""

    def new_id(self) -> str:
        """A request id not used before on this connection."""

    async def call(self, frame: Frame) -> Frame:
        """Send one frame and return the frame answering its id; ServeError on an ERROR answer."""

    async def release(self, request_id: str, mode: Mode) -> None:
        """Ask the stages to drop a request's KV caches (best effort)."""


@dataclass(frozen=True)
class Sampling:
    """How one generation samples, in any mode; a mode's loop reads the settings it takes (:data:`MODE_RULES`)."""

    temperature: float = 0.8  # softmax temperature (0 = greedy); in spec, of both p and q
    top_k: int = 40  # sample among the k most likely bytes (0 = all)
    top_p: float = 1.0  # nucleus mass kept (1 = all); < 1 only in the modes whose rules take top_p
    seed: int = 0  # seeds every draw of the generation (per byte, per draft, per acceptance)
    sweeps: int = 1  # mode sweep: traversals per continuation
    draft_min: int = 1  # mode spec: bytes, the shortest draft
    draft_max: int = 16  # mode spec: bytes, the longest draft

    def __post_init__(self) -> None:
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ConfigError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if self.top_k < 0:
            raise ConfigError(f"top_k must be >= 0 (0 = all bytes), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not 1 <= self.sweeps <= MAX_SWEEPS:  # stages refuse more
            raise ConfigError(f"sweeps must be in 1..{MAX_SWEEPS}, got {self.sweeps}; set --sweeps")
        if not 1 <= self.draft_min <= self.draft_max:
            raise ConfigError(f"need 1 <= draft_min <= draft_max, got {self.draft_min} and {self.draft_max}; "
                              "set --draft-min/--draft-max")


@dataclass
class SpecResult:
    """A speculative generation and what it cost."""

    data: bytes  # the generated bytes (prompt excluded)
    traversals: int = 0  # SPEC frames sent (pipeline traversals)
    drafted: int = 0  # draft bytes proposed by the entry stage
    accepted: int = 0  # draft bytes kept by the acceptance rule
    seconds: float = 0.0  # wall time of the generation


def runnable_modes(stage: StageInfo) -> tuple[Mode, ...]:
    """The generation modes :func:`decode` runs on the pipeline ``stage`` describes, its default first: those the
    entry stage reports, and ar where it reports the baseline but no ar (decode runs ar as the baseline there)."""
    modes = tuple(m for m in stage.modes if m in GENERATION_MODES)
    return (*modes, Mode.AR) if Mode.BASELINE in modes and Mode.AR not in modes else modes


def decode(mode: Mode, t: Traversal, prompt: bytes, n_new: int, sampling: Sampling,
           stats: SpecResult | None = None) -> AsyncIterator[bytes]:
    """The ``n_new`` bytes after ``prompt`` in ``mode``, as chunks of new bytes as the pipeline produces them: a byte
    per chunk in ar and baseline, the bytes a traversal accepts in spec (counted in ``stats``), one chunk in sweep.

    ServeError for a mode that is not a generation mode, or top_p < 1 in a mode that samples without it."""
    if mode not in MODE_RULES:
        raise ServeError(f"unknown serving mode {mode.value!r}; use one of {', '.join(m.value for m in GENERATION_MODES)}")
    if sampling.top_p < 1 and not MODE_RULES[mode].top_p:
        raise ServeError(f"top_p < 1 is sampled by modes {modes_taking('top_p')}, not {mode.value}")
    if mode is Mode.SPEC:
        return spec_steps(t, prompt, n_new, sampling, stats or SpecResult(b""))
    if mode is Mode.SWEEP:
        return sweep_steps(t, prompt, n_new, sampling)
    if mode is Mode.AR and Mode.AR not in t.stage.modes:
        mode = Mode.BASELINE  # an E2E pipeline runs ar as its baseline
    return ar_steps(t, prompt, n_new, sampling, mode)


async def call_cached(t: Traversal, rid: str, mode: Mode, params: dict[str, Any], text: bytes, pos: int) -> Frame:
    """Send text[pos:] at ``pos``; when a stage lost the request's cache (evicted, restarted), prefill text afresh."""
    def frame(p: int) -> Frame:
        return Frame(FrameKind.SUBMIT, rid, mode, params={**params, "pos": p},
                     tensors={"x": torch.tensor([list(text[p:])], dtype=torch.uint8)})

    try:
        return await t.call(frame(pos))
    except UnknownRequestError as exc:
        if pos == 0:
            raise
        log.warning("request %s: %s; prefilling its %d bytes again", rid, exc, len(text))
        return await t.call(frame(0))


BYTE_TENSORS = ("draft", "bytes")  # answers holding byte ids (0..255); every other answer holds finite floats


def answered(reply: Frame, name: str, shape: tuple[int | None, ...]) -> torch.Tensor:
    """The tensor ``name`` of a pipeline's answer, of ``shape`` (None: any size there), byte ids in 0..255 for the
    names in :data:`BYTE_TENSORS` and finite floats for the others; a WireError (the request's 502) where the stage,
    run by someone else, sent none, another shape or other values (NaN logits were a sampler's RuntimeError, a 500,
    or a score's JSON null; a byte id past 255 an IndexError), not an error later."""
    got = reply.tensors.get(name)
    if got is None or got.ndim != len(shape) or any(w is not None and w != n for w, n in zip(shape, got.shape, strict=True)):
        have = "none" if got is None else f"shape {tuple(got.shape)}"
        want = "(" + ", ".join("*" if w is None else str(w) for w in shape) + ")"
        raise WireError(f"the pipeline answered request {reply.request_id} with {have} for {name!r}, expected {want}; "
                        "a stage runs another version or is faulty")
    if name in BYTE_TENSORS:
        ids = got.to(torch.int64) if not (got.is_floating_point() or got.is_complex()) else None  # no uint8 wrap
        bad = ids is None or bool(((ids < 0) | (ids >= VOCAB_SIZE)).any())
        want_values = "byte ids in 0..255"
    else:
        bad = not got.is_floating_point() or not bool(torch.isfinite(got).all())
        want_values = "finite floats"
    if bad:
        raise WireError(f"the pipeline answered request {reply.request_id} with {name!r} of {got.dtype} holding values "
                        f"other than {want_values}; a stage is faulty or its arithmetic overflowed (try --precision fp32)")
    return got


async def ar_logits(t: Traversal, x: torch.Tensor, seed: int) -> torch.Tensor:
    """Logits (b, 256) of the byte after x (b, t) on stateless stages: one traversal, B block steps."""
    f = Frame(FrameKind.SUBMIT, t.new_id(), Mode.AR, params={"seed": seed}, tensors={"x": x.to(torch.uint8)})
    return answered(await t.call(f), "logits", (x.shape[0], VOCAB_SIZE))


async def ar_steps(t: Traversal, prompt: bytes, n_new: int, s: Sampling, mode: Mode) -> AsyncIterator[bytes]:
    """One byte per traversal, yielded as it comes; the same bytes as ``generate(local model, ...)`` (top_p 1).

    ``mode`` BASELINE (the E2E baseline) prefills the prompt, then runs one KV-cached step per byte, as AR does on
    cached stages; both slide their window as ``generate`` does."""
    context = t.stage.context
    out = bytearray(prompt or EMPTY_PROMPT)
    g = Seed.SAMPLER.generator(s.seed)
    if mode is Mode.AR and not t.stage.cached:  # stateless stages (diffusion blocks): the whole window
        for i in range(n_new):
            ctx = torch.tensor(list(out[-context:]), dtype=torch.uint8).unsqueeze(0)
            logits = await ar_logits(t, ctx, seed=Seed.BYTE.derive(s.seed, i))
            out.append(sample_byte(logits[0], s.temperature, s.top_k, s.top_p, g))
            yield bytes(out[-1:])
        return
    rid, cached = t.new_id(), 0
    try:
        for i in range(n_new):
            window = bytes(out[-context:])  # the whole text until it outgrows the context, then a fresh prefill
            pos = cached if len(out) <= context else 0
            params = {"seed": Seed.BYTE.derive(s.seed, i)} if mode is Mode.AR else {}
            logits = answered(await call_cached(t, rid, mode, params, window, pos), "logits", (1, VOCAB_SIZE))
            cached = len(window)
            out.append(sample_byte(logits[0], s.temperature, s.top_k, s.top_p, g))
            yield bytes(out[-1:])
    finally:
        await t.release(rid, mode)


async def sweep_steps(t: Traversal, prompt: bytes, n_new: int, s: Sampling) -> AsyncIterator[bytes]:
    """A whole n_new-byte continuation from one traversal (per sweep), as one chunk."""
    context = t.stage.context or len(prompt) + n_new
    if n_new < 1 or n_new >= context:
        raise ServeError(f"sweep needs 1 <= bytes < context ({context}), got {n_new}")
    p = (prompt or EMPTY_PROMPT)[-(context - n_new) :]
    params = {"seed": s.seed, "n_new": n_new, "prompt_len": len(p), "sweeps": s.sweeps,
              "temperature": float(s.temperature), "top_k": int(s.top_k)}
    x = torch.tensor(list(p), dtype=torch.uint8).unsqueeze(0)
    reply = await t.call(Frame(FrameKind.SUBMIT, t.new_id(), Mode.SWEEP, params=params, tensors={"x": x}))
    yield bytes(answered(reply, "bytes", (1, n_new))[0].tolist())


async def spec_steps(t: Traversal, prompt: bytes, n_new: int, opts: Sampling, stats: SpecResult) -> AsyncIterator[bytes]:
    """Speculative decoding over the pipeline: yields the bytes each traversal adds, updating ``stats``."""
    if Mode.SPEC not in t.stage.modes:
        raise ServeError(f"spec needs a pipeline whose entry stage drafts with its first blocks; this one serves "
                         f"{t.stage.family!r} (modes {', '.join(m.value for m in t.stage.modes)}): "
                         "use --mode baseline")
    stateless = not t.stage.cached  # stages keep no cache: every traversal sends the whole text
    context = t.stage.context
    if n_new < 0 or context < 1:
        raise ServeError(f"spec generates 0 or more bytes on a model with a context, got {n_new} (context {context})")
    windowed_cap = windowed_draft_cap(context, t.stage.d_model, t.stage.frame_cap(t.max_frame_bytes))
    text = bytearray(prompt or EMPTY_PROMPT)
    start, cached, rate = len(text), 0, INITIAL_RATE
    g = Seed.SAMPLER.generator(opts.seed)
    rid = t.new_id()
    t0 = time.perf_counter()
    try:
        while (done := len(text) - start) < n_new:
            remaining = n_new - done
            windowed = len(text) >= context  # every byte from here on is read off a window the text fills
            room = windowed_cap if windowed else context - len(text)  # in one window: draft up to its end
            n = max(0, min(next_draft_len(rate, opts.draft_min, opts.draft_max), remaining - 1, room))
            params: dict[str, Any] = {"n_draft": n, "temperature": float(opts.temperature), "top_k": opts.top_k,
                      "top_p": float(opts.top_p), "seed": opts.seed}
            if windowed:
                params.update(window=True, pos=len(text) - context)
                x = torch.tensor([list(text[-context:])], dtype=torch.uint8)
                reply = await t.call(Frame(FrameKind.SUBMIT, rid, Mode.SPEC, params=params, tensors={"x": x}))
            else:
                reply = await call_cached(t, rid, Mode.SPEC, params, bytes(text), cached)
            p = filtered_probs(answered(reply, "logits", (n + 1, VOCAB_SIZE)), opts.temperature, opts.top_k,
                               opts.top_p)  # (n + 1, 256)
            draft = answered(reply, "draft", (1, n))[0].tolist() if n else []
            q = answered(reply, "q", (n, VOCAB_SIZE)).float() if n else torch.empty(0, p.shape[-1])  # (n, 256)
            verdict = accept_draft(draft, p, q, g)
            new = bytes(verdict.emitted(draft)[:remaining])
            cached = 0 if stateless else len(text) + verdict.accepted  # text + kept draft are cached right; the next byte is not
            text += new
            rate = update_rate(rate, verdict.accepted, n)
            stats.traversals += 1
            stats.drafted += n
            stats.accepted += verdict.accepted
            stats.data += new
            stats.seconds = time.perf_counter() - t0
            yield new
    finally:
        if not stateless:  # diffusion stages hold nothing to release
            await t.release(rid, Mode.SPEC)
