"""How a worker's delta reaches the outer step: a strategy object per averaging engine (:class:`Averaging`).

* :class:`DirectEngine` (``--averaging coordinator``, the default): the worker pushes its own delta and asks the
  coordinator for every published version.
* :class:`HivemindEngine` (``--averaging hivemind``): the block's workers all-reduce their deltas in groups on the
  run's hivemind DHT (:mod:`blocktrain.p2p.groups`) and one member uploads the group's mean; a published version may
  come from a peer (hash-checked) instead of the coordinator, and a member whose mean another uploaded watches the
  DHT for the next version instead of polling.

The worker (:mod:`.loop`) calls the same methods whichever engine it runs; hivemind is imported only by the second.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from blocktrain.errors import ProtocolError
from blocktrain.protocol.codes import Reason
from blocktrain.protocol.group import GroupMember
from blocktrain.protocol.messages import WorkAnswer

log = logging.getLogger(__name__)
RENEW_RETRY_S = 3600.0  # seconds between two requests for a new DHT token whose answers did not renew it


class Averaging(enum.Enum):
    """How a worker's delta reaches the outer step."""

    COORDINATOR = "coordinator"  # push it to the coordinator (the embedded default)
    HIVEMIND = "hivemind"  # all-reduce it with the block's other workers on hivemind; one member uploads the mean


@dataclass(frozen=True)
class Combined:
    """What a worker uploads for its round: its own delta, or its group's mean."""

    delta: dict[str, torch.Tensor]  # the delta to push
    samples: int  # the sequences behind it
    members: list[GroupMember] | None = None  # a group mean's members (None: the worker's own delta)


@dataclass(frozen=True)
class RoundClock:
    """The current round's time budget, as the worker sees it."""

    give_up_at: float  # time.monotonic() by which the engine must have combined (the push margin kept after it)
    lease_s: float  # seconds of the worker's lease
    beat: Callable[[], None]  # heartbeat while waiting


class Engine(Protocol):
    """The strategy a worker averages with."""

    def register_key(self) -> str | None:
        """The public key to register with (None: no peer-to-peer identity)."""

    def joined(self, p2p: Any, k: int, weights: dict[str, torch.Tensor], like: dict[str, torch.Tensor]) -> None:
        """After a (re)registration on block k: the registration's ``p2p`` answer, the block's weights, and ``like``,
        what its rounds combine (the delta's names, and the shared moments' where they travel with it)."""

    def token_due(self) -> bool:
        """Whether its peer-to-peer token nears its end: ask the coordinator for a new one (:meth:`renew`)."""

    def renew(self, p2p: Any) -> None:
        """The coordinator's new peer-to-peer token (``POST /v1/p2p/token``'s ``p2p``)."""

    def pull(self, k: int, work: WorkAnswer) -> dict[str, torch.Tensor] | None:
        """A peer's hash-checked copy of the version ``work`` names (None: ask the coordinator)."""

    def offer(self, k: int, version: int, sha: str, weights: dict[str, torch.Tensor]) -> None:
        """This worker now holds version ``version`` of block k."""

    def reserve_s(self) -> float:
        """Seconds kept free before the push for the engine's own exchange."""

    def revoke(self, workers: tuple[str, ...]) -> None:
        """The quarantined workers the coordinator names: a group with one of them is not used."""

    def combine(self, delta: dict[str, torch.Tensor], samples: int, k: int, v: int, clock: RoundClock,
                each: int) -> Combined | None:
        """What to upload for round (k, v); None when another member of its group uploads it (``each``: the samples
        one member may claim, H x batch of the round)."""

    def waits_for_peers(self, v: int) -> bool:
        """Whether version v's delta went into a mean another member uploads (the worker need not ask yet)."""

    def wait_next(self, k: int, v: int, poll_s: float, lease_s: float, abandon: threading.Event) -> None:
        """Wait before asking the coordinator for work again."""

    def close(self) -> None: ...


