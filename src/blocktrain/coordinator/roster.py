"""The coordinator's workers: registration, leases, assignment to blocks, and what each is told to do.

A worker registers (checked against the run: its dataset's fingerprint, the block it asks for, quarantine), is
assigned a block (the one it pins, the one it had, or the open block with the fewest live replicas) and holds a
lease it renews with every heartbeat or work request; a lapsed lease takes it out of its round's quorum. Under
every schedule an unpinned worker on a waiting or finished block moves to an open one. The work answer
names the block, version, data stream and deadline of the worker's round. State lives in the ``workers`` table
(:class:`.tables.WorkerTable`); the rounds themselves are :mod:`.rounds`'. Every method is called under the
coordinator's lock.
"""

from __future__ import annotations

import logging

from blocktrain.config import RunConfig
from blocktrain.coordinator.checkpoints import Checkpoints
from blocktrain.coordinator.conduct import Conduct
from blocktrain.coordinator.groups import PeerHub
from blocktrain.coordinator.rounds import Rounds
from blocktrain.coordinator.rows import WorkerRow
from blocktrain.coordinator.settings import CoordinatorSettings, WorkerState
from blocktrain.coordinator.store import Store
from blocktrain.errors import ProtocolError
from blocktrain.protocol.codes import BlockState, Reason, RoundState
from blocktrain.protocol.messages import (
    CLOCK_SKEW_S,
    MAX_REVOKED,
    P2P_TOKEN_TTL_S,
    Heartbeat,
    P2PToken,
    Registration,
    WorkAnswer,
)
from blocktrain.seeds import worker_stream

log = logging.getLogger(__name__)


