"""The coordinator protocol's codes: block and round states, and the reason of every refusal.

These travel as strings (JSON fields, the ``error`` of a refusal's body, metrics labels) and are compared as enum
members on both sides (hivemind's ``MessageCode`` is the model). Each is a :class:`enum.StrEnum`, so a member is its
wire string: ``Reason.STALE == "stale"``, and an older peer's string parses into the member it names.
"""

from __future__ import annotations

import enum


class BlockState(enum.StrEnum):
    """Where a block is in its run."""

    WAITING = "waiting"  # not trained yet: a stack block waits for blocks 0..k-1 to finish (progressive schedule)
    OPEN = "open"  # rounds are running
    FINISHED = "finished"  # reached its last round; its weights are final (and served as a frozen input)


class RoundState(enum.StrEnum):
    """Where a block's current round is."""

    WAITING = "waiting"  # no round yet: the block is waiting (never stored: a waiting block has no round row)
    OPEN = "open"  # taking deltas against this version
    CLOSED = "closed"  # aggregated into the next version
    FINISHED = "finished"  # the block reached its last round; nothing more is taken


class Reason(enum.StrEnum):
    """Why the coordinator (or a worker's client) refused a request: the ``error`` of a refusal's JSON body."""

    # what an update is or does (these count toward quarantine: coordinator.conduct.COUNTED)
    CLAIM = "claim"  # it claims more samples than its round assigned
    NORM = "norm"  # its norm is out of bounds against the block's recent ones
    LAZY = "lazy"  # its norm is below what its claimed samples move
    REPLAY = "replay"  # it repeats an accepted delta
    GATE = "gate"  # it makes the held-out loss worse beyond the tolerance
    SCREENED = "screened"  # dropped at its round's close: it pointed away from the others
    METADATA = "metadata"  # its metadata is invalid
    SCHEMA = "schema"  # its tensors are not the block's
    NON_FINITE = "non_finite"  # it holds NaN or infinite values
    NOT_SAFETENSORS = "not_safetensors"  # the body is not safetensors
    GROUP = "group"  # a malformed group mean (hivemind engine)
    COMMITMENT = "commitment"  # it names no inner-state commitment where audits need one
    MOMENTS = "moments"  # its shared inner moments are missing, unexpected or malformed
    # an honest worker meets these in an ordinary run
    STALE = "stale"  # against an older version
    BASE = "base"  # names another sha256 than the published weights
    DUPLICATE = "duplicate"  # the worker already counts for the round
    WAITING = "waiting"  # the block is not open yet
    FINISHED = "finished"  # the block takes no more updates
    NOT_FINISHED = "not_finished"  # a frozen download of a block still training
    WRONG_BLOCK = "wrong_block"  # pushed to another block than its own
    NOT_REGISTERED = "not_registered"  # a request before registration
    NO_STEP = "no_step"  # no published step from that version
    NO_MOMENTS = "no_moments"  # no inner moments published with that version
    NO_AUDIT = "no_audit"  # an audit upload nobody asked for
    AUDIT_FORMAT = "audit_format"  # an audit upload that is not the state it should be
    AUDITS_BUSY = "audits_busy"  # a push drawn for an audit while every audit slot is taken (503: sent again)
    # the request and its sender
    AUTH = "auth"  # no or an unknown bearer token
    QUARANTINED = "quarantined"  # the worker is quarantined
    RATE_LIMITED = "rate_limited"  # too many refused requests of late
    TOO_LARGE = "too_large"  # the body exceeds its cap
    ABORTED = "aborted"  # the client closed the connection mid-body
    SLOW = "slow"  # the body did not arrive within the coordinator's upload_timeout_s
    CORRUPT = "corrupt"  # the body could not be read
    ENCODING = "encoding"  # an unsupported Content-Encoding
    PROTOCOL = "protocol"  # the peer speaks another protocol version
    BLOCK = "block"  # no such block
    DATASET = "dataset"  # the worker's data is not the run's
    HIVEMIND_OFF = "hivemind_off"  # a hivemind request to a coordinator without --hivemind
    GROUP_MEMBER = "group_member"  # a group member that cannot count
    P2P_KEY = "p2p_key"  # a malformed hivemind key
    # the worker's own side
    FROZEN = "frozen"  # the coordinator named frozen inputs this block does not read, or a copy failed its check
    P2P = "p2p"  # the hivemind engine could not start or join
    UNREACHABLE = "unreachable"  # the coordinator cannot be reached
    STOPPED = "stopped"  # the worker was told to stop
    INVALID = "invalid"  # anything else
