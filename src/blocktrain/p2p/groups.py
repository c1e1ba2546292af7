"""One round's group all-reduce on hivemind: the workers of block k at version v average their deltas.

A worker joins the run's DHT once (:func:`join_dht`, authorised by the coordinator's token) and keeps one
hivemind averager per block it trains (a background process: hivemind's averagers are made to live long,
and one made and shut down every round leaves its in-flight DHT requests failing in the DHT process). Each
round, the workers of block k wait until every peer holding version v has trained (:meth:`GroupAverager.all_ready`),
then :meth:`GroupAverager.average` looks for peers under the block's key
(:func:`blocktrain.protocol.group.group_prefix`), all-reduces its delta with them (hivemind's butterfly
all-reduce: each peer sends and receives about twice the tensor, whatever the group size), and all-gathers
every member's card and samples. The mean is weighted by the samples each member claims in that all-gather:
each member sends s_i x Delta_i at weight 1, and the sum is divided by the claims' total. That makes the
weights the claims the others and the coordinator see, not hivemind's per-peer weight (a sender whose weight
is not 1 fails the group); it does not bound a member's influence: a member chooses its s_i x Delta_i (any
size) and, as a reducer, the mean of its slice, so the coordinator's loss gate on the mean is what limits a
member (a refused mean counts against every member of its group). A card is bound to the run, the block and
the version, so every member must be an admitted worker at the same version (:mod:`.trust`); otherwise, or when
no group forms in time, the worker uploads its own delta alone.

hivemind's all-reduce is used only whole, within bounds (:mod:`.averager`), and :meth:`GroupAverager.average`
gives up at its timeout whatever hivemind waits for. The member :func:`uploader_of` names (a hash of the round and its peer id, a
different member each round) uploads the group's mean; the others keep their delta until the mean lands, and
push it alone if it has not as the round's deadline nears.
"""

from __future__ import annotations

import hashlib
import logging
import time
from contextlib import suppress
from dataclasses import dataclass
from functools import partial
from typing import Any

import hivemind
import torch
from hivemind.utils.timed_storage import get_dht_time

from blocktrain.checkpoint.safetensors_io import tensors_sha256
from blocktrain.p2p.averager import BlockAverager, exchange_timeouts, start_quietly
from blocktrain.p2p.trust import Card, PeerAuthorizer, RSAPrivateKey, parse_token, verified_token
from blocktrain.protocol.delta import all_finite
from blocktrain.protocol.group import GroupMember, group_prefix, round_scope

log = logging.getLogger(__name__)

READY_TTL_S = 600.0  # seconds a worker's 'ready for round v' stays in the DHT
DHT_CALL_S = 10.0  # seconds a DHT get or store from the worker's own thread waits (hivemind's wait for ever)
STATE_SLACK_BYTES = 1 << 20  # bytes a peer's state may take beyond the block's fp32 weights (its metadata: names)


def claim_weighted(summed: dict[str, torch.Tensor], members: list[GroupMember]) -> dict[str, torch.Tensor]:
    """The sample-weighted mean sum_i s_i Delta_i / sum_i s_i, from the equal-weight all-reduce of s_i Delta_i
    ((1/n) sum_i s_i Delta_i over the n members, every sender at weight 1) and the samples s_i each member claimed
    in the all-gather.

    The claims set the weights the coordinator sees, not a bound on any member's pull on the mean: a member sends
    whatever s_i Delta_i it likes (a delta scaled up weighs as much more), so the coordinator's loss gate on the
    mean is the limit on a member's influence."""
    scale = len(members) / sum(m.samples for m in members)
    return {n: t * scale for n, t in summed.items()}


def uploader_of(members: list[GroupMember], scope: str) -> str:
    """The peer id of the member that uploads its group's mean, which every member computes alike: the smallest
    sha256 of (a seed, peer id), the seed hashed from the round's scope and the members' sorted peer ids. Nothing in
    it can be varied once the group forms: a peer id is its key's, which its coordinator token binds, and the scope
    changes every round, so no identity can be ground for it. (It was the smallest peer id, which one identity,
    ground once, won every round; then a seed from the members' proofs, which a member re-signs at will, since
    hivemind's RSA-PSS signatures are randomised, and the group's leader sees the others' before it sends its own.)"""
    seed = hashlib.sha256("\n".join([scope, *sorted(m.peer for m in members)]).encode()).digest()
    return min(members, key=lambda m: hashlib.sha256(seed + m.peer.encode()).digest()).peer


