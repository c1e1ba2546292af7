"""The coordinator's row types: every row a table accessor (:mod:`.tables`) returns, frozen and typed.

Each is built from its ``sqlite3.Row`` by ``of`` (or in its accessor) and carries one field per column it needs, with
its unit; no ``sqlite3.Row`` reaches the rest of the coordinator (``tests/test_layering.py``).
"""

from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass

from blocktrain.coordinator.settings import CloseReason, UpdateState, WorkerState
from blocktrain.protocol.codes import RoundState
from blocktrain.protocol.delta import Compression


@dataclass(frozen=True)
class WorkerRow:
    """A ``workers`` row."""

    id: int  # the worker's number (it names its data streams: seeds.worker_stream)
    name: str  # its token's name
    block: int | None  # the block it trains (None: never assigned)
    pinned: bool  # it asked for that block (--block) and keeps it
    state: WorkerState  # active, lapsed or left
    registered: float  # coordinator clock time of its first registration
    lease_until: float  # coordinator clock time its lease ends
    bytes_in: int  # request body bytes it sent
    bytes_out: int  # response body bytes it was sent
    accepted: int  # its updates accepted
    rejected: int  # its updates refused

    def live(self, now: float) -> bool:
        """Active and holding its lease at ``now``."""
        return self.state is WorkerState.ACTIVE and self.lease_until >= now

    @classmethod
    def of(cls, r: sqlite3.Row) -> WorkerRow:
        return cls(int(r["id"]), str(r["name"]), None if r["block"] is None else int(r["block"]), bool(r["pinned"]),
                   WorkerState(r["state"]), float(r["registered"]), float(r["lease_until"]), int(r["bytes_in"]),
                   int(r["bytes_out"]), int(r["accepted"]), int(r["rejected"]))


@dataclass(frozen=True)
class VersionRow:
    """A ``versions`` row: what block ``block`` published as ``version``."""

    block: int  # k
    version: int  # v
    weights_blob: str  # digest of W_v's safetensors payload
    step_blob: str | None  # digest of the published step that made it (None for v = 0)
    momentum_blob: str | None  # digest of the outer state carried from it (None: nothing to carry)
    weights_sha: str  # tensors_sha256 of W_v
    created: float  # coordinator clock time it was published
    moments_blob: str | None = None  # digest of the inner moments published with it (None: none)

    @classmethod
    def of(cls, r: sqlite3.Row) -> VersionRow:
        return cls(int(r["block"]), int(r["version"]), str(r["weights_blob"]), r["step_blob"] or None,
                   r["momentum_blob"] or None, str(r["weights_sha"]), float(r["created"]), r["moments_blob"] or None)


@dataclass(frozen=True)
class RoundRow:
    """A ``rounds`` row: round ``version`` of block ``block``."""

    block: int  # k
    version: int  # v: the round takes deltas against W_v
    state: RoundState  # open, closed or finished
    opened: float  # coordinator clock time it opened
    deadline: float  # coordinator clock time of its deadline
    closed: float | None  # when it closed (None: not yet)
    close_reason: CloseReason | None  # why it closed (None: not yet)
    n_updates: int  # accepted updates that count in it (dropped ones subtracted)

    @classmethod
    def of(cls, r: sqlite3.Row) -> RoundRow:
        return cls(int(r["block"]), int(r["version"]), RoundState(r["state"]), float(r["opened"]), float(r["deadline"]),
                   None if r["closed"] is None else float(r["closed"]),
                   None if r["close_reason"] is None else CloseReason(r["close_reason"]), int(r["n_updates"]))


@dataclass(frozen=True)
class UpdateRow:
    """An ``updates`` row: one accepted push."""

    id: int  # arrival order
    block: int  # k
    version: int  # v it was trained against
    worker: str  # who pushed it (a group mean's uploader)
    samples: int  # sequences behind it (its weight)
    norm: float  # ||Delta||
    compression: Compression  # its wire encoding
    blob: str  # digest of its body
    arrived: float  # coordinator clock time it arrived
    arrival_s: float  # seconds after its round opened
    state: UpdateState  # accepted, applied, screened or dropped

    @classmethod
    def of(cls, r: sqlite3.Row) -> UpdateRow:
        return cls(int(r["id"]), int(r["block"]), int(r["version"]), str(r["worker"]), int(r["samples"]),
                   float(r["norm"]), Compression(r["compression"]), str(r["blob"]), float(r["arrived"]),
                   float(r["arrival_s"]), UpdateState(r["state"]))


@dataclass(frozen=True)
class EvalRow:
    """An ``evals`` row: one evaluation of the assembled model."""

    epoch: int  # the least version over the blocks when it ran
    versions: dict[int, int]  # block -> version evaluated
    ce: float  # nats/byte on the validation bytes scored
    bytes: int  # validation bytes scored
    at: float  # coordinator clock time

    @classmethod
    def of(cls, r: sqlite3.Row) -> EvalRow:
        return cls(int(r["epoch"]), {int(k): int(v) for k, v in json.loads(r["versions"]).items()}, float(r["ce"]),
                   int(r["bytes"]), float(r["at"]))


@dataclass(frozen=True)
class RoundTraffic:
    """What one closed round moved and refused."""

    push_bytes: int  # its accepted updates' body bytes
    step_bytes: int  # the published step's bytes
    rejected: dict[str, int]  # refusals while it was open, by reason


@dataclass(frozen=True)
class KeptRound:
    """A round a worker's inner state went on from: its update accepted against ``version``."""

    version: int  # v it was trained against
    blob: str  # digest of its body
    samples: int  # the sequences it claimed (steps x batch)


@dataclass(frozen=True)
class AuditRow:
    """An ``audits`` row: a push drawn for audit, not yet decided."""

    worker: str  # who pushed it
    block: int  # k
    version: int  # v it was trained against
    blob: str  # digest of its body (its update row names the same)
    stream: int  # the stream id the work answer named
    schedule_steps: int  # the span of the block's lr schedule
    round_steps: int  # H
    due: float  # coordinator clock time by which the worker must upload its state
