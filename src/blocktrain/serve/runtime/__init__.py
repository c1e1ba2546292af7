"""Model execution on a stage: what a stage computes, never the network.

A :class:`Span` holds a contiguous span of blocks (or of E2E layers) and turns
input frames into output frames. The run's objective names the span that
serves its blocks (``Objective.serving_span``); :mod:`~blocktrain.serve.runtime.loading`
builds it. Spans: :mod:`~blocktrain.serve.runtime.stack` (a stack run, KV-cached),
:mod:`~blocktrain.serve.runtime.diffusion` (the chain's blocks) and
:mod:`~blocktrain.serve.runtime.e2e` (the E2E baseline); per-request KV caches in
:mod:`~blocktrain.serve.runtime.kvcache`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from blocktrain.config import Precision
from blocktrain.device import CPU, autocast
from blocktrain.errors import WireError
from blocktrain.serve.wire.frames import Frame

MAX_ROWS_PER_FRAME = 64  # sequences per frame: bounds the (b, t, d_model) state a frame can make a stage allocate


def input_tensor(frame: Frame, key: str, d_model: int, where: str) -> torch.Tensor:
    """The frame's input tensor ``key``: bytes ``x`` (b, t) uint8, or ``h`` (b, t, d_model); 1 <= b <=
    MAX_ROWS_PER_FRAME and t >= 1, checked before any compute (WireError naming the stage ``where``)."""
    t = frame.tensors.get(key)
    ok = t is not None and t.dim() >= 2 and t.shape[0] >= 1 and t.shape[1] >= 1 and (
        (t.dim() == 2 and t.dtype == torch.uint8) if key == "x" else (t.dim() == 3 and t.shape[2] == d_model))
    if not ok or t is None:
        what = "uint8 bytes of shape (b, t)" if key == "x" else f"h of shape (b, t, {d_model})"
        raise WireError(f"frames {where} need tensor {key!r}: {what} with b, t >= 1")
    if t.shape[0] > MAX_ROWS_PER_FRAME:
        raise WireError(f"a frame holds at most {MAX_ROWS_PER_FRAME} sequences, got {t.shape[0]}; split the request")
    return t


def misrouted(what: str, lo: int, index: int) -> str:
    """The message refusing WORK for ``what`` ``index`` at a stage whose span starts at ``lo`` (a stack or E2E span
    runs every block or layer it holds, so the frame must start there: else a block would run twice, or never)."""
    return (f"spans overlap or leave a gap: this stage starts at {what} {lo} but was sent work for {what} {index}; "
            "check --blocks/--layers and --next of the stages before it")


@torch.inference_mode()
def on_device(frames: Sequence[Frame], device: torch.device, precision: Precision,
              run: Callable[[list[Frame]], list[Frame]]) -> list[Frame]:
    """Every span's ``run``: the frames' tensors move to ``device`` once, ``run`` computes there under autocast at
    ``precision``, and the answers move back to the host (the stage's wire)."""
    with autocast(precision, device):
        outs = run([f.to(device) for f in frames])
    return [o.to(CPU) for o in outs]


class Span(Protocol):
    """What one stage computes, as the stage server uses it."""

    lo: int  # first block (or layer) held
    hi: int  # last block (or layer) held
    precision: Precision  # arithmetic of run(), under blocktrain.device.autocast

    @property
    def is_last(self) -> bool:
        """Whether this span holds the model's last block (its frames leave as RESULTs)."""

    def describe(self) -> dict[str, Any]:
        """What the PONG reports: ``family`` (a display name), ``lo``, ``hi``, ``n``, ``context``, ``d_model``, and
        ``modes``, the modes the pipeline runs (the default generation mode first), and ``cached``, whether
        cached frames carry ``pos`` (stages keep each request's KV caches)."""

    def holds(self, index: int) -> bool:
        """Whether block (or layer) ``index`` runs here."""

    def validate(self, frame: Frame) -> None:
        """Raise WireError (UnknownRequestError for a lost cache) when this span cannot run ``frame``."""

    def batch_key(self, frame: Frame) -> tuple[Any, ...]:
        """Frames with equal keys may run together in one ``run``."""

    def run(self, frames: Sequence[Frame]) -> list[Frame]:
        """One output frame (WORK, RESULT or ERROR) per input frame."""

    def release(self, request_id: str, seq: int | None = None) -> bool:
        """Drop a request's caches, and keep none a step up to ``seq`` (the entry's newest when it was released)
        would store; whether there were any."""

    def expire_idle(self) -> int:
        """Drop caches idle past their timeout; how many."""

    def n_params(self) -> int:
        """Parameters held by this span."""
