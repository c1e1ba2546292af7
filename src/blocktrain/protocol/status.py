"""``GET /v1/status``: the run as the coordinator sees it, typed row by row (the dashboard's and the scripts' source).

A reader built against an older coordinator ignores the fields it does not know (``extra="ignore"``).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from blocktrain.protocol.codes import BlockState, RoundState
from blocktrain.protocol.messages import Message


class Row(BaseModel):
    """Base of the status document's rows: frozen; fields a newer coordinator adds are ignored."""

    model_config = ConfigDict(frozen=True, extra="ignore")


class OuterStatus(Row):
    method: str | None  # the outer step (nesterov, average, adam)
    lr: float | None  # its eta
    momentum: float | None  # Nesterov's mu (None for another step)
    step_encoding: str  # the published step's encoding
    aggregation: str  # how a round's deltas are combined
    inner_start: str  # what a round's inner AdamW starts from (fresh, carried, shared_v, ...)


class BlockStatus(Row):
    block: int = Field(ge=0)  # k
    state: BlockState  # waiting, open or finished
    version: int = Field(ge=0)  # its published version
    weights_sha: str  # sha256 of its weights
    round_state: RoundState  # its current round's state (waiting: no round yet)
    deadline_in: float  # seconds to its round's deadline (0: no round)
    updates_in_round: int = Field(ge=0)  # accepted updates its round holds
    live_replicas: int = Field(ge=0)  # workers on it holding a lease
    outer: OuterStatus  # the outer step in use on it


class WorkerStatus(Row):
    name: str  # its token's name
    block: int | None  # the block it trains
    pinned: bool  # it asked for that block
    state: str  # active, lapsed or left
    live: bool  # it holds a lease now
    lease_in: float  # seconds left on its lease
    bytes_in: int = Field(ge=0)  # request body bytes it sent
    bytes_out: int = Field(ge=0)  # response body bytes it was sent
    updates_accepted: int = Field(ge=0)  # its updates accepted
    updates_rejected: int = Field(ge=0)  # its updates refused


class RoundStatus(Row):
    block: int = Field(ge=0)  # k
    version: int = Field(ge=0)  # v
    state: RoundState  # closed
    opened: float  # coordinator clock time it opened
    closed: float | None  # when it closed
    close_reason: str | None  # quorum or deadline
    updates: int = Field(ge=0)  # accepted and applied
    push_bytes: int = Field(ge=0)  # its accepted updates' body bytes
    step_bytes: int = Field(ge=0)  # the published step's bytes
    rejected: dict[str, int]  # refusals while it was open, by reason
    groups: list[int]  # sizes of the group means it took (hivemind engine)


class EvalStatus(Row):
    epoch: int = Field(ge=0)  # the least version over the blocks when it ran
    versions: dict[int, int]  # block -> version evaluated
    ce_nats_per_byte: float  # CE on the validation bytes scored
    bytes: int = Field(ge=0)  # validation bytes scored
    at: float  # coordinator clock time


class Status(Message):
    """The whole status document."""

    model_config = ConfigDict(frozen=True, extra="ignore")
    preset: str  # the run's preset name
    objective: str  # stack or diffusion (or a registered kind)
    dataset: str | None = Field(default=None, max_length=64)  # the fingerprint every worker's data must have
    n_blocks: int = Field(ge=1)  # B
    block_fp32_bytes: int = Field(ge=0)  # bytes of the largest block in fp32
    finished: bool  # every block has trained its rounds
    rounds_closed: int = Field(ge=0)  # rounds closed since the run began
    updates_accepted: int = Field(ge=0)  # updates accepted since the run began
    rejections: dict[str, int]  # refused requests by reason
    rate_limited: int = Field(ge=0)  # update requests answered 429 since start-up
    quarantined: dict[str, str]  # worker -> why it was quarantined
    intake: dict[str, Any]  # the intake's cost per update and the loss gate's tolerance per block
    audits: dict[str, int | float]  # replays passed, failed, awaiting their upload; the median replay seconds
    bytes_in: int = Field(ge=0)  # request body bytes received
    bytes_out: int = Field(ge=0)  # response body bytes sent
    bytes_by_route: dict[str, dict[str, int]]  # workers' bytes by what they moved (updates, weights, control)
    latest_eval_ce: float | None  # nats/byte of the latest evaluation of the assembled model
    blocks: list[BlockStatus]  # one row per block
    workers: list[WorkerStatus]  # one row per worker
    rounds: list[RoundStatus]  # the most recent closed rounds
    evals: list[EvalStatus]  # every evaluation of the assembled model
    p2p: dict[str, Any] | None = None  # the hivemind engine's DHT and authority (--hivemind)
