"""A group's upload on the wire: who averaged into the delta (the hivemind engine, issue 23).

A group upload is an ordinary delta payload (:func:`blocktrain.protocol.delta.pack_delta`) whose
``samples`` is the group's total and whose metadata field ``group`` is JSON: one entry per member
(uploader included), each with the member's libp2p peer id, its samples, its worker name and its proof
(base64: its signature over its peer id and the round, :mod:`blocktrain.p2p.trust`), which the coordinator
checks with the key it admitted that worker with. The members' tokens stay in the group's all-gather, where
the members check one another; the coordinator has its own record, so about 0.8 kB per member stays off its
link every round. Parsing bounds everything a stranger can send: member count, field sizes and types.
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass

MAX_MEMBERS = 256  # members one group upload may name
MAX_PEER_ID = 128  # characters of a peer id
MAX_WORKER = 128  # characters of a worker name
MAX_PROOF_B64 = 1400  # characters of a base64 proof (1024 bytes)


def round_scope(run: str, k: int, v: int) -> str:
    """What a member's card is bound to besides its peer id: the run, the block and the version."""
    return f"{run}/{k}/{v}"


def group_prefix(run: str, k: int) -> str:
    """The DHT key under which the workers of block k find each other (hivemind forbids dots); the version
    they are at is in every member's card (:func:`round_scope`), and a group at mixed versions is not used."""
    return f"bt_{run}_b{k}"


@dataclass(frozen=True)
class GroupMember:
    peer: str  # libp2p peer id (base58)
    samples: int  # training sequences behind its delta (its weight in the mean)
    worker: str  # the worker name the coordinator admitted it under
    proof: bytes  # its signature over (peer id, round scope) with the key it was admitted with


def encode_group(members: list[GroupMember]) -> str:
    return json.dumps([{"peer": m.peer, "samples": m.samples, "worker": m.worker,
                        "proof": base64.b64encode(m.proof).decode()} for m in members], separators=(",", ":"))


def decode_group(text: str) -> tuple[GroupMember, ...]:
    """The members named by ``text``; ValueError saying what is wrong with it."""
    try:
        rows = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"the group field is not JSON ({exc})") from None
    except RecursionError:  # nested deeper than the parser goes: no group
        raise ValueError("the group field is nested too deeply; it is a flat list of members") from None
    if not isinstance(rows, list) or not 2 <= len(rows) <= MAX_MEMBERS:
        raise ValueError(f"the group field must list 2..{MAX_MEMBERS} members")
    out = []
    for i, row in enumerate(rows):
        if not isinstance(row, dict) or set(row) != {"peer", "samples", "worker", "proof"}:
            raise ValueError(f"group member {i} must have exactly peer, samples, worker and proof")
        peer, samples, worker, proof = row["peer"], row["samples"], row["worker"], row["proof"]
        if not (isinstance(peer, str) and 0 < len(peer) <= MAX_PEER_ID and peer.isalnum()):
            raise ValueError(f"group member {i}: peer must be a base58 peer id of at most {MAX_PEER_ID} characters")
        if not (isinstance(samples, int) and not isinstance(samples, bool) and samples > 0):
            raise ValueError(f"group member {i}: samples must be a positive integer")
        if not (isinstance(worker, str) and 0 < len(worker) <= MAX_WORKER and worker.isprintable()):
            raise ValueError(f"group member {i}: worker must be a printable name of at most {MAX_WORKER} characters")
        if not (isinstance(proof, str) and len(proof) <= MAX_PROOF_B64):
            raise ValueError(f"group member {i}: proof must be a base64 string of at most {MAX_PROOF_B64} characters")
        try:
            out.append(GroupMember(peer, samples, worker, base64.b64decode(proof, validate=True)))
        except binascii.Error:
            raise ValueError(f"group member {i}: proof is not base64") from None
    if len({m.peer for m in out}) != len(out):
        raise ValueError("the group names a peer twice")
    return tuple(out)
