"""The coordinator-worker messages: typed, bounded, versioned, parsed once on each side.

Every JSON body the coordinator and a worker exchange, and the metadata of a pushed delta, is one of these
models. A field's bounds are those of what an honest peer can send; anything else is refused where it is parsed
(:func:`parse`), with a message that names the field. Each message carries ``protocol`` (one without it is read
as this version): a peer that speaks another version is told to upgrade instead of misreading a field.

* :class:`RegisterRequest` (worker -> coordinator) and :class:`Registration` (its answer);
* :class:`WorkAnswer`: what a worker trains next, including the **budget** the coordinator assigns
  (``steps`` x ``batch`` sequences): an update may claim at most that many samples (:mod:`blocktrain.coordinator.intake`);
* :class:`UpdateMeta`: the safetensors metadata of a pushed delta, bound to the version **and** the weights
  sha256 it was trained from.

The coordinator (:mod:`blocktrain.coordinator`) and the worker (:mod:`blocktrain.worker`) import these; nothing here
imports either.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from blocktrain.errors import ProtocolError
from blocktrain.protocol.codes import BlockState, Reason, RoundState
from blocktrain.protocol.moments import InnerStart, MomentCodec

PROTOCOL_VERSION = 6  # bumped when a message changes meaning (2: budgets, base sha256; 3: audits; 4: inner_start;
# 5: moment_every; 6: a refused round leaves the worker's inner state as it was, audits derive the moments)
MAX_INT = 1 << 62  # the largest block index or version a message may carry (stored as SQLite INTEGER: 64-bit signed)
MAX_SAMPLES = 1 << 30  # sequences one update may claim, whatever its budget
MAX_STEPS = 1 << 20  # inner steps one round may assign
MAX_REVOKED = 1024  # quarantined workers a work answer names (the newest)
P2P_TOKEN_TTL_S = 30 * 24 * 3600.0  # seconds a hivemind access token stays valid from its issue (registration, renewal)
CLOCK_SKEW_S = 24 * 3600.0  # seconds a peer's clock may lag the coordinator's when it checks a token's expiry
MAX_WORKER_NAME = 128  # characters of a worker's name
WorkerName = Annotated[str, Field(min_length=1, max_length=MAX_WORKER_NAME)]  # a worker's name, as the coordinator admits it
SHA256_HEX = r"^[0-9a-f]{64}$"

M = TypeVar("M", bound="Message")


class Message(BaseModel):
    """Base of every message: frozen, and its protocol version checked on parse."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    protocol: int = PROTOCOL_VERSION  # version of this protocol the sender speaks


class RegisterRequest(Message):
    block: int | None = Field(default=None, ge=0, le=4096)  # pin this worker to block K (None: the coordinator assigns)
    dataset: str | None = Field(default=None, max_length=64)  # sha256 fingerprint of the worker's dataset
    p2p_key: str | None = Field(default=None, max_length=2048)  # RSA public key (OpenSSH) of a hivemind-averaging worker


class Registration(Message):
    model_config = ConfigDict(frozen=True, extra="ignore")  # a newer coordinator may add fields
    worker: str = Field(max_length=MAX_WORKER_NAME)  # the name the coordinator admitted this token under
    block: int = Field(ge=0, le=MAX_INT)  # the block this worker trains
    block_state: BlockState  # waiting, open or finished
    message: str = Field(default="", max_length=1024)  # what the worker should know about its block's state
    config: str = Field(max_length=1 << 16)  # the run config (RunConfig.to_json)
    lease_seconds: float = Field(gt=0)  # seconds: heartbeat at least this often
    rounds: int = Field(ge=0)  # this block's rounds (0: no limit)
    n_blocks: int = Field(ge=1)  # blocks of the run
    local_steps: int = Field(ge=1, le=MAX_STEPS)  # H: inner steps per round the coordinator assigns
    inner_start: InnerStart = InnerStart.FRESH  # what each round's inner AdamW starts from (blocktrain.train.inner)
    moment_codec: MomentCodec = MomentCodec.INT8  # how shared moments are encoded, pushed and published
    moment_every: int = Field(default=1, ge=1, le=MAX_STEPS)  # rounds: shared moments are pushed every this many
    # (protocol.moments.shares_moments), the worker's own carried between
    p2p: dict[str, Any] | None = None  # hivemind engine: token, authority, initial peers, run


