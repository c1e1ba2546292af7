"""The inner state an audited round must start from, derived from the coordinator's own records.

An audit replays a worker's round from its inner state at the round's start (:mod:`.audit`). The error-feedback
residual in that state is bounded by the worker's last pushes (:func:`~blocktrain.protocol.delta.residual_within`);
its AdamW moments are not something the coordinator has to take on trust either, because a worker's moments are a
function of what the coordinator published and of the worker's own earlier rounds (:mod:`blocktrain.train.inner`):

* a worker starts its inner state afresh (m = v = 0) whenever it registers (a session, ``workers.session``);
* a round under ``fresh`` starts from zero moments; a round that loads published moments (a shared start, the newest
  moments published at or before its version, loaded when the worker has kept no round of the block since they were
  published: ``Worker._published_moments``) replaces the moments ``start.shares`` names, and ``shared_v`` zeroes m;
* otherwise its state is the one its previous kept round ended with: the round of its newest push of the block in
  the session that was answered as accepted (a refused round is undone on the worker's side, to its state
  before the round began, a load included).

:func:`trace` walks back from the audited round through the worker's kept rounds until a round whose start no
longer depends on the one before (a load that replaces every moment, a fresh start, the session's first round):
a :class:`Lineage`. The audit (:meth:`.audit.Auditor.derived_moments`) then replays those rounds, each from its
published weights W_u and its stream, and the moments the worker uploaded must lie near the ones they end with
(:func:`.audit.moment_error`). Where no lineage can be traced (more than
:data:`MAX_ROUNDS` rounds back, as under ``carried`` or ``local_m``, which never reset m; a worker that averages in
hivemind groups, whose round a group's mean may stand for, accepted or not, without the coordinator ever seeing its
own part; a worker whose registration predates the store's sessions), :func:`trace` returns None and the uploaded
moments go unbounded, as they did in every audit before.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Protocol

import torch

from blocktrain.checkpoint.safetensors_io import RESERVED, unpack
from blocktrain.config import Precision
from blocktrain.coordinator.rows import KeptRound
from blocktrain.coordinator.store import Store
from blocktrain.protocol.messages import parse_meta
from blocktrain.protocol.moments import InnerStart, MomentCodec, parse_moments
from blocktrain.seeds import worker_stream

__all__ = ["MAX_ROUNDS", "Derivation", "DerivedRound", "Lineage", "Link", "Records", "StoreRecords", "derive", "trace"]

MAX_ROUNDS = 8  # earlier rounds an audit replays to derive a state (moments shared every 3 rounds need at most 2)


class Records(Protocol):
    """What :func:`trace` reads of a run's records: the coordinator's store (:class:`StoreRecords`), or the
    in-process rounds' own (:mod:`.simulate`)."""

    def worker_id(self, worker: str) -> int | None:
        """The worker's number (it names its streams), None for a worker never registered."""

    def traceable(self, worker: str) -> bool:
        """Whether its current session's rounds are on record as such (not averaging in groups, not pre-sessions)."""

    def last_kept(self, k: int, worker: str, before: int) -> KeptRound | None:
        """Its newest round of block k against a version before ``before`` that counts, in its current session."""

    def grouped(self, k: int, worker: str, low: int, high: int) -> bool:
        """Whether a group's mean stood for one of its rounds of block k against a version in [low, high)."""

    def moments_blob(self, k: int, v: int) -> str | None:
        """Digest of the moments published with version v of block k (None: none)."""

    def weights_blob(self, k: int, v: int) -> str | None:
        """Digest of block k's weights at version v (None: unknown)."""


@dataclass(frozen=True)
class StoreRecords:
    """The coordinator's store as :class:`Records` (read under its lock)."""

    store: Store

    def worker_id(self, worker: str) -> int | None:
        row = self.store.workers.worker(worker)
        return None if row is None else row.id

    def traceable(self, worker: str) -> bool:
        return self.store.workers.traceable(worker)

    def last_kept(self, k: int, worker: str, before: int) -> KeptRound | None:
        return self.store.updates.last_kept(k, worker, before)

    def grouped(self, k: int, worker: str, low: int, high: int) -> bool:
        return self.store.updates.grouped(k, worker, low, high)

    def moments_blob(self, k: int, v: int) -> str | None:
        return self.store.rounds.moments_blob(k, v)

    def weights_blob(self, k: int, v: int) -> str | None:
        return self.store.rounds.weights_blob(k, v)