class Roster:
    """Registration, leases and assignment of the workers of one coordinator."""

    def __init__(self, cfg: RunConfig, settings: CoordinatorSettings, store: Store, rounds: Rounds,
                 checkpoints: Checkpoints, conduct: Conduct, hub: PeerHub | None) -> None:
        self.cfg, self.settings, self.store, self.rounds = cfg, settings, store, rounds
        self.checkpoints, self.conduct, self.hub = checkpoints, conduct, hub
        self.n_blocks = cfg.model.n_blocks

    def live_replicas(self, now: float) -> dict[int, set[str]]:
        """Block -> names of the active workers on it that hold a lease at ``now``."""
        return self.store.workers.live_by_block(self.n_blocks, now)

    def get(self, name: str) -> WorkerRow:
        """The row of registered worker ``name``; 409 if it is not registered."""
        row = self.store.workers.worker(name)
        if row is None or row.block is None:
            raise ProtocolError(409, f"worker {name!r} is not registered; POST /v1/register first", Reason.NOT_REGISTERED)
        return row

    def register(self, name: str, block: int | None, now: float, dataset: str | None = None,
                 p2p_key: str | None = None) -> Registration:
        """Assign ``name`` a block; ``dataset`` is the fingerprint of the worker's data (checked against the run's);
        ``p2p_key``: the worker averages on hivemind with this RSA key, and is issued a token for it."""
        if self.conduct.quarantined(name):
            raise ProtocolError(403, f"worker {name!r} is quarantined: its updates (or group means it was a member "
                                "of) were refused too often; ask the run's operator", Reason.QUARANTINED)
        if p2p_key is not None and self.hub is None:
            raise ProtocolError(409, "this coordinator does not host hivemind averaging; start it with --hivemind, "
                                "or run the worker with --averaging coordinator", Reason.HIVEMIND_OFF)
        if block is not None and not 0 <= block < self.n_blocks:
            raise ProtocolError(422, f"block {block} does not exist; this run has B={self.n_blocks} (0..{self.n_blocks - 1})", Reason.BLOCK)
        if self.cfg.dataset and dataset != self.cfg.dataset:
            have = f"dataset {dataset[:12]}" if dataset else "no dataset fingerprint"
            raise ProtocolError(
                409,
                f"worker {name!r} has {have}, but this run trains on dataset {self.cfg.dataset[:12]} "
                f"(fingerprint {self.cfg.dataset}); point --data at the same prepared directory as the coordinator's "
                "(compare 'fingerprint' in its manifest.json)",
                Reason.DATASET,
            )
        row = self.store.workers.worker(name)
        if block is None and row is not None and row.block is not None and not self._should_move(row.block):
            k = row.block  # a returning worker keeps its block (stack: while it is open)
        elif block is None:
            k = self._least_replicated(name, now)
        else:
            k = block
        # a key that is no key is refused before anything is stored (else a live replica its rounds waited for)
        p2p = self.hub.admit(name, p2p_key) if self.hub is not None and p2p_key is not None else None
        lease = now + self.settings.lease_seconds
        with self.store.tx():
            self.store.workers.register_worker(name, k, block is not None, now, lease, hivemind=p2p_key is not None)
        state = self.rounds.state[k]
        message = self.rounds.state_message(k)
        log.info("worker %s registered on block %d (%s)%s", name, k, state.value, f": {message}" if message else "")
        return Registration(
            worker=name, block=k, block_state=state, message=message, config=self.cfg.to_json(),
            lease_seconds=self.settings.lease_seconds,
            rounds=self.rounds.block_rounds(k),  # this block's rounds (a stack's step split gives each block its own)
            n_blocks=self.n_blocks, local_steps=self.rounds.local_steps(k), inner_start=self.settings.inner_start,
            moment_codec=self.settings.moment_codec, moment_every=self.settings.moment_every,
            p2p=p2p,
        )

    def _least_replicated(self, name: str, now: float) -> int:
        """The block with the fewest live replicas other than ``name`` (stack: among the open blocks, if any)."""
        live = self.live_replicas(now)
        live = {b: {w for w in names if w != name} for b, names in live.items()}
        candidates = self.rounds.open_blocks() or list(range(self.n_blocks))
        return min(candidates, key=lambda b: (len(live[b]), b))

    def _should_move(self, k: int) -> bool:
        """An unpinned worker leaves a waiting or finished block k for an open one (in every schedule: a diffusion
        run's blocks all open at once, and a worker whose block finished moves to one that still trains)."""
        return self.rounds.state[k] is not BlockState.OPEN and bool(self.rounds.open_blocks())

    def renew_p2p(self, name: str) -> P2PToken:
        """A new DHT token for registered worker ``name``'s key (a token lasts P2P_TOKEN_TTL_S), without a new
        session: its inner state and lineage go on. 409 when it did not register this session to average in groups."""
        row = self.get(name)
        if self.conduct.quarantined(name):  # under the lock: every token of a quarantined worker predates it
            raise ProtocolError(403, f"worker {name!r} is quarantined: no new token", Reason.QUARANTINED)
        if row.state is not WorkerState.ACTIVE:
            raise ProtocolError(409, f"worker {name!r} holds no lease ({row.state.value}); POST /v1/register again",
                                Reason.NOT_REGISTERED)
        key = self.store.meta.get_meta(f"p2p_key:{name}")
        if self.hub is None or key is None or not self.store.workers.averages_in_groups(name):
            raise ProtocolError(409, f"worker {name!r} did not register to average in hivemind groups; register with "
                                "--averaging hivemind first", Reason.HIVEMIND_OFF)
        return P2PToken(p2p=self.hub.reissue(name, key))

    def heartbeat(self, name: str, now: float) -> Heartbeat:
        self.get(name)
        with self.store.tx():
            self.store.workers.renew_lease(name, now + self.settings.lease_seconds)
        return Heartbeat(lease_seconds=self.settings.lease_seconds)

    def leave(self, name: str) -> None:
        """``name`` gives its lease back (the front then checks its block's quorum)."""
        self.get(name)
        with self.store.tx():
            self.store.workers.worker_left(name)
        log.info("worker %s left", name)

    def lapse(self, now: float) -> None:
        """Workers whose lease expired leave their rounds (call under the lock)."""
        lapsed = self.store.workers.expired_leases(now)
        if lapsed:
            with self.store.tx():
                for name in lapsed:
                    self.store.workers.lapse_worker(name)
                    log.warning("worker %s: lease lapsed; it leaves the round", name)

    def work(self, name: str, now: float) -> WorkAnswer:
        """Renew the lease and say what to do: block, version, data stream, deadline."""
        rounds, ck = self.rounds, self.checkpoints
        row = self.get(name)
        k = row.block
        assert k is not None  # get() refuses a worker with no block
        if not row.pinned and self._should_move(k):
            old, k = k, self._least_replicated(name, now)  # its block is waiting or finished: move it
            with self.store.tx():
                self.store.workers.move_worker(name, k)
            log.info("worker %s moved from block %d (%s) to open block %d", name, old, rounds.state[old].value, k)
        current = ck.current(k)
        rnd = self.store.rounds.round(k, current.version)
        block_state = rounds.state[k]
        state = rounds.round_state(k, rnd)  # WAITING: no round yet, or one held until its block is warm-started
        stream = worker_stream(row.id, k, current.version)
        submitted = self.store.updates.submitted(k, current.version, name)
        in_groups = self.store.workers.averages_in_groups(name)
        # a quarantine older than a DHT token's life (and a peer's clock skew) needs no naming: every token its worker
        # held has expired, on any peer's clock (tokens are issued at registration and renewal, both refused to a
        # quarantined worker under the lock: every token predates its quarantine)
        since = now - P2P_TOKEN_TTL_S - CLOCK_SKEW_S
        revoked = tuple(self.store.conduct.revoked_peers(MAX_REVOKED, since)) if in_groups else ()
        with self.store.tx():
            self.store.workers.renew_lease(name, now + self.settings.lease_seconds)
            if state is RoundState.OPEN:
                self.store.updates.record_seed(name, k, current.version, self.cfg.train.seed, stream)
        return WorkAnswer(
            block=k, version=current.version, weights_sha=current.sha, block_state=block_state,
            message=rounds.state_message(k),
            frozen=rounds.frozen_refs(k),  # the finished blocks block k reads
            round_state=state,
            deadline_in=(rnd.deadline - now) if rnd is not None else 0.0,
            seed=self.cfg.train.seed, stream=stream,
            steps=rounds.local_steps(k), batch=self.cfg.train.batch_size,  # the budget: steps x batch samples
            submitted=submitted,
            fetch_first=ck.take_first_fetch(k),  # the first to ask about this version (hivemind workers)
            revoked=revoked,  # hivemind workers: whose group cards no longer count
            finished=block_state is BlockState.FINISHED,  # this worker's block has no more rounds
        )