def join_dht(initial_peers: list[str], authorizer: PeerAuthorizer, host: str) -> hivemind.DHT:
    """A DHT peer of the run, listening on ``host`` (its port chosen by the system)."""
    return hivemind.DHT(initial_peers=initial_peers, start=True, host_maddrs=[f"/ip4/{host}/tcp/0"],
                        authorizer=authorizer)


@dataclass(frozen=True)
class GroupOutcome:
    mean: dict[str, torch.Tensor]  # the sample-weighted mean of the members' deltas
    members: list[GroupMember]  # every member, this worker included, sorted by peer id
    uploader: bool  # this worker sends the mean (the member :func:`uploader_of` names)

    @property
    def samples(self) -> int:
        return sum(m.samples for m in self.members)


def _call_timeout(deadline: float | None) -> float:
    """Seconds a DHT call from the worker's own thread waits: DHT_CALL_S, and never past ``deadline`` (time.monotonic;
    at least 50 ms, so that a call at the deadline can still answer)."""
    return DHT_CALL_S if deadline is None else min(DHT_CALL_S, max(0.05, deadline - time.monotonic()))


class GroupAverager:
    """This worker's side of the rounds' groups (see the module docstring)."""

    def __init__(self, dht: hivemind.DHT, key: RSAPrivateKey, token: bytes, authority: bytes, run: str, *,
                 target_group_size: int, matchmaking_s: float) -> None:
        self.dht = dht
        self.key = key
        self.token = token
        self.authority = authority
        self.run = run
        self.target_group_size = target_group_size  # peers per group at most
        self.matchmaking_s = matchmaking_s  # seconds a group waits for more peers before it starts
        self.peer = str(dht.peer_id)
        self._averager: BlockAverager | None = None
        self._block = -1  # the block its averager serves
        self._state_bytes = 0  # bytes a peer's copy of that block's weights may take (fp32, with its metadata)
        self._schema: dict[str, tuple[int, ...]] = {}  # that block's tensor names -> shapes: a peer's copy has these
        self._state: tuple[dict[str, Any], list[torch.Tensor]] = ({}, [])  # the weights it shares: (meta, tensors)
        self.revoked: frozenset[str] = frozenset()  # quarantined workers (the coordinator's work answer): no member

    def average(self, delta: dict[str, torch.Tensor], samples: int, k: int, v: int, timeout: float,
                each: int) -> GroupOutcome | None:
        """Average ``delta`` with this round's group within ``timeout`` seconds; None when no group of admitted peers
        at version v averaged every member's whole delta in that time (``each``: the samples a member may claim, H x
        batch of the round: a group where one claims more is not used, as the coordinator would refuse its mean).

        hivemind's step bounds only its matchmaking by its timeout, and waits for the all-reduce as long as a member
        stalls it: the step is cancelled when ``timeout`` runs out (hivemind's own all-reduce timeout then ends it in
        the averager's process), and a step never retries (the tensors are averaged in place, one at a time: a
        retry would average a half-averaged mixture with a new group)."""
        give_up = time.monotonic() + timeout
        if timeout <= self.matchmaking_s:
            return None
        names = sorted(delta)
        scope = round_scope(self.run, k, v)
        try:
            averager = self._averager_for(k, delta)
            card = Card.make(self.key, self.token, self.peer, scope)
            with averager.tensors_within(give_up - time.monotonic()) as shared:
                for t, n in zip(shared, names, strict=True):
                    t.copy_(delta[n]).mul_(float(samples))  # s_i x Delta_i; the weights come from the claims below
            left = give_up - time.monotonic()
            if left <= self.matchmaking_s:  # hivemind's step needs a whole matchmaking window before its deadline
                log.info("block %d v%d: no time left to look for a group; uploading alone", k, v)
                return None
            control: Any = averager.step(gather={"token": card.token, "proof": card.proof, "samples": samples},
                                         weight=1.0, timeout=left, allow_retries=False, wait=False)
            try:
                gathered: Any = control.result(timeout=max(0.0, give_up - time.monotonic()))
            except TimeoutError:
                control.cancel()
                log.warning("block %d v%d: the group did not finish averaging in %.1f s; uploading alone", k, v, timeout)
                return None
            if not gathered:
                log.info("block %d v%d: no group formed in %.0f s; uploading alone", k, v, timeout)
                return None
            with averager.tensors_within(give_up - time.monotonic()) as shared:
                summed = {n: t.detach().clone() for n, t in zip(names, shared, strict=True)}  # (1/n) sum_i s_i Delta_i
        except Exception as exc:  # hivemind raises many kinds on a failed round (PartialGroupError among them)
            log.warning("block %d v%d: group averaging failed (%s: %s); uploading alone", k, v, type(exc).__name__, exc)
            return None
        members = self._members(gathered, scope, each)  # a card for another version or run does not verify either
        if members is None or len(members) < 2:
            return None
        if not all_finite(summed.values()):  # a member sent NaN or inf: the
            log.warning("block %d v%d: the group's mean holds NaN or infinite values (a member sent them); uploading "
                        "alone", k, v)  # coordinator would refuse it, counted against its honest uploader
            return None
        return GroupOutcome(claim_weighted(summed, members), members, uploader=uploader_of(members, scope) == self.peer)

    def share(self, k: int, v: int, sha: str, weights: dict[str, torch.Tensor]) -> None:
        """Offer block k's published weights at version v (sha256 ``sha``) to peers that pull them."""
        names = sorted(weights)
        averager = self._averager_for(k, weights)
        self._state = ({"block": k, "version": v, "sha": sha, "names": names}, [weights[n] for n in names])
        averager.state_sharing_priority = float(v)  # peers download from the newest version first
        averager.allow_state_sharing = True

    def prepare(self, k: int, like: dict[str, torch.Tensor], shared: dict[str, torch.Tensor] | None = None) -> None:
        """Start block k's averager, so this worker can pull before it trains: ``like``, what its rounds average (the
        delta, and the inner moments where they are shared); ``shared``, the block's weights, what peers offer and
        pull (default ``like``; a copy holding the moments' names too was refused by every pull's check of names and
        shapes)."""
        self._averager_for(k, like, shared)

    def pull(self, k: int, v: int, sha: str, timeout: float, wait_s: float = 0.0) -> dict[str, torch.Tensor] | None:
        """Block k's weights at version v from a peer that has them, if their sha256 is ``sha`` (else None).

        A peer that offers version v is waited for up to ``wait_s`` seconds: the worker that sent the round's
        update fetches the new version from the coordinator at once and offers it, and the others take it from
        it (and then from one another)."""
        if self._averager is None or self._block != k:
            return None
        give_up = time.monotonic() + wait_s
        while self.newest_shared(k, give_up) < v:  # no peer has it yet: downloading an older version would be wasted
            if time.monotonic() >= give_up:
                return None
            time.sleep(0.25)
        try:
            got = self._averager.pull_state(v, self._state_bytes, timeout)
        except Exception as exc:  # a failed download: the coordinator serves the version
            log.info("block %d: no peer served v%d (%s)", k, v, exc)
            return None
        if not got:
            return None
        meta, tensors = got
        if not isinstance(meta, dict) or meta.get("version") != v or meta.get("block") != k:
            return None
        names = meta.get("names")
        if not isinstance(names, list) or len(names) != len(tensors):
            return None
        weights = {str(n): t.float().contiguous() for n, t in zip(names, tensors, strict=True)}
        if {n: tuple(t.shape) for n, t in weights.items()} != self._schema:  # before its digest: only the block's names
            log.warning("block %d: a peer's v%d does not have the block's tensor names and shapes; pulling from the "
                        "coordinator", k, v)
            return None
        if tensors_sha256(weights) != sha:
            log.warning("block %d: a peer's v%d does not match the coordinator's sha256; pulling from the coordinator",
                        k, v)
            return None
        return weights

    def newest_shared(self, k: int, deadline: float | None = None) -> float:
        """The newest version of block k a peer offers; -1 when none does (or the DHT did not say by ``deadline``)."""
        me = self.dht.peer_id.to_bytes()
        return max((v for peer, v in self._versions(f"{group_prefix(self.run, k)}.all_averagers", deadline).items()
                    if peer != me), default=-1.0)

    def mark_ready(self, k: int, v: int, deadline: float | None = None) -> None:
        """Say that this worker has trained block k's round v and is about to look for its group (the store waited
        for DHT_CALL_S at most, never past ``deadline``, time.monotonic)."""
        future = self.dht.store(f"{group_prefix(self.run, k)}.ready", subkey=self.dht.peer_id.to_bytes(), value=v,
                                expiration_time=get_dht_time() + READY_TTL_S, return_future=True)
        try:
            future.result(timeout=_call_timeout(deadline))
        except Exception as exc:  # a busy or dead DHT process: its peers wait for it no longer than their deadline
            log.warning("block %d v%d: could not say so in the DHT (%s: %s)", k, v, type(exc).__name__, exc)

    def all_ready(self, k: int, v: int, deadline: float | None = None) -> bool:
        """Whether every peer that holds block k at version v has said it is ready (:meth:`mark_ready`).

        A group forms from the peers that look for it within one matchmaking window; a worker that starts
        looking later finds the group gone and forms another, so the workers of a round wait for one another
        first (hivemind's own optimizer waits on its progress tracker likewise). ``deadline`` (time.monotonic): when
        the caller stops waiting; the DHT's answers are waited for no later."""
        prefix = group_prefix(self.run, k)
        holding = {peer for peer, at in self._versions(f"{prefix}.all_averagers", deadline).items() if at == v}
        ready = {peer for peer, at in self._versions(f"{prefix}.ready", deadline).items() if at == v}
        return holding <= ready | {self.dht.peer_id.to_bytes()}

    def _versions(self, key: str, deadline: float | None = None) -> dict[bytes, float]:
        """Peer id (bytes) -> the number each peer stored under ``key``'s subkeys (hivemind's averagers declare
        their state-sharing priority, here the version they share, under ``PREFIX.all_averagers``). The DHT's answer
        is waited for DHT_CALL_S at most, and never past ``deadline`` (time.monotonic): a busy DHT process took a
        caller's loop up to two such calls past its own give-up time."""
        try:
            found = self.dht.get(key, latest=True, return_future=True).result(timeout=_call_timeout(deadline))
        except Exception as exc:  # a busy or dead DHT process: as if no peer had said anything (the callers poll)
            log.warning("the DHT did not answer for %s (%s: %s)", key, type(exc).__name__, exc)
            return {}
        entries = found.value if found is not None and isinstance(found.value, dict) else {}
        return {peer: float(e.value) for peer, e in entries.items()
                if isinstance(peer, bytes) and isinstance(getattr(e, "value", None), int | float)}

    def _averager_for(self, k: int, like: dict[str, torch.Tensor],
                      shared: dict[str, torch.Tensor] | None = None) -> BlockAverager:
        """The long-lived averager of block k (one per block: hivemind's averager is a process, made once), its
        all-reduce bounded (:func:`exchange_timeouts`); ``like``: the tensors it averages by name (their shapes);
        ``shared``: the weights peers offer one another (default ``like``)."""
        if self._averager is not None and self._block == k:
            return self._averager
        self.close_averager()
        averager = BlockAverager(
            [like[n].detach().float().clone().contiguous() for n in sorted(like)], self.dht, prefix=group_prefix(self.run, k),
            target_group_size=self.target_group_size, min_matchmaking_time=self.matchmaking_s,
            request_timeout=min(1.0, self.matchmaking_s / 3), daemon=True, start=False, allow_state_sharing=False,
            shared=lambda: self._state, **exchange_timeouts(self.matchmaking_s))
        try:
            start_quietly(averager)
        except BaseException:
            if averager.is_alive():  # started, not ready in time: no process is left behind
                with suppress(Exception):  # the start's own error is the one to raise
                    averager.shutdown()
            raise
        self._averager, self._block = averager, k
        shared = like if shared is None else shared
        self._schema = {n: tuple(t.shape) for n, t in shared.items()}
        self._state_bytes = 4 * sum(t.numel() for t in shared.values()) + STATE_SLACK_BYTES
        return averager

    def renew(self, token: bytes, timeout_s: float = 30.0) -> None:
        """The coordinator's new token for this worker's key: its DHT process signs with it (waited for at most
        ``timeout_s``), then its cards carry it. ValueError when it is no token of this worker's key."""
        parsed = parse_token(token)
        if (parsed is None or not verified_token(parsed, self.authority)
                or parsed.public_key != self.key.get_public_key().to_bytes()):
            raise ValueError("the coordinator's new access token does not verify against its authority key, or names "
                             "another key")
        self.dht.run_coroutine(partial(_renew_in_dht, token), return_future=True).result(timeout=timeout_s)
        self.token = token

    def revoke(self, workers: frozenset[str]) -> None:
        """Quarantined workers (the coordinator's work answer): no member of a group this worker uses, and refused by
        its DHT process (pushed there when the list changes; a failure is logged and tried at the next change)."""
        if workers == self.revoked:
            return
        self.revoked = workers
        try:
            revoke_in(self.dht, workers)
        except Exception as exc:  # the DHT process busy or gone: its groups still drop their cards
            log.warning("could not hand the revoked workers to the DHT process: %s", exc)

    def close_averager(self) -> None:
        if self._averager is not None:
            self._averager.shutdown()
            self._averager = None

    def close(self) -> None:
        self.close_averager()
        self.dht.shutdown()

    def _members(self, gathered: dict[Any, Any], scope: str, each: int) -> list[GroupMember] | None:
        """Every member's entry, if every card verifies, names no quarantined worker and no worker twice, and each
        claims at most ``each`` samples (else None: the mean is not used, this worker uploads alone; its uploader
        would take the coordinator's refusal for what another member claimed)."""
        members: list[GroupMember] = []
        for peer_id, data in gathered.items():
            peer = str(peer_id)
            ok = isinstance(data, dict) and isinstance(data.get("samples"), int) and data["samples"] > 0
            card = Card(data.get("token", b""), data.get("proof", b"")) if ok else None
            worker = card.worker(peer, scope, self.authority) if card is not None else None
            if card is None or worker is None:
                log.warning("group peer %s has no valid card from the coordinator; its group's mean is discarded "
                            "and this worker uploads alone", peer)
                return None
            if worker in self.revoked:  # its token still opens the DHT; the coordinator would refuse the mean whole
                log.warning("group peer %s is quarantined worker %r; its group's mean is discarded and this worker "
                            "uploads alone", peer, worker)
                return None
            if data["samples"] > each or any(m.worker == worker for m in members):
                log.warning("group peer %s (worker %r) claims %d samples (at most %d) or is in the group twice; its "
                            "group's mean is discarded and this worker uploads alone", peer, worker, data["samples"], each)
                return None
            members.append(GroupMember(peer, int(data["samples"]), worker, card.proof))
        return sorted(members, key=lambda m: m.peer)


