"""Per-request KV caches of a stage, with rollback and eviction.

A cached request holds, for every attention layer a stage runs, the keys and
values (b, heads, t, d_head) of the positions 0..t-1 it has seen. A frame
carries ``pos``, the number of positions its sender knows to be right; the
stage first truncates the request's cache to ``pos`` (the rollback over
rejected speculative positions, or over a retried frame) and then appends the
frame's new positions.

A frame also carries ``seq``, the entry's number of the step it belongs to
(:func:`~blocktrain.serve.wire.frames.step_seq`); each cache remembers the
newest step that ran on it and refuses an older one
(:class:`~blocktrain.serve.wire.frames.StaleFrameError`): a retried step's late
copy, or a link's resend, arriving after the request's next step would otherwise
rewind (or, at pos 0, replace) the cache that step built. Copies of the same step
run again (the same positions, the same bytes: the same cache).

Caches are dropped on RELEASE (the request finished), after ``ttl_s`` without
use, beyond ``max_requests`` requests (least recently used first) and beyond
``max_bytes`` bytes of keys and values over all requests (least recently used
first, the request just served last); each eviction logs a line.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from blocktrain.errors import ConfigError, WireError
from blocktrain.model.layers import Cache
from blocktrain.serve.wire.frames import StaleFrameError, UnknownRequestError

log = logging.getLogger(__name__)


RELEASES_KEPT = 4096  # request ids whose last RELEASE is remembered (a step then running does not store its cache)


@dataclass(frozen=True)
class CacheOptions:
    """Limits of a stage's KV caches."""

    max_requests: int = 64  # requests cached at once (least recently used dropped first)
    ttl_s: float = 600.0  # seconds: a request's cache unused this long is dropped
    max_bytes: int = 256 * 2**20  # bytes of keys and values over all requests of this stage

    def __post_init__(self) -> None:
        if self.max_requests < 1:
            raise ConfigError(f"max_requests must be >= 1, got {self.max_requests}")
        if not (self.ttl_s > 0 and math.isfinite(self.ttl_s)):
            raise ConfigError(f"the cache idle timeout must be a positive number of seconds, got {self.ttl_s!r}; set --cache-ttl")
        if self.max_bytes < 1:
            raise ConfigError(f"the KV cache cap must be at least 1 byte, got {self.max_bytes}; set --cache-mib")


@dataclass
class CacheEntry:
    """One request's cache: ``pos`` positions of every layer named in ``kv``."""

    pos: int = 0  # positions cached
    kv: Cache = field(default_factory=dict)  # layer name -> (keys, values), as the model's cached forward names them
    used: float = field(default_factory=time.monotonic)  # time.monotonic() of the last use
    epoch: int = 0  # the cache's release count when this entry was checked out (a RELEASE after it wins over its put)
    seq: int | None = None  # the newest step (frame param ``seq``) that ran on this cache; None: none said

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for pair in self.kv.values() for t in pair)

    def truncate(self, pos: int) -> None:
        """Keep positions 0..pos-1 (pos <= self.pos)."""
        if pos > self.pos:
            raise UnknownRequestError(f"the cache holds {self.pos} positions, fewer than pos={pos}")
        if pos < self.pos:
            self.kv = {name: (k[:, :, :pos], v[:, :, :pos]) for name, (k, v) in self.kv.items()}
            self.pos = pos


