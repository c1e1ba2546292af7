"""Who may join a group: the coordinator signs access tokens, and members prove theirs inside the group.

Two layers, because hivemind authorises only part of its traffic:

1. **DHT requests** go through hivemind's authoriser hook (:class:`PeerAuthorizer`, a
   ``TokenAuthorizerBase``): every request and response carries an ``AccessToken`` that the coordinator
   (the :class:`Authority`) signed for the worker's RSA key, and is itself signed with that key. A peer
   without such a token can neither store nor read group keys, so it cannot find a group.
2. **Averager RPCs** (joining a group, exchanging parts) are not behind that hook in hivemind 1.1, so each
   member puts a *card* into the group's all-gather: its token, and a signature with the token's key over
   its libp2p peer id and the round's scope (run, block, version). hivemind authenticates the peer id of
   every gathered entry (the libp2p secure channel), so a card copied by another peer does not verify.
   Members check every card before they use the group's mean (else they upload alone); the coordinator
   checks them again before it accepts the upload (:mod:`blocktrain.coordinator.groups`).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from hivemind.proto.auth_pb2 import AccessToken
from hivemind.utils.auth import TokenAuthorizerBase
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey

from blocktrain.protocol.messages import CLOCK_SKEW_S, P2P_TOKEN_TTL_S

MAX_TOKEN_BYTES = 4096  # bytes of a serialized token a peer may send
MAX_PROOF_BYTES = 1024  # bytes of a card's signature (base64 of a 2048-bit RSA signature: 344)
RENEW_BEFORE_S = 2 * CLOCK_SKEW_S  # seconds of life left at which a DHT token is renewed (a peer's clock may lag a day)


def _token_payload(token: AccessToken) -> bytes:
    """What the authority signs: each field after its length (8 bytes), so no two tokens' fields sign alike. (v1
    joined them with NUL bytes, and a key's comment may hold one: a worker could move its key's bytes into its name
    and sign as another name, one no quarantine had revoked.)"""
    fields = [b"blocktrain-token-v2", token.username.encode(), token.public_key, token.expiration_time.encode()]
    return b"".join(len(f).to_bytes(8, "big") + f for f in fields)


def public_key(raw: bytes) -> RSAPublicKey | None:
    """An RSA public key from untrusted OpenSSH bytes, or None when they are not one."""
    try:
        return RSAPublicKey.from_bytes(raw)
    except Exception:  # cryptography raises ValueError, UnsupportedAlgorithm and others on garbage
        return None


def load_key(path: Path) -> RSAPrivateKey:
    """The RSA key at ``path`` (DER), created with owner-only permissions if missing."""
    if path.is_file():
        key = RSAPrivateKey.__new__(RSAPrivateKey)
        key.__setstate__({"_private_key": path.read_bytes()})  # hivemind's own (DER) restore
        return key
    key = RSAPrivateKey()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key.to_bytes())
    return key


class Authority:
    """The coordinator's signing key: it admits a worker's RSA key to the run's DHT and groups."""

    def __init__(self, key: RSAPrivateKey) -> None:
        self.key = key
        self.public_key = key.get_public_key().to_bytes()  # OpenSSH text, published in /v1/status

    def issue(self, worker: str, key_bytes: bytes, now: float | None = None) -> bytes:
        """A serialized token admitting ``key_bytes`` (an RSA public key) as ``worker``; ValueError if it is not one."""
        if public_key(key_bytes) is None:  # refuse what is not a key before signing it
            raise ValueError("not an RSA public key in OpenSSH form")
        expires = (time.time() if now is None else now) + P2P_TOKEN_TTL_S
        token = AccessToken(username=worker, public_key=key_bytes, expiration_time=repr(expires))
        token.signature = self.key.sign(_token_payload(token))
        return bytes(token.SerializeToString())


def verified_token(token: AccessToken, authority: bytes, now: float | None = None) -> bool:
    """Signed by ``authority`` and not expired."""
    try:
        expires = float(token.expiration_time)
    except ValueError:
        return False
    if expires < (time.time() if now is None else now):
        return False
    key = public_key(authority)
    return key is not None and key.verify(_token_payload(token), token.signature)


