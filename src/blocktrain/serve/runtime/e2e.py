"""What one stage of the E2E baseline computes: layers ``lo..hi`` of the E2E reference, KV-cached per request.

The first stage also holds the embeddings and the last one the head. Each
request keeps the keys and values of its positions in every layer of the
stage (the layers' own cached forward, :class:`~blocktrain.model.layers.TransformerLayer`),
so each new token costs one pass over the stage's layers.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from blocktrain.config import ModelConfig, Precision
from blocktrain.device import autocast
from blocktrain.errors import WireError
from blocktrain.model.layers import Cache, TransformerLayer
from blocktrain.serve.wire.frames import ErrorCode, Frame, FrameKind, Mode, UnknownRequestError, frame_param

log = logging.getLogger(__name__)


class E2ESpan:
    """Layers ``lo..hi`` of the E2E reference, with a KV cache per request id."""

    family = "e2e"

    def __init__(
        self,
        cfg: ModelConfig,
        layers: dict[int, TransformerLayer],
        embed: tuple[nn.Embedding, nn.Embedding] | None,
        head: tuple[nn.LayerNorm, nn.Linear] | None,
        max_cached: int = 64,
        cache_ttl_s: float = 600.0,
        precision: Precision = Precision.FP32,
    ) -> None:
        self.cfg = cfg
        self.precision = precision  # arithmetic of run(), under blocktrain.device.autocast
        self.lo, self.hi = min(layers), max(layers)
        self.layers = {i: m.eval() for i, m in layers.items()}
        self.embed = embed
        self.head = head
        if (self.lo == 0) != (embed is not None) or (self.hi == cfg.n_layers - 1) != (head is not None):
            raise ValueError("the first E2E stage holds the embeddings and the last one the head")
        self.max_cached = max_cached
        self.cache_ttl_s = cache_ttl_s
        # request id -> (positions cached, per-layer (k, v), last use)
        self.cache: OrderedDict[str, tuple[int, Cache, float]] = OrderedDict()

    def describe(self) -> dict[str, Any]:
        return {"family": self.family, "lo": self.lo, "hi": self.hi, "n": self.cfg.n_layers,
                "context": self.cfg.context, "d_model": self.cfg.d_model, "modes": ["baseline"], "cached": True}

    def holds(self, index: int) -> bool:
        return self.lo <= index <= self.hi

    @property
    def is_last(self) -> bool:
        return self.head is not None

    def release(self, request_id: str) -> bool:
        return self.cache.pop(request_id, None) is not None

    def expire_idle(self) -> int:
        n = len(self.cache)
        self._evict()
        return n - len(self.cache)

    def n_params(self) -> int:
        mods: list[nn.Module] = [*self.layers.values(), *(self.embed or ()), *(self.head or ())]
        return sum(p.numel() for m in mods for p in m.parameters())

    def batch_key(self, frame: Frame) -> tuple[Any, ...]:
        return (self.family, frame.request_id)  # KV-cached steps run one request at a time

    def validate(self, frame: Frame) -> None:
        if frame.mode is not Mode.BASELINE:
            raise WireError(f"this stage serves the E2E baseline; mode {frame.mode} is not 'baseline'")
        pos = frame_param(frame.params, "pos", int, 0)
        key = "x" if self.lo == 0 else "h"
        t = frame.tensors.get(key)
        if t is None or t.shape[0] != 1 or t.shape[1] < 1:
            raise WireError(f"baseline frames at layer {self.lo} need tensor {key!r} of shape (1, t, ...)")
        if pos < 0 or pos + t.shape[1] > self.cfg.context:
            raise WireError(
                f"positions {pos}..{pos + t.shape[1] - 1} exceed the context of {self.cfg.context}; "
                "start a new request with a shorter prompt"
            )
        if pos > 0:
            entry = self.cache.get(frame.request_id)
            if entry is None:
                raise UnknownRequestError(
                    f"request {frame.request_id} has no KV cache here (never prefilled, released or evicted); "
                    "start it again with pos=0"
                )
            if entry[0] != pos:
                raise WireError(f"request {frame.request_id} has {entry[0]} cached positions, the frame says pos={pos}")

    def _evict(self) -> None:
        now = time.monotonic()
        for rid in [r for r, (_, _, used) in self.cache.items() if now - used > self.cache_ttl_s]:
            del self.cache[rid]
        while len(self.cache) > self.max_cached:
            rid, _ = self.cache.popitem(last=False)
            log.warning("KV cache full (%d requests): dropped the least recently used request %s", self.max_cached, rid)

    @torch.inference_mode()
    def run(self, frames: Sequence[Frame]) -> list[Frame]:
        with autocast(self.precision, torch.device("cpu")):
            return [self._run_one(f) for f in frames]

    def _run_one(self, f: Frame) -> Frame:
        pos = int(f.params.get("pos", 0))
        cached = None if pos == 0 else self.cache.get(f.request_id)
        if pos > 0 and (cached is None or cached[0] != pos):  # evicted since validate(): the client prefills again
            return f.reply_error(ErrorCode.UNKNOWN_REQUEST, f"request {f.request_id} lost its KV cache here (evicted); "
                                                            "start it again with pos=0")
        kv: Cache = {} if cached is None else dict(cached[1])
        if self.embed is not None:
            x = f.tensors["x"].long()
            tok, posemb = self.embed
            h = tok(x) + posemb(torch.arange(pos, pos + x.shape[1]))
        else:
            h = f.tensors["h"].float()
        for i in range(self.lo, self.hi + 1):
            h = self.layers[i](h, cache=kv, name=str(i))
        self.cache[f.request_id] = (pos + h.shape[1], kv, time.monotonic())
        self.cache.move_to_end(f.request_id)
        self._evict()
        if self.head is None:
            return Frame(FrameKind.WORK, f.request_id, f.mode, self.hi + 1, dict(f.params), {"h": h})
        ln_f, lin = self.head
        return Frame(FrameKind.RESULT, f.request_id, f.mode, 0, dict(f.params), {"logits": lin(ln_f(h[:, -1])).float()})