class DirectEngine:
    """Push one's own delta; every version from the coordinator."""

    def register_key(self) -> str | None:
        return None

    def joined(self, p2p: Any, k: int, weights: dict[str, torch.Tensor], like: dict[str, torch.Tensor]) -> None:
        return None

    def token_due(self) -> bool:
        return False

    def renew(self, p2p: Any) -> None:
        return None

    def pull(self, k: int, work: WorkAnswer) -> dict[str, torch.Tensor] | None:
        return None

    def offer(self, k: int, version: int, sha: str, weights: dict[str, torch.Tensor]) -> None:
        return None

    def reserve_s(self) -> float:
        return 0.0

    def revoke(self, workers: tuple[str, ...]) -> None:
        return None

    def combine(self, delta: dict[str, torch.Tensor], samples: int, k: int, v: int, clock: RoundClock,
                each: int) -> Combined | None:
        return Combined(delta, samples)

    def waits_for_peers(self, v: int) -> bool:
        return False

    def wait_next(self, k: int, v: int, poll_s: float, lease_s: float, abandon: threading.Event) -> None:
        abandon.wait(poll_s)

    def close(self) -> None:
        return None


class HivemindEngine:
    """Group all-reduce on the run's hivemind DHT (``pip install 'blocktrain[hivemind]'``)."""

    def __init__(self, group_size: int, matchmaking_s: float, host: str, abandon: threading.Event) -> None:
        from blocktrain.p2p import require_hivemind

        require_hivemind()
        from hivemind.utils.crypto import RSAPrivateKey

        self.group_size, self.matchmaking_s, self.host, self.abandon = group_size, matchmaking_s, host, abandon
        self.key = RSAPrivateKey()  # this worker's identity on the DHT
        self.groups: Any = None  # the GroupAverager, once joined
        self.grouped_version = -1  # the version whose delta went into a group mean that another member uploads
        self.block = -1  # the block it registered on last
        self.peer_pulls = 0  # published versions fetched from a peer, not the coordinator
        self.rounds_grouped = 0  # rounds whose delta another member uploaded in its group's mean
        self.like: dict[str, torch.Tensor] = {}  # what the block's averager all-reduces: the delta and shared moments
        self.token_expires = float("inf")  # time.time() at which its DHT token expires
        self._token_asked = float("-inf")  # time.monotonic() it last found its token due

    def register_key(self) -> str | None:
        return str(self.key.get_public_key().to_bytes().decode())

    def joined(self, p2p: Any, k: int, weights: dict[str, torch.Tensor], like: dict[str, torch.Tensor]) -> None:
        """Join the run's DHT with the token the coordinator issued (once; a new registration renews the token)."""
        from blocktrain.p2p.groups import GroupAverager, join_dht
        from blocktrain.p2p.trust import PeerAuthorizer

        token, authority = _token(p2p)
        if self.groups is None:
            dht = join_dht(list(p2p["initial_peers"]), PeerAuthorizer(self.key, token, authority), self.host)
            self.groups = GroupAverager(dht, self.key, token, authority, str(p2p["run"]),
                                        target_group_size=self.group_size, matchmaking_s=self.matchmaking_s)
            log.info("joined the run's hivemind DHT as %s", self.groups.peer)
        else:
            self._renew_token(token)
        self.token_expires = _expires(token)
        if k != self.block:  # a round grouped on the block held before is not this block's (on the same block its
            self.grouped_version = -1  # group's mean may still land: the worker waits for it)
        self.like, self.block = like, k
        self.groups.prepare(k, like, weights)  # the block it was (re)assigned

    def token_due(self) -> bool:
        from blocktrain.p2p.trust import RENEW_BEFORE_S

        if self.groups is None or self.token_expires - time.time() >= RENEW_BEFORE_S:
            return False
        if time.monotonic() - self._token_asked < RENEW_RETRY_S:  # asked lately, and the answer gave no new token
            return False
        self._token_asked = time.monotonic()
        return True

    def renew(self, p2p: Any) -> None:
        token, _ = _token(p2p)
        self._renew_token(token)
        self.token_expires = _expires(token)
        log.info("renewed the hivemind DHT token (valid %.1f days)", (self.token_expires - time.time()) / 86400)

    def _renew_token(self, token: bytes) -> None:
        try:
            self.groups.renew(token)
        except Exception as exc:  # a token that is none of ours, or a DHT process that did not take it in time
            raise ProtocolError(502, f"the new hivemind token was not taken: {type(exc).__name__}: {exc}",
                                Reason.P2P) from None

    def pull(self, k: int, work: WorkAnswer) -> dict[str, torch.Tensor] | None:
        """The first worker to ask about version v fetches at once (from the coordinator, if no peer has it); the
        others wait for a peer to offer it."""
        m = self.matchmaking_s
        pulled = self.groups.pull(k, work.version, work.weights_sha, timeout=m, wait_s=0.0 if work.fetch_first else 3.0 * m)
        self.peer_pulls += pulled is not None
        return pulled  # type: ignore[no-any-return]

    def offer(self, k: int, version: int, sha: str, weights: dict[str, torch.Tensor]) -> None:
        self.groups.share(k, version, sha, weights)  # peers may pull this version from us

    def reserve_s(self) -> float:
        """Matchmaking and the exchange."""
        return 3.0 * self.matchmaking_s

    def revoke(self, workers: tuple[str, ...]) -> None:
        """A quarantined worker's DHT token stays valid until it expires, so it may still find groups: its card no
        longer counts, and a group it joins is not used (its members upload alone, which the coordinator takes)."""
        if self.groups is not None:
            self.groups.revoke(frozenset(workers))

    def combine(self, delta: dict[str, torch.Tensor], samples: int, k: int, v: int, clock: RoundClock,
                each: int) -> Combined | None:
        self._await_peers(k, v, clock)
        budget = min(self.reserve_s(), clock.give_up_at + self.reserve_s() - time.monotonic())
        # the averager's tensors are fixed when it starts: a round that shares no moments fills their slots with
        # zeros, which every member of its group does alike, and drops them from the mean
        idle = {n: torch.zeros_like(t) for n, t in self.like.items() if n not in delta}
        group = self.groups.average({**delta, **idle}, samples, k, v, budget, each)
        if group is None:  # no group formed: push its own delta
            return Combined(delta, samples)
        if not group.uploader:
            self.grouped_version = v
            self.rounds_grouped += 1
            log.info("block %d v%d: averaged in a group of %d; its uploader sends the mean", k, v, len(group.members))
            return None
        return Combined({n: t for n, t in group.mean.items() if n not in idle}, group.samples, group.members)

    def _await_peers(self, k: int, v: int, clock: RoundClock) -> None:
        """Wait (heartbeating) until the block's other workers at this version have trained too, so that the
        round's group forms at once; at the latest when training would have had to stop."""
        give_up = min(clock.give_up_at, time.monotonic() + clock.lease_s)
        self.groups.mark_ready(k, v, give_up)
        while time.monotonic() < give_up and not self.abandon.is_set() and not self.groups.all_ready(k, v, give_up):
            clock.beat()
            self.abandon.wait(0.25)

    def waits_for_peers(self, v: int) -> bool:
        return self.grouped_version == v

    def wait_next(self, k: int, v: int, poll_s: float, lease_s: float, abandon: threading.Event) -> None:
        """A worker whose delta went into a group mean that another member sent watches the DHT for a peer that
        offers the next version instead of polling the coordinator (polls from every waiting member would grow
        the coordinator's traffic with the number of workers); it still asks at least every few seconds."""
        if self.grouped_version != v:
            abandon.wait(poll_s)
            return
        give_up = time.monotonic() + max(poll_s, min(lease_s / 3, 3.0 * self.matchmaking_s))
        while time.monotonic() < give_up and not abandon.is_set() and self.groups.newest_shared(k, give_up) <= v:
            abandon.wait(poll_s)

    def close(self) -> None:
        if self.groups is not None:
            self.groups.close()


def _token(p2p: Any) -> tuple[bytes, bytes]:
    """The DHT token and the authority key of a registration's (or a renewal's) ``p2p`` answer."""
    import base64
    import binascii

    if not isinstance(p2p, dict) or not {"token", "authority", "initial_peers", "run"} <= set(p2p):
        raise ProtocolError(502, "the coordinator's answer carries no hivemind token; it must run with --hivemind (or "
                            "use --averaging coordinator)", Reason.P2P)
    try:
        return base64.b64decode(str(p2p["token"]), validate=True), str(p2p["authority"]).encode()
    except binascii.Error:
        raise ProtocolError(502, "the coordinator's hivemind token is not base64", Reason.P2P) from None


def _expires(token: bytes) -> float:
    """When ``token`` expires (time.time()); -inf when it is not a token (it is then due at once)."""
    from blocktrain.p2p.trust import parse_token

    parsed = parse_token(token)
    try:
        return float(parsed.expiration_time) if parsed is not None else float("-inf")
    except ValueError:
        return float("-inf")