def parse_token(raw: object) -> AccessToken | None:
    """A token from untrusted bytes, or None when they are not one (bounded in size)."""
    if not isinstance(raw, bytes) or not 0 < len(raw) <= MAX_TOKEN_BYTES:
        return None
    try:
        token = AccessToken.FromString(raw)
    except Exception:
        return None
    return token if token.username and token.public_key else None


class PeerAuthorizer(TokenAuthorizerBase):
    """hivemind's authoriser hook with the coordinator's token: signs this peer's DHT traffic, checks others'.

    ``issuer``: the coordinator's own peer passes its :class:`Authority`, and signs its token again when less than
    RENEW_BEFORE_S of its life is left (the DHT runs in a forked process, which holds the key), so a coordinator up
    longer than P2P_TOKEN_TTL_S stays in its DHT. A worker asks the coordinator for a new token as its own nears
    its end, and hands it to this authoriser in the DHT's process (:meth:`renew`)."""

    def __init__(self, key: RSAPrivateKey, token: bytes, authority: bytes, issuer: Authority | None = None) -> None:
        super().__init__(key)
        parsed = parse_token(token)
        if parsed is None or not verified_token(parsed, authority):
            raise ValueError("the coordinator's access token does not verify against its published authority key")
        self._token = parsed
        self._authority = authority
        self._issuer = issuer
        self.revoked: frozenset[str] = frozenset()  # quarantined workers: their still-valid tokens open nothing here

    def renew(self, token: bytes) -> None:
        """Sign this peer's traffic with ``token`` from now on (the coordinator's new token for the same key)."""
        parsed = parse_token(token)
        if parsed is None or not verified_token(parsed, self._authority) or parsed.public_key != self._token.public_key:
            raise ValueError("the new access token does not verify against the authority, or names another key")
        self._token = parsed

    async def get_token(self) -> AccessToken:
        if self._issuer is not None and self._expiring(self._token):
            self._token = AccessToken.FromString(self._issuer.issue(self._token.username, self._token.public_key))
        return self._token

    def is_token_valid(self, access_token: AccessToken) -> bool:
        return access_token.username not in self.revoked and verified_token(access_token, self._authority)

    def does_token_need_refreshing(self, access_token: AccessToken) -> bool:
        """hivemind's question about the token it signs with: a newer one was handed over, or this peer signs its
        own and it nears its end."""
        return access_token is not self._token or (self._issuer is not None and self._expiring(access_token))

    @staticmethod
    def _expiring(token: AccessToken) -> bool:
        return float(token.expiration_time) - time.time() < RENEW_BEFORE_S


@dataclass(frozen=True)
class Card:
    """What a member puts into its group's all-gather to prove it was admitted (see the module docstring)."""

    token: bytes  # serialized AccessToken issued by the coordinator
    proof: bytes  # the token key's signature over (peer id, scope)

    @staticmethod
    def make(key: RSAPrivateKey, token: bytes, peer_id: str, scope: str) -> Card:
        return Card(token, key.sign(f"{peer_id}|{scope}".encode()))

    def worker(self, peer_id: str, scope: str, authority: bytes) -> str | None:
        """The admitted worker's name if this card verifies for ``peer_id`` in ``scope``, else None."""
        token = parse_token(self.token)
        if token is None or not verified_token(token, authority):
            return None
        return token.username if proof_verifies(token.public_key, peer_id, scope, self.proof) else None


def proof_verifies(key: bytes, peer_id: str, scope: str, proof: bytes) -> bool:
    """Whether ``proof`` is the signature of ``key`` (an RSA public key, OpenSSH form) over (peer id, scope)."""
    if not isinstance(proof, bytes) or len(proof) > MAX_PROOF_BYTES:
        return False
    rsa = public_key(key)
    return rsa is not None and rsa.verify(f"{peer_id}|{scope}".encode(), proof)