@dataclass(frozen=True)
class Link:
    """One round of a lineage: what its start loaded and, for an earlier round, what it trained."""

    version: int  # u: the version it was trained against
    loads: str | None  # digest of the published moments its start loaded (None: it went on from the state before)
    kept: KeptRound | None  # the worker's update of that round (None: the audited round itself)
    weights: str | None  # digest of W_u (None for the audited round: the case holds it)
    stream: int  # the stream id the coordinator named for (worker, block, u)


@dataclass(frozen=True)
class Lineage:
    """The worker's kept rounds an audited round's state came from, oldest first, then the audited round; the first
    starts from zero moments or from a load that replaces them all."""

    links: tuple[Link, ...]

    @property
    def earlier(self) -> tuple[Link, ...]:
        """The rounds replayed before the audited one."""
        return self.links[:-1]


def trace(records: Records, k: int, worker: str, v: int, start: InnerStart, every: int) -> Lineage | None:
    """(Under the coordinator's lock, for its store.) The lineage of ``worker``'s state at the start of its round of
    block k against version v, or None where the records cannot derive it (module docstring)."""
    worker_id = records.worker_id(worker)
    if worker_id is None or not records.traceable(worker):  # a group's mean may stand for its round, kept or not;
        return None  # or it registered before the store had sessions
    links: list[Link] = []
    u, kept, weights = v, None, None  # the round being linked: the audited one first
    while True:
        last = records.last_kept(k, worker, u)
        if records.grouped(k, worker, last.version if last is not None else 0, u):
            return None  # a round in a group's mean went between (this session's): its own part never came
        at = u - u % every  # the newest version published with moments, at or before u
        loads = None
        if start.shares and at > 0 and (last is None or last.version < at):
            loads = records.moments_blob(k, at)  # None: none published then, its own state went on
        links.append(Link(u, loads, kept, weights, worker_stream(worker_id, k, u)))
        if start is InnerStart.FRESH or last is None or (loads is not None and not start.keeps_own):
            return Lineage(tuple(reversed(links)))
        if len(links) > MAX_ROUNDS:
            return None
        u, kept, weights = last.version, last, records.weights_blob(k, last.version)
        if weights is None:
            return None


BlobReader = Callable[[str], bytes]  # digest -> the bytes stored under it (the store's blobs, or in process)


def _weights(get_blob: BlobReader, digest: str) -> dict[str, torch.Tensor]:
    w, _ = unpack(get_blob(digest), source=f"weights {digest[:12]}")
    return {n: t.float() for n, t in w.items()}


@dataclass(frozen=True)
class DerivedRound:
    """An earlier round of a lineage, read back for its replay."""

    version: int  # u
    weights: Callable[[], dict[str, torch.Tensor]]  # reads W_u, float32, as the worker trained from it (one at a time)
    steps: int  # its claimed samples / batch
    precision: Precision  # the arithmetic it claimed (its replay uses the same)
    stream: int  # its stream id
    loads: dict[str, torch.Tensor] | None  # the moment estimates its start loaded (None: the state before went on)


@dataclass(frozen=True)
class Derivation:
    """A lineage read back: the earlier rounds to replay, and what the audited round's own start loads."""

    earlier: tuple[DerivedRound, ...]
    loads: dict[str, torch.Tensor] | None  # the moment estimates the audited round's start loaded

    @property
    def steps(self) -> int:
        """Inner steps replayed before the audited round."""
        return sum(r.steps for r in self.earlier)


def derive(get_blob: BlobReader, lineage: Lineage, k: int, shapes: dict[str, tuple[int, ...]], start: InnerStart,
           codec: MomentCodec, batch: int) -> Derivation:
    """(Unlocked: blobs never change.) The tensors ``lineage`` names, read with ``get_blob``: each earlier round's
    weights (read when its replay starts), claimed steps and precision, and the moments each start loaded, decoded
    as a worker decodes them."""

    def moments(digest: str | None) -> dict[str, torch.Tensor] | None:
        if digest is None:
            return None
        tensors, _ = unpack(get_blob(digest), source=f"moments {digest[:12]}")
        return parse_moments(tensors, shapes, start.shares, codec)

    earlier = []
    for link in lineage.earlier:
        assert link.kept is not None and link.weights is not None
        _, meta = unpack(get_blob(link.kept.blob), source=f"update {link.kept.blob[:12]}")
        precision = parse_meta({n: t for n, t in meta.items() if n not in RESERVED}).precision  # checked when accepted
        earlier.append(DerivedRound(link.version, partial(_weights, get_blob, link.weights), link.kept.samples // batch,
                                    Precision(precision), link.stream, moments(link.loads)))
    return Derivation(tuple(earlier), moments(lineage.links[-1].loads))