def revoke_in(dht: hivemind.DHT, workers: frozenset[str], timeout_s: float | None = 10.0) -> None:
    """The DHT process of ``dht`` refuses the requests of ``workers`` (quarantined: their tokens stay valid until
    they expire, and opened the DHT meanwhile; a hostile one could stall every group by announcing itself); waited
    for at most ``timeout_s`` (None: not waited for, from under a lock)."""
    future = dht.run_coroutine(partial(_revoke_in_dht, workers), return_future=True)
    if timeout_s is not None:
        future.result(timeout=timeout_s)


async def _revoke_in_dht(workers: frozenset[str], dht: hivemind.DHT, node: Any) -> None:
    """In the DHT's own process (``DHT.run_coroutine``): its authoriser refuses ``workers``' tokens from now on."""
    authorizer = node.protocol.authorizer
    if not isinstance(authorizer, PeerAuthorizer):
        raise TypeError(f"this DHT signs with {type(authorizer).__name__}, not BlockTrain's PeerAuthorizer")
    authorizer.revoked = workers


async def _renew_in_dht(token: bytes, dht: hivemind.DHT, node: Any) -> None:
    """In the DHT's own process (``DHT.run_coroutine``): its authoriser signs with ``token`` from now on."""
    authorizer = node.protocol.authorizer
    if not isinstance(authorizer, PeerAuthorizer):
        raise TypeError(f"this DHT signs with {type(authorizer).__name__}, not BlockTrain's PeerAuthorizer")
    authorizer.renew(token)
