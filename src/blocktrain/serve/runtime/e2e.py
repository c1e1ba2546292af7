"""What one stage of the E2E baseline computes: layers ``lo..hi`` of the E2E reference, KV-cached per request.

The first stage also holds the embeddings and the last one the head. Each
request keeps the keys and values of its positions in every layer of the
stage (the layers' own cached forward, :class:`~blocktrain.model.layers.TransformerLayer`),
so each new token costs one pass over the stage's layers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from blocktrain.config import ModelConfig, Precision
from blocktrain.device import CPU
from blocktrain.errors import WireError
from blocktrain.model.layers import TransformerLayer
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


class E2ESpan:
    """Layers ``lo..hi`` of the E2E reference, with a KV cache per request id."""

    family = "e2e"

    def __init__(
        self,
        cfg: ModelConfig,
        layers: dict[int, TransformerLayer],
        embed: tuple[nn.Embedding, nn.Embedding] | None,
        head: tuple[nn.LayerNorm, nn.Linear] | None,
        precision: Precision = Precision.FP32,
        device: torch.device = CPU,
        cache: CacheOptions | None = None,
    ) -> None:
        self.cfg = cfg
        self.precision = precision  # arithmetic of run(), under blocktrain.device.autocast
        self.device = device  # where the layers, the KV caches and run() live; frames arrive and leave on the host
        self.lo, self.hi = min(layers), max(layers)
        self.layers = {i: m.to(device).eval() for i, m in layers.items()}
        self.embed = None if embed is None else (embed[0].to(device), embed[1].to(device))
        self.head = None if head is None else (head[0].to(device), head[1].to(device))
        if (self.lo == 0) != (embed is not None) or (self.hi == cfg.n_layers - 1) != (head is not None):
            raise ValueError("the first E2E stage holds the embeddings and the last one the head")
        # the stage's --cache-* flags (requests, idle seconds, bytes), as for a BlockTrain span
        self.cache = KVCache(cache or CacheOptions(), name=f"e2e[{self.lo}-{self.hi}]")

    def describe(self) -> dict[str, Any]:
        return {"family": self.family, "lo": self.lo, "hi": self.hi, "n": self.cfg.n_layers,
                "context": self.cfg.context, "d_model": self.cfg.d_model, "modes": ["baseline", "score"], "cached": True,
                "device": str(self.device)}

    def holds(self, index: int) -> bool:
        return self.lo <= index <= self.hi

    @property
    def is_last(self) -> bool:
        return self.head is not None

    def release(self, request_id: str, seq: int | None = None) -> bool:
        return self.cache.release(request_id, seq)

    def expire_idle(self) -> int:
        return self.cache.expire_idle()

    def n_params(self) -> int:
        mods: list[nn.Module] = [*self.layers.values(), *(self.embed or ()), *(self.head or ())]
        return sum(p.numel() for m in mods for p in m.parameters())

    def batch_key(self, frame: Frame) -> tuple[Any, ...]:
        return (self.family, frame.request_id)  # KV-cached steps run one request at a time

    def validate(self, frame: Frame) -> None:
        """Reject a frame this span cannot run (raises WireError with the reason)."""
        if frame.mode not in (Mode.SCORE, Mode.BASELINE):
            raise WireError(f"this stage serves the E2E baseline; mode {frame.mode} is not 'baseline' or 'score'")
        if frame.kind is FrameKind.WORK and frame.sigma_index != self.lo:  # an E2E span runs all its layers
            raise MisroutedError(misrouted("layer", self.lo, frame.sigma_index))
        t = input_tensor(frame, "x" if self.lo == 0 else "h", self.cfg.d_model, f"at layer {self.lo}")
        if frame.mode is Mode.SCORE:  # teacher-forced windows (b, t), no cache: an evaluation harness's requests
            if t.shape[1] > self.cfg.context:
                raise WireError(f"{t.shape[1]} positions exceed the model context of {self.cfg.context}")
            return
        pos = frame_param(frame.params, "pos", int, 0)
        if t.shape[0] != 1:
            raise WireError("baseline frames are KV-cached and carry one sequence: shape (1, t, ...)")
        if pos < 0 or pos + t.shape[1] > self.cfg.context:
            raise WireError(
                f"positions {pos}..{pos + t.shape[1] - 1} exceed the context of {self.cfg.context}; "
                "start a new request with a shorter prompt"
            )
        self.cache.check(frame.request_id, pos, exact=True, seq=frame_seq(frame.params))

    def run(self, frames: Sequence[Frame]) -> list[Frame]:
        return on_device(frames, self.device, self.precision, lambda fs: [self._run_one(f) for f in fs])

    def _run_one(self, f: Frame) -> Frame:
        if f.mode is Mode.SCORE:
            return self._score(f)
        pos = int(f.params.get("pos", 0))
        try:
            entry = self.cache.checkout(f.request_id, pos, step_seq(f))
        except UnknownRequestError as exc:  # evicted since validate() (or a newer step ran): the client prefills
            return f.reply_error(ErrorCode.UNKNOWN_REQUEST, str(exc))
        kv = dict(entry.kv)  # a copy: a failed step leaves the cache as it was
        h = self._input(f, pos)
        for i in range(self.lo, self.hi + 1):
            h = self.layers[i](h, cache=kv, name=str(i))
        self.cache.put(f.request_id, CacheEntry(pos + h.shape[1], kv, epoch=entry.epoch, seq=entry.seq))
        return self._output(f, h, h[:, -1])

    def _score(self, f: Frame) -> Frame:
        """Whole windows through layers lo..hi without a cache; the last stage answers every position's logits."""
        h = self._input(f, 0)
        for i in range(self.lo, self.hi + 1):
            h = self.layers[i](h)
        return self._output(f, h, h)

    def _input(self, f: Frame, pos: int) -> torch.Tensor:
        """h (b, t, d) entering layer lo: the embeddings of bytes x (b, t) at positions pos.., or the h received."""
        if self.embed is None:
            return f.tensors["h"].float()
        x = f.tensors["x"].long()
        tok, posemb = self.embed
        return tok(x) + posemb(torch.arange(pos, pos + x.shape[1], device=x.device))

    def _output(self, f: Frame, h: torch.Tensor, scored: torch.Tensor) -> Frame:
        """WORK carrying h to the next stage, or (the last stage) RESULT with the logits of the ``scored`` part of h."""
        if self.head is None:
            return Frame(FrameKind.WORK, f.request_id, f.mode, self.hi + 1, dict(f.params), {"h": h})
        ln_f, lin = self.head
        return Frame(FrameKind.RESULT, f.request_id, f.mode, 0, dict(f.params), {"logits": lin(ln_f(scored)).float()})
