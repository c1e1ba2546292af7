"""A group's upload on the wire: who averaged into the delta (the hivemind engine, issue 23).

A group upload is an ordinary delta payload (:func:`blocktrain.protocol.delta.pack_delta`) whose
``samples`` is the group's total and whose metadata field ``group`` is JSON: one entry per member
(uploader included), each with the member's libp2p peer id, its samples and its card (the token the
coordinator issued it and its proof, base64; :mod:`blocktrain.p2p.trust`). Parsing bounds everything a
stranger can send: member count, field sizes and types.
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass

MAX_MEMBERS = 256  # members one group upload may name
MAX_PEER_ID = 128  # characters of a peer id
MAX_TOKEN_B64 = 6000  # characters of a base64 token (4096 bytes)
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
    token: bytes  # serialized access token the coordinator issued it
    proof: bytes  # its signature over (peer id, round scope) with the token's key


def encode_group(members: list[GroupMember]) -> str:
    return json.dumps([{"peer": m.peer, "samples": m.samples, "token": base64.b64encode(m.token).decode(),
                        "proof": base64.b64encode(m.proof).decode()} for m in members], separators=(",", ":"))


def decode_group(text: str) -> tuple[GroupMember, ...]:
    """The members named by ``text``; ValueError saying what is wrong with it."""
    try:
        rows = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"the group field is not JSON ({exc})") from None
    if not isinstance(rows, list) or not 2 <= len(rows) <= MAX_MEMBERS:
        raise ValueError(f"the group field must list 2..{MAX_MEMBERS} members")
    out = []
    for i, row in enumerate(rows):
        if not isinstance(row, dict) or set(row) != {"peer", "samples", "token", "proof"}:
            raise ValueError(f"group member {i} must have exactly peer, samples, token and proof")
        peer, samples, token, proof = row["peer"], row["samples"], row["token"], row["proof"]
        if not (isinstance(peer, str) and 0 < len(peer) <= MAX_PEER_ID and peer.isalnum()):
            raise ValueError(f"group member {i}: peer must be a base58 peer id of at most {MAX_PEER_ID} characters")
        if not (isinstance(samples, int) and not isinstance(samples, bool) and samples > 0):
            raise ValueError(f"group member {i}: samples must be a positive integer")
        if not (isinstance(token, str) and len(token) <= MAX_TOKEN_B64 and isinstance(proof, str)
                and len(proof) <= MAX_PROOF_B64):
            raise ValueError(f"group member {i}: token and proof must be base64 strings of bounded size")
        try:
            out.append(GroupMember(peer, samples, base64.b64decode(token, validate=True),
                                   base64.b64decode(proof, validate=True)))
        except binascii.Error:
            raise ValueError(f"group member {i}: token or proof is not base64") from None
    if len({m.peer for m in out}) != len(out):
        raise ValueError("the group names a peer twice")
    return tuple(out)
