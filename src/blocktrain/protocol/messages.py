"""The coordinator-worker messages: typed, bounded, versioned, parsed once on each side.

Every JSON body the coordinator and a worker exchange, and the metadata of a pushed delta, is one of these
models. A field's bounds are those of what an honest peer can send; anything else is refused where it is parsed
(:func:`parse`), with a message that names the field. Each message carries ``protocol``: a peer that speaks
another version is told to upgrade instead of misreading a field.

* :class:`RegisterRequest` (worker -> coordinator) and :class:`Registration` (its answer);
* :class:`WorkAnswer`: what a worker trains next, including the **budget** the coordinator assigns
  (``steps`` x ``batch`` sequences): an update may claim at most that many samples (:mod:`blocktrain.coordinator.intake`);
* :class:`UpdateMeta`: the safetensors metadata of a pushed delta, bound to the version **and** the weights
  sha256 it was trained from.

The coordinator (:mod:`blocktrain.coordinator`) and the worker (:mod:`blocktrain.worker`) import these; nothing here
imports either.
"""

from __future__ import annotations

from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from blocktrain.errors import ProtocolError

PROTOCOL_VERSION = 3  # bumped when a message changes meaning (2: budgets, base sha256; 3: audits)
MAX_SAMPLES = 1 << 30  # sequences one update may claim, whatever its budget
MAX_STEPS = 1 << 20  # inner steps one round may assign
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
    worker: str = Field(max_length=128)  # the name the coordinator admitted this token under
    block: int = Field(ge=0)  # the block this worker trains
    block_state: str = Field(max_length=16)  # waiting, open or finished
    message: str = Field(default="", max_length=1024)  # what the worker should know about its block's state
    config: str = Field(max_length=1 << 16)  # the run config (RunConfig.to_json)
    lease_seconds: float = Field(gt=0)  # seconds: heartbeat at least this often
    rounds: int = Field(ge=0)  # this block's rounds (0: no limit)
    n_blocks: int = Field(ge=1)  # blocks of the run
    local_steps: int = Field(ge=1, le=MAX_STEPS)  # H: inner steps per round the coordinator assigns
    inner_reset: bool = False  # start each round with fresh inner AdamW moments (else carry them across rounds)
    p2p: dict[str, Any] | None = None  # hivemind engine: token, authority, initial peers, run


class FrozenRef(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    block: int = Field(ge=0)  # a finished block this block reads
    version: int = Field(ge=0)  # its final version
    weights_sha: str = Field(pattern=SHA256_HEX)  # sha256 of its tensors (tensors_sha256)


class WorkAnswer(Message):
    model_config = ConfigDict(frozen=True, extra="ignore")
    block: int = Field(ge=0)  # the block to train
    version: int = Field(ge=0)  # its published version W_v
    weights_sha: str = Field(pattern=SHA256_HEX)  # sha256 of W_v: the update names it back
    block_state: Literal["waiting", "open", "finished"]  # the block's state
    message: str = Field(default="", max_length=1024)  # what the worker should know about it
    frozen: tuple[FrozenRef, ...] = Field(default=(), max_length=4096)  # the finished blocks it reads
    round_state: Literal["waiting", "open", "closed", "finished"]  # whether round v takes updates
    deadline_in: float  # seconds until round v's deadline (0: no round)
    seed: int  # the run's seed
    stream: int = Field(ge=0)  # the data stream of (this worker, block, version)
    steps: int = Field(ge=1, le=MAX_STEPS)  # budget: inner steps asked for this round (H)
    batch: int = Field(ge=1, le=1 << 16)  # budget: sequences per step; an update claims at most steps x batch
    submitted: bool  # this worker already counts for round v
    fetch_first: bool = True  # hivemind engine: the first to ask about version v fetches it at once
    finished: bool  # the block has no more rounds

    @property
    def sequences(self) -> int:
        """The most samples an update for this round may claim."""
        return self.steps * self.batch


class UpdateMeta(Message):
    """The metadata of a pushed delta (string-valued in safetensors; :meth:`to_meta` / :func:`parse_meta`)."""

    kind: Literal["delta"] = "delta"  # what the payload is
    block_index: int = Field(ge=0)  # the block the delta is for
    base_version: int = Field(ge=0)  # the version W_v it was trained from
    base_sha: str = Field(pattern=SHA256_HEX)  # sha256 of W_v's tensors, as the work answer named it
    samples: int = Field(ge=1, le=MAX_SAMPLES)  # sequences behind the delta (claimed; capped by the budget)
    compression: Literal["none", "bf16", "int8"]  # the tensors' encoding (a protocol.delta.Compression value)
    group: str | None = Field(default=None, max_length=1 << 20)  # hivemind: the members whose mean this is (JSON)
    precision: str = Field(default="fp32", pattern=r"^(fp32|bf16)$")  # the arithmetic it trained in (an audit replays in the same)
    state_sha: str | None = Field(default=None, pattern=SHA256_HEX)  # sha256 of the worker's inner state at the
    # round's start (protocol.inner_state): what it uploads if the push is audited (None: a group mean, not auditable)
    moments: Literal["none", "bf16", "int8"] | None = None  # encoding of the inner moment estimates carried beside the
    # delta (protocol.moments: m/NAME, v/NAME tensors; None: none carried)

    def to_meta(self) -> dict[str, str]:
        return {k: str(v) for k, v in self.model_dump(mode="json", exclude_none=True).items()}


class PushAnswer(Message):
    """The coordinator's answer to an accepted push."""

    model_config = ConfigDict(frozen=True, extra="ignore")
    accepted: bool  # the update counts for its round
    duplicate: bool = False  # a byte-identical resend of an update already accepted
    block: int = Field(ge=0)  # k
    version: int = Field(ge=0)  # the version the update is against
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


class Status(Message):
    """``GET /v1/status``: the run as the coordinator sees it (the dashboard's and the scripts' one source).

    Its parts that list rows (blocks, workers, rounds, evaluations) are kept as JSON objects: they grow fields as the
    coordinator learns to show more, and a reader takes what it knows."""

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
    blocks: list[dict[str, Any]]  # one object per block: state, version, round, replicas, outer step
    workers: list[dict[str, Any]]  # one object per worker: block, state, lease, bytes, refusals
    rounds: list[dict[str, Any]]  # the most recent closed rounds
    evals: list[dict[str, Any]]  # every evaluation of the assembled model
    p2p: dict[str, Any] | None = None  # the hivemind engine's DHT and authority (--hivemind)


def parse(model: type[M], doc: Any, what: str, status: int = 422) -> M:
    """``doc`` as ``model``: a :class:`ProtocolError` naming the first bad field, or the version to upgrade to."""
    if isinstance(doc, dict):
        got = doc.get("protocol", PROTOCOL_VERSION)
        if got != PROTOCOL_VERSION and str(got) != str(PROTOCOL_VERSION):
            raise ProtocolError(status if status != 422 else 426, f"{what} speaks protocol {got}, this BlockTrain "
                                f"speaks {PROTOCOL_VERSION}; run the same BlockTrain version on both sides", "protocol")
    try:
        return model.model_validate(doc)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first.get("loc", ())) or "(body)"
        raise ProtocolError(status, f"{what}: field {field!r}: {first.get('msg')}", "metadata" if status == 422 else "schema"
                            ) from None


def parse_meta(meta: dict[str, str]) -> UpdateMeta:
    """A delta's safetensors metadata (all strings) as :class:`UpdateMeta`; 422 naming the bad field."""
    return parse(UpdateMeta, dict(meta), "update metadata")
