"""What one stage of a ``stack`` run computes: blocks ``lo..hi`` passing the residual stream h.

Block 0 reads bytes, every later block reads h (b, t, d) from the block before
(:mod:`blocktrain.model.stack`); the last block's head turns h into logits.
The stack's layers are the same unconditioned :class:`TransformerLayer` as the
E2E model's; the blocks' own cached forward (``block(h, cache, pos)``) extends
each request's keys and values (:mod:`blocktrain.serve.runtime.kvcache`).

Modes:

* ``score``: teacher-forced logits (b, t, 256) at every position, one traversal,
  no cache; each block runs its own ``forward`` so the logits are those of
  :meth:`AssembledModel.log_probs` at the same precision.
* ``ar``: with ``pos`` in the params, x (or h) holds the positions ``pos..``
  of one sequence, the caches are truncated to ``pos`` and extended, and the
  result is the logits (1, 256) of the last position; without ``pos``, x (b, t)
  is run whole without a cache (the diffusion spans' stateless ``ar``).
* ``spec`` (:mod:`blocktrain.serve.wire.speculative`): the entry stage drafts
  ``n_draft`` bytes with its own prefix model (blocks 0..hi and block hi's head,
  KV-cached, no network), sampling each from q = filtered_probs(logits) with a
  generator seeded by (seed, accepted length); the accepted tail plus the draft
  then crosses the remaining stages once, and the last stage returns the raw
  logits (n_draft + 1, 256) at the positions that predict each draft byte and the
  bonus byte, with the draft and q carried along. The client runs the acceptance
  rule. The entry and the last stage also cache their head layers (the entry keeps
  them in step on every cached frame so that it can draft at any time).
  Once the text outgrew the context the frame is *windowed* (``window`` in the
  params): x is the text's last ``context`` bytes, no cache is used, and row i
  of the frame is the window of ``context`` bytes before draft byte i
  (:func:`~blocktrain.serve.wire.speculative.windows`), run whole as local
  ``generate`` runs it; the entry drafts each byte from its own run of that
  row, and the last stage returns each row's last logits (n_draft + 1, 256).
* ``sweep`` is refused: it is the diffusion objective's whole-continuation mode.

Arithmetic runs on the span's device under :func:`blocktrain.device.autocast` at the span's precision; the KV
caches stay on that device. A frame's tensors move to the device once, as ``run`` receives it, and the frames it
answers move back to the host; h crosses the wire in fp32.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from blocktrain.config import Precision, RunConfig
from blocktrain.device import CPU
from blocktrain.errors import WireError
from blocktrain.model.stack import StackBlock
from blocktrain.serve.runtime import input_tensor, misrouted, on_device
from blocktrain.serve.runtime.kvcache import CacheEntry, CacheOptions, KVCache
from blocktrain.serve.wire.frames import (
    ErrorCode,
    Frame,
    FrameKind,
    MisroutedError,
    Mode,
    UnknownRequestError,
    frame_param,
    frame_seq,
    step_seq,
)
from blocktrain.serve.wire.speculative import SpecParams, validate_carried_draft, windows


class StackSpan:
    """Blocks ``lo..hi`` of a stack run, with a KV cache per request id."""

    family = "stack"

    def __init__(
        self, blocks: dict[int, StackBlock], cfg: RunConfig, precision: Precision = Precision.FP32,
        cache: CacheOptions | None = None, device: torch.device = CPU,
    ) -> None:
        self.cfg = cfg
        self.lo, self.hi = min(blocks), max(blocks)
        if sorted(blocks) != list(range(self.lo, self.hi + 1)):
            raise ValueError(f"a stage holds a contiguous span of blocks, got {sorted(blocks)}")
        self.device = device
        self.blocks = {k: b.to(device).eval() for k, b in blocks.items()}
        self.n_last = cfg.model.n_blocks - 1
        self.precision = precision
        self.cache = KVCache(cache, name=f"stack[{self.lo}-{self.hi}]")

    def describe(self) -> dict[str, Any]:
        return {"family": self.family, "lo": self.lo, "hi": self.hi, "n": self.cfg.model.n_blocks,
                "context": self.cfg.model.context, "d_model": self.cfg.model.d_model,
                "modes": ["spec", "ar", "score"], "cached": True, "precision": self.precision.value, "device": str(self.device),
                "cached_requests": len(self.cache),
                "cache_evictions": self.cache.evictions}

    def holds(self, index: int) -> bool:
        return self.lo <= index <= self.hi

    @property
    def is_last(self) -> bool:
        return self.hi == self.n_last

    @property
    def runs_head(self) -> bool:
        """The last stage scores with its head; the entry drafts with block hi's head."""
        return self.is_last or self.lo == 0

    def release(self, request_id: str, seq: int | None = None) -> bool:
        return self.cache.release(request_id, seq)

    def expire_idle(self) -> int:
        return self.cache.expire_idle()

    def n_params(self) -> int:
        return sum(p.numel() for b in self.blocks.values() for p in b.parameters())

    def batch_key(self, frame: Frame) -> tuple[Any, ...]:
        return (self.family, frame.request_id)  # cached steps run one request at a time

    # --- validation ----------------------------------------------------------------
    def validate(self, frame: Frame) -> None:
        """Reject a frame this span cannot run (raises WireError with the reason)."""
        if frame.mode is Mode.SWEEP:
            raise WireError("sweep is a diffusion mode; this stage serves a stack run, which emits one byte per "
                            "traversal: use --mode ar or --mode spec")
        if frame.mode not in (Mode.SCORE, Mode.AR, Mode.SPEC):
            raise WireError(f"this stage serves a stack run; mode {frame.mode} is not one of score/ar/spec")
        if frame.kind is FrameKind.WORK and frame.sigma_index != self.lo:  # a stack span runs all its blocks
            raise MisroutedError(misrouted("block", self.lo, frame.sigma_index))
        t = input_tensor(frame, "x" if self.lo == 0 else "h", self.cfg.model.d_model, f"at block {self.lo}")
        frame_param(frame.params, "seed", int, 0)
        if frame.mode is Mode.SPEC and SpecParams.read(frame.params).window:
            self._validate_windows(frame, t)
            return
        cached = frame.mode is Mode.SPEC or "pos" in frame.params
        if not cached:
            if t.shape[1] > self.cfg.model.context:
                raise WireError(f"{t.shape[1]} positions exceed the model context of {self.cfg.model.context}")
            return
        pos = frame_param(frame.params, "pos", int, 0)
        n_draft = self._validate_spec(frame) if frame.mode is Mode.SPEC else 0
        if t.shape[0] != 1:
            raise WireError("KV-cached frames (ar with pos, spec) carry one sequence: shape (1, t, ...)")
        new = t.shape[1] + (n_draft if self.lo == 0 else 0)
        if pos < 0 or pos + new > self.cfg.model.context:
            raise WireError(f"positions {pos}..{pos + new - 1} exceed the context of {self.cfg.model.context}; "
                            "start a new request (pos=0) with a shorter text or draft")
        self.cache.check(frame.request_id, pos, seq=frame_seq(frame.params))

    def _validate_windows(self, frame: Frame, t: torch.Tensor) -> None:
        n, c = SpecParams.read(frame.params).n_draft, self.cfg.model.context
        if frame_param(frame.params, "pos", int, 0) < 0:
            raise WireError("parameter 'pos' (where the window starts in the text) must be >= 0")
        if self.lo == 0:
            if tuple(t.shape) != (1, c):
                raise WireError(f"a windowed spec frame carries the text's last {c} bytes (the context): x of shape "
                                f"(1, {c}), got {tuple(t.shape)}; send shorter texts without 'window'")
            return
        validate_carried_draft(frame.tensors, n)
        if t.shape[0] != n + 1 or t.shape[1] > c:
            raise WireError(f"a windowed spec frame past the entry carries h of its {n + 1} windows of at most {c} "
                            f"positions, got shape {tuple(t.shape)}")

    def _validate_spec(self, frame: Frame) -> int:
        n = SpecParams.read(frame.params).n_draft
        if self.lo > 0:
            validate_carried_draft(frame.tensors, n)
            h = frame.tensors.get("h")
            if n > 0 and h is not None and h.shape[1] <= n:
                raise WireError(f"'h' must cover the accepted tail and the {n} draft positions")
        return n

    # --- compute -------------------------------------------------------------------
    def run(self, frames: Sequence[Frame]) -> list[Frame]:
        return on_device(frames, self.device, self.precision, lambda fs: [self._run_one(f) for f in fs])

    def _run_one(self, f: Frame) -> Frame:
        if f.mode is Mode.SPEC and SpecParams.read(f.params).window:
            return self._run_windows(f)
        if f.mode is Mode.SCORE or (f.mode is Mode.AR and "pos" not in f.params):
            return self._run_stateless(f)
        pos = int(f.params.get("pos", 0))
        try:
            entry = self.cache.checkout(f.request_id, pos, step_seq(f))
        except UnknownRequestError as exc:  # evicted since validate() (or a newer step ran): the client prefills
            return f.reply_error(ErrorCode.UNKNOWN_REQUEST, str(exc))
        try:
            if self.lo == 0 and f.mode is Mode.SPEC:
                out = self._draft(f, entry, pos)
            else:
                inp = f.tensors["x"] if self.lo == 0 else f.tensors["h"].float()
                h, logits = self.cached_step(entry, inp, pos)
        except BaseException:
            self.cache.release(f.request_id)  # a half-extended cache is wrong: the request starts again at pos=0
            raise
        self.cache.put(f.request_id, entry)
        if self.lo == 0 and f.mode is Mode.SPEC:
            return out
        if not self.is_last:
            return self._work(f, h, {k: v for k, v in f.tensors.items() if k in ("draft", "q")})
        assert logits is not None
        n = int(f.params.get("n_draft", 0)) if f.mode is Mode.SPEC else 0
        return self._result(f, logits[0, -(n + 1):], f.tensors)

    def _run_stateless(self, f: Frame) -> Frame:
        h = self._forward(f.tensors["x" if self.lo == 0 else "h"])
        if not self.is_last:
            return self._work(f, h, {})
        logits = self.blocks[self.hi].logits(h).float()
        return Frame(FrameKind.RESULT, f.request_id, f.mode, 0, dict(f.params),
                     {"logits": logits if f.mode is Mode.SCORE else logits[:, -1]})

    def _forward(self, inp: torch.Tensor) -> torch.Tensor:
        """Bytes (block 0) or h through blocks lo..hi, whole, without a cache."""
        h = inp if self.lo == 0 else inp.float()
        for k in range(self.lo, self.hi + 1):
            h = self.blocks[k](h)
        return h

    def _run_windows(self, f: Frame) -> Frame:
        """A windowed spec frame: every row a whole window, no cache; the entry drafts row by row."""
        carried = {k: v for k, v in f.tensors.items() if k in ("draft", "q")}
        if self.lo > 0:
            h = self._forward(f.tensors["h"])
            if not self.is_last:
                return self._work(f, h, carried)
            return self._result(f, self.blocks[self.hi].logits(h)[:, -1], carried)
        sp = SpecParams.read(f.params)
        text, c = f.tensors["x"][0], self.cfg.model.context  # (c,) the text's last c bytes, on the device
        hs: list[torch.Tensor] = []  # row i: h (1, c, d) of windows(text, draft, c)[i]
        last: list[torch.Tensor] = []  # row i's logits (256,) at its last position

        def forward_row(draft: torch.Tensor) -> None:
            hs.append(self._forward(windows(text, draft, c)[-1:]))  # (1, c): the window before the next draft byte

        def row_logits(draft: torch.Tensor) -> torch.Tensor:
            forward_row(draft)
            last.append(self.blocks[self.hi].logits(hs[-1])[0, -1].float())
            return last[-1]

        draft, carried = sp.draft(int(f.params.get("pos", 0)) + c, row_logits, self.device)
        if self.is_last:  # one stage holds the whole model: the draft model is the target; row n gives the bonus
            row_logits(draft)
            return self._result(f, torch.stack(last), carried)
        forward_row(draft)  # row n, on to the next stage
        return self._work(f, torch.cat(hs, dim=0), carried)

    def _work(self, f: Frame, h: torch.Tensor, extra: dict[str, torch.Tensor]) -> Frame:
        return Frame(FrameKind.WORK, f.request_id, f.mode, self.hi + 1, dict(f.params), {"h": h.float(), **extra})

    def _result(self, f: Frame, logits: torch.Tensor, carried: dict[str, torch.Tensor]) -> Frame:
        tensors = {"logits": logits.float()}
        if f.mode is Mode.SPEC and int(f.params.get("n_draft", 0)) > 0:
            tensors.update(draft=carried["draft"], q=carried["q"])
        return Frame(FrameKind.RESULT, f.request_id, f.mode, 0, dict(f.params), tensors)

    def cached_step(self, entry: CacheEntry, inp: torch.Tensor, pos: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run bytes x (1, t) (block 0) or h (1, t, d) at positions pos.. through the span, extending ``entry``.

        Returns h (1, t, d) after block hi, and the head's logits (1, t, 256) where this stage runs a head.
        """
        h = inp
        for k in range(self.lo, self.hi + 1):
            h = self.blocks[k](h, cache=entry.kv, pos=pos)
        logits = self.blocks[self.hi].logits(h, cache=entry.kv).float() if self.runs_head else None
        entry.pos = pos + inp.shape[1]
        return h, logits

    def _draft(self, f: Frame, entry: CacheEntry, pos: int) -> Frame:
        """Entry stage of a spec frame: draft n bytes with blocks 0..hi and block hi's head, then pass it all on."""
        x = f.tensors["x"]
        sp = SpecParams.read(f.params)
        accepted_len = pos + x.shape[1]
        h, logits = self.cached_step(entry, x, pos)
        assert logits is not None
        hs, last = [h], [logits[0, -1]]  # h (1, t, d) per step; the logits (256,) after each step's last byte

        def step_on_last(draft: torch.Tensor) -> torch.Tensor:
            if len(draft):  # extend the cache by the byte drawn last, on the device
                nxt = draft[-1:].to(torch.uint8).unsqueeze(0)  # (1, 1)
                h, logits = self.cached_step(entry, nxt, accepted_len + len(draft) - 1)
                assert logits is not None
                hs.append(h)
                last.append(logits[0, -1])
            return last[-1]

        draft, carried = sp.draft(accepted_len, step_on_last, self.device)
        step_on_last(draft)  # the last draft byte's step: the logits of the bonus position
        if self.is_last:  # one stage holds the whole model: the draft model is the target
            return self._result(f, torch.stack(last), carried)
        return self._work(f, torch.cat(hs, dim=1), carried)