class KVCache:
    """Request id -> :class:`CacheEntry`, thread-safe (compute runs in a worker thread, RELEASE on the event loop)."""

    def __init__(self, options: CacheOptions | None = None, name: str = "stage") -> None:
        self.opts = options or CacheOptions()
        self.name = name
        self._entries: OrderedDict[str, CacheEntry] = OrderedDict()
        self._lock = threading.Lock()
        self.evictions = 0  # caches dropped by the limits (not by RELEASE)
        self._epoch = 0  # RELEASEs so far
        # request id -> the epoch of its last RELEASE and the newest step the entry had issued then (recent ones)
        self._released: OrderedDict[str, tuple[int, int | None]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, rid: object) -> bool:
        return rid in self._entries

    def peek(self, rid: str) -> CacheEntry | None:
        return self._entries.get(rid)

    def positions(self, rid: str) -> int | None:
        entry = self._entries.get(rid)
        return None if entry is None else entry.pos

    def nbytes(self) -> int:
        with self._lock:
            return sum(e.nbytes() for e in self._entries.values())

    def check(self, rid: str, pos: int, exact: bool = False, seq: int | None = None) -> None:
        """Whether a frame at ``pos`` of step ``seq`` can run: StaleFrameError when a newer step ran on the
        request's cache, UnknownRequestError when the request has no cache here (pos > 0), WireError when it holds
        fewer than ``pos`` positions (or, ``exact``, other than ``pos``)."""
        self._refuse_stale(rid, self._entries.get(rid), seq)
        cached = self.positions(rid)
        if pos == 0:
            return
        if cached is None:
            raise self._missing(rid)
        if cached < pos or (exact and cached != pos):
            raise WireError(f"request {rid} has {cached} cached positions, the frame says pos={pos}")

    def _missing(self, rid: str) -> UnknownRequestError:
        return UnknownRequestError(f"request {rid} has no KV cache at {self.name} (never prefilled, released or "
                                   "evicted); start it again with pos=0")

    @staticmethod
    def _refuse_stale(rid: str, entry: CacheEntry | None, seq: int | None) -> None:
        if seq is not None and entry is not None and entry.seq is not None and seq < entry.seq:
            raise StaleFrameError(f"request {rid} already ran step {entry.seq} here; this frame of step {seq} is a stale "
                                  "copy of an earlier step (a retry's late copy or a resend) and is dropped")

    def checkout(self, rid: str, pos: int, seq: int | None = None) -> CacheEntry:
        """The request's cache truncated to ``pos`` (a fresh one for pos = 0), for step ``seq`` (None: none said);
        StaleFrameError if a newer step ran on it (nothing is truncated), UnknownRequestError if it is missing."""
        with self._lock:
            entry = self._entries.get(rid)
            self._refuse_stale(rid, entry, seq)
            if pos == 0:
                return CacheEntry(epoch=self._epoch, seq=seq if seq is not None or entry is None else entry.seq)
            if entry is None:
                raise self._missing(rid)
            entry.truncate(pos)
            entry.epoch = self._epoch
            if seq is not None:
                entry.seq = seq  # an older step is refused from now on, before this one's put
            return entry

    def put(self, rid: str, entry: CacheEntry) -> None:
        """Store (or refresh) the request's cache, then apply the limits; not if the request was released while the
        step that extended it ran (the RELEASE, on the event loop, came between :meth:`checkout` and this), nor if
        the step was issued before the RELEASE (it was still queued here when the RELEASE passed: a fresh cache of a
        prefill, checked out after it, stayed until the TTL, counted against every live request's room)."""
        with self._lock:
            epoch, seq = self._released.get(rid, (-1, None))
            if epoch > entry.epoch or (seq is not None and entry.seq is not None and entry.seq <= seq):
                log.debug("%s: request %s was released during its step; its cache is not kept", self.name, rid)
                return
            entry.used = time.monotonic()
            self._entries[rid] = entry
            self._entries.move_to_end(rid)
            self._evict_locked(keep_last=True)

    def release(self, rid: str, seq: int | None = None) -> bool:
        """Drop the request's cache, and keep none that a step running or queued now would store: one checked out
        before this, or (``seq``, the newest step the entry had issued when the request was released) any step up to
        ``seq``. Whether there was a cache."""
        with self._lock:
            self._epoch += 1
            self._released[rid] = (self._epoch, seq)
            self._released.move_to_end(rid)
            while len(self._released) > RELEASES_KEPT:
                self._released.popitem(last=False)
            return self._entries.pop(rid, None) is not None

    def expire_idle(self) -> int:
        """Drop caches idle longer than ttl_s; returns how many."""
        with self._lock:
            return self._expire_locked()

    def _expire_locked(self) -> int:
        now = time.monotonic()
        idle = [r for r, e in self._entries.items() if now - e.used > self.opts.ttl_s]
        for rid in idle:
            del self._entries[rid]
            log.info("%s: dropped the KV cache of request %s, idle for more than %.0fs", self.name, rid, self.opts.ttl_s)
        self.evictions += len(idle)
        return len(idle)

    def _evict_locked(self, keep_last: bool) -> None:
        self._expire_locked()
        while len(self._entries) > self.opts.max_requests:
            rid, _ = self._entries.popitem(last=False)
            self.evictions += 1
            log.warning("%s: KV cache holds %d requests (max %d): dropped the least recently used request %s",
                        self.name, len(self._entries) + 1, self.opts.max_requests, rid)
        total = sum(e.nbytes() for e in self._entries.values())
        while total > self.opts.max_bytes and self._entries:
            rid, entry = next(iter(self._entries.items()))
            if keep_last and len(self._entries) == 1:
                log.warning("%s: request %s alone needs %d bytes of KV cache, over the cap of %d; dropped it "
                            "(its next frame fails: raise --cache-mib)", self.name, rid, total, self.opts.max_bytes)
            else:
                log.warning("%s: KV caches hold %d bytes (cap %d): dropped the least recently used request %s",
                            self.name, total, self.opts.max_bytes, rid)
            del self._entries[rid]
            self.evictions += 1
            total -= entry.nbytes()
