"""What the entry stage says about its pipeline, read once when a client connects (the PONG's description)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from blocktrain.serve.wire.frames import Mode, frame_param

LEGACY_FAMILIES = {"blocktrain": "diffusion"}  # family names stages once used -> today's


@dataclass(frozen=True)
class StageInfo:
    """The pipeline as its entry stage describes it (:meth:`blocktrain.serve.runtime.Span.describe`)."""

    family: str  # the run's kind, for display: diffusion, stack, e2e; "pipeline" when not reported
    n: int  # blocks (or layers) of the whole model; 0 when not reported
    d_model: int  # width of the hidden state a frame carries per position; 0 when not reported
    context: int  # bytes: the model's window; 0 when not reported
    modes: tuple[Mode, ...]  # the modes the pipeline runs, its default generation mode first (unknown names dropped)
    cached: bool  # stages keep each request's KV cache and frames carry ``pos``; False: each traversal sends the whole text
    state: str  # the entry stage's state: "serving" once it takes requests
    max_frame_bytes: int = 0  # bytes: the largest frame the entry stage reads (--max-frame-mib); 0 when not reported

    @classmethod
    def from_pong(cls, params: Mapping[str, Any]) -> StageInfo:
        """The description in a PONG's params; WireError naming a field of the wrong type."""
        p = dict(params)
        family = frame_param(p, "family", str, "pipeline")
        known = {m.value for m in Mode}
        return cls(family=LEGACY_FAMILIES.get(family, family), n=frame_param(p, "n", int, 0),
                   d_model=frame_param(p, "d_model", int, 0), context=frame_param(p, "context", int, 0),
                   modes=tuple(Mode(m) for m in frame_param(p, "modes", list, [])
                                 if isinstance(m, str) and m in known),
                   cached=frame_param(p, "cached", bool, False), state=frame_param(p, "state", str, ""),
                   max_frame_bytes=max(0, frame_param(p, "max_frame_bytes", int, 0)))

    def frame_cap(self, own: int) -> int:
        """Bytes: the largest frame both this client (``own``) and the entry stage take, which calls are sized by (a
        gateway sized them by its own 64 MiB where the stages ran --max-frame-mib 16, and every score call of more
        than one window was refused)."""
        return min(own, self.max_frame_bytes) if self.max_frame_bytes > 0 else own