class FrozenRef(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    block: int = Field(ge=0, le=MAX_INT)  # a finished block this block reads
    version: int = Field(ge=0, le=MAX_INT)  # its final version
    weights_sha: str = Field(pattern=SHA256_HEX)  # sha256 of its tensors (tensors_sha256)


class WorkAnswer(Message):
    model_config = ConfigDict(frozen=True, extra="ignore")
    block: int = Field(ge=0, le=MAX_INT)  # the block to train
    version: int = Field(ge=0, le=MAX_INT)  # its published version W_v
    weights_sha: str = Field(pattern=SHA256_HEX)  # sha256 of W_v: the update names it back
    block_state: BlockState  # the block's state
    message: str = Field(default="", max_length=1024)  # what the worker should know about it
    frozen: tuple[FrozenRef, ...] = Field(default=(), max_length=4096)  # the finished blocks it reads
    round_state: RoundState  # whether round v takes updates (waiting: the block has no round yet)
    deadline_in: float = Field(allow_inf_nan=False)  # seconds until round v's deadline (0: no round; < 0: past it)
    seed: int = Field(ge=-(1 << 63), lt=1 << 63)  # the run's seed (a signed 64-bit integer: seeds.mix_seed)
    stream: int = Field(ge=0)  # the data stream of (this worker, block, version)
    steps: int = Field(ge=1, le=MAX_STEPS)  # budget: inner steps asked for this round (H)
    batch: int = Field(ge=1, le=1 << 16)  # budget: sequences per step; an update claims at most steps x batch
    submitted: bool  # this worker already counts for round v
    fetch_first: bool = True  # hivemind engine: the first to ask about version v fetches it at once
    # hivemind engine (to a worker registered for groups): quarantined workers, newest first, whose group cards no
    # longer count (their DHT tokens stay valid until they expire): a group with one of them is not used
    revoked: tuple[WorkerName, ...] = Field(default=(), max_length=MAX_REVOKED)
    finished: bool  # the block has no more rounds

    @property
    def sequences(self) -> int:
        """The most samples an update for this round may claim."""
        return self.steps * self.batch


class Heartbeat(Message):
    """The answer to a heartbeat."""

    model_config = ConfigDict(frozen=True, extra="ignore")
    lease_seconds: float = Field(gt=0)  # seconds: heartbeat at least this often


class P2PToken(Message):
    """The answer to ``POST /v1/p2p/token``: a new DHT token for the key the worker registered with (hivemind)."""

    model_config = ConfigDict(frozen=True, extra="ignore")
    p2p: dict[str, Any]  # as a registration's: token, authority, initial peers, run


class Left(Message):
    """The answer to a worker's goodbye."""

    model_config = ConfigDict(frozen=True, extra="ignore")
    left: bool = True  # its lease is given back


class ErrorBody(BaseModel):
    """Every refusal's JSON body (4xx): ``error`` is a :class:`blocktrain.protocol.codes.Reason`, ``detail`` says what
    was wrong and what to do."""

    model_config = ConfigDict(frozen=True, extra="ignore")
    error: str  # the reason, a machine-readable code
    detail: str  # the message


class UpdateMeta(Message):
    """The metadata of a pushed delta (string-valued in safetensors; :meth:`to_meta` / :func:`parse_meta`)."""

    kind: Literal["delta"] = "delta"  # what the payload is
    block_index: int = Field(ge=0, le=MAX_INT)  # the block the delta is for
    base_version: int = Field(ge=0, le=MAX_INT)  # the version W_v it was trained from
    base_sha: str = Field(pattern=SHA256_HEX)  # sha256 of W_v's tensors, as the work answer named it
    samples: int = Field(ge=1, le=MAX_SAMPLES)  # sequences behind the delta (claimed; capped by the budget)
    compression: Literal["none", "bf16", "int8"]  # the tensors' encoding (a protocol.delta.Compression value)
    group: str | None = Field(default=None, max_length=1 << 20)  # hivemind: the members whose mean this is (JSON)
    precision: str = Field(default="fp32", pattern=r"^(fp32|bf16)$")  # the arithmetic it trained in (an audit replays in the same)
    state_sha: str | None = Field(default=None, pattern=SHA256_HEX)  # sha256 of the worker's inner state at the
    # round's start (protocol.inner_state): what it uploads if the push is audited (None: a group mean, not auditable)
    moments: Literal["none", "bf16", "int8", "factored"] | None = None  # encoding of the inner moment estimates carried beside the
    # delta (protocol.moments: m/NAME, v/NAME tensors; None: none carried)

    def to_meta(self) -> dict[str, str]:
        return {k: str(v) for k, v in self.model_dump(mode="json", exclude_none=True).items()}


class PushAnswer(Message):
    """The coordinator's answer to an accepted push."""

    model_config = ConfigDict(frozen=True, extra="ignore")
    accepted: bool  # the update counts for its round
    duplicate: bool = False  # a byte-identical resend of an update already accepted
    block: int = Field(ge=0, le=MAX_INT)  # k
    version: int = Field(ge=0, le=MAX_INT)  # the version the update is against
    round_closed: bool = False  # this update made the round's quorum
    audit: bool = False  # upload the inner state the push committed to (POST /v1/blocks/{k}/audits/{version})


class AuditAnswer(Message):
    """The outcome of an audit replay."""

    model_config = ConfigDict(frozen=True, extra="ignore")
    passed: bool  # the replay reproduced the pushed delta within the tolerance
    relative_error: float = Field(ge=0)  # ||replayed - pushed|| / ||pushed||
    tolerance: float = Field(ge=0)  # the coordinator's audit_tolerance
    seconds: float = Field(ge=0)  # the replay's wall time on the coordinator
    scale: float = 1.0  # <pushed, replayed> / ||replayed||^2; passing needs it within audit_scale_tolerance of 1
    derived_steps: int = Field(default=0, ge=0)  # inner steps of the worker's earlier rounds replayed to derive the
    # moments it started from (coordinator.lineage); 0 where the round started from none or none could be derived
    moment_error: float = Field(default=0.0, ge=0)  # how far the uploaded moments are from the derived ones
    pushed_moment_error: float = Field(default=0.0, ge=0)  # how far the moments the push carried are from its replay's


def parse(model: type[M], doc: Any, what: str, status: int = 422) -> M:
    """``doc`` as ``model``: a :class:`ProtocolError` naming the first bad field, or the version to upgrade to."""
    if isinstance(doc, dict):
        got = doc.get("protocol", PROTOCOL_VERSION)
        if got != PROTOCOL_VERSION and str(got) != str(PROTOCOL_VERSION):
            raise ProtocolError(status if status != 422 else 426, f"{what} speaks protocol {got}, this BlockTrain "
                                f"speaks {PROTOCOL_VERSION}; run the same BlockTrain version on both sides", Reason.PROTOCOL)
    try:
        return model.model_validate(doc)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first.get("loc", ())) or "(body)"
        raise ProtocolError(status, f"{what}: field {field!r}: {first.get('msg')}", Reason.METADATA if status == 422 else Reason.SCHEMA
                            ) from None


def parse_meta(meta: dict[str, str]) -> UpdateMeta:
    """A delta's safetensors metadata (all strings) as :class:`UpdateMeta`; 422 naming the bad field."""
    return parse(UpdateMeta, dict(meta), "update metadata")
