"""The coordinator service: worker identities, leases, assignment, update intake, accounting.

Builds on :class:`.blocks.BlockRounds` (versions, rounds, aggregation). Every
update is validated (:mod:`.validate`), checked against the block's version,
the intake (budget, base, norms, replays, the loss gate: :mod:`.intake`), stored durably and only then
acknowledged; every rejection is logged, counted and answered with a 4xx.
Rejections of authenticated workers are stored; those of requests without a
valid token are only counted in memory (and logged at a limited rate).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from blocktrain.config import RunConfig
from blocktrain.coordinator.audit import Auditor
from blocktrain.coordinator.blobs import StagedBlob
from blocktrain.coordinator.blocks import BlockRounds
from blocktrain.coordinator.groups import PeerHub, check_members
from blocktrain.coordinator.intake import Checked, Published
from blocktrain.coordinator.settings import BlockState, CoordinatorSettings, RoundState
from blocktrain.coordinator.store import hash_token
from blocktrain.coordinator.validate import ParsedUpdate, parse_update
from blocktrain.data.dataset import DataDir
from blocktrain.data.stream import mix_seed
from blocktrain.errors import ProtocolError
from blocktrain.protocol.messages import AuditAnswer, FrozenRef, PushAnswer, Registration, WorkAnswer

log = logging.getLogger(__name__)

TOKEN_RELOAD_SECONDS = 1.0  # seconds between re-reads of the token table caused by unknown tokens
UNAUTH_LOG_SECONDS = 10.0  # at most one log line per this many seconds about unauthenticated updates


class Coordinator(BlockRounds):
    """All coordinator logic, independent of HTTP (the app in :mod:`.app` is a thin layer)."""

    def __init__(
        self,
        run_dir: Path,
        cfg: RunConfig,
        settings: CoordinatorSettings,
        data: DataDir | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._tokens: dict[str, str] = {}  # token hash -> worker name
        self._last_token_reload = float("-inf")  # time.monotonic() of the last re-read of the token table
        self._bytes_lock = threading.Lock()
        self._pending_bytes: dict[str | None, list[int]] = {}
        self._route_bytes: dict[str, list[int]] = {}  # route kind -> [in, out], not yet stored
        self._unauth_lock = threading.Lock()
        self._unauth_counts: dict[str, int] = {}  # reason -> refused unauthenticated updates (never stored)
        self._unauth_logged = float("-inf")  # time.monotonic() of the last log line about them
        self._unauth_quiet = 0  # refusals not logged since that line
        super().__init__(run_dir, cfg, settings, data, clock)
        self.auditor = Auditor(self.cfg, self.settings, data)  # replays a sampled fraction of accepted pushes
        with self.lock:
            self._reload_tokens()
        # the hivemind engine's authority and bootstrap peer (coordinator.groups)
        self.hub: PeerHub | None = PeerHub(self.run.root, self.store, settings.hivemind_host) if settings.hivemind else None

    def _reload_tokens(self) -> None:
        self._tokens = {h: name for name, h in self.store.token_hashes()}

    def worker_for_token(self, token: str) -> str | None:
        """Constant-time comparison against every stored hash; None if unknown."""
        h = hash_token(token)
        found = None
        for known, name in list(self._tokens.items()):
            if hmac.compare_digest(h, known):
                found = name
        return found

    def authenticate(self, token: str | None) -> str:
        if not token:
            raise ProtocolError(401, "missing bearer token; send 'Authorization: Bearer <token>'", "auth")
        name = self.worker_for_token(token)
        if name is not None and name in self.conduct.revoked:  # quarantined since its token was cached
            with self.lock:
                self._reload_tokens()
            name = None
        now = time.monotonic()
        if name is None and now - self._last_token_reload >= TOKEN_RELOAD_SECONDS:
            # A token may have been added by 'blocktrain token add' while we run; re-read the table,
            # at most once per TOKEN_RELOAD_SECONDS so unknown tokens cannot hammer the database.
            with self.lock:
                self._last_token_reload = now
                self._reload_tokens()
            name = self.worker_for_token(token)
        if name is None:
            with self.lock:
                revoked = self.store.quarantined_token(hash_token(token))
            if revoked is not None:
                raise ProtocolError(403, f"worker {revoked!r} is quarantined and its token revoked: its updates were "
                                    "refused too often for what they are or do; ask the run's operator", "quarantined")
            raise ProtocolError(401, "unknown bearer token; create one with 'blocktrain token add NAME'", "auth")
        return name

    def add_token(self, name: str) -> str:
        with self.lock:
            token = self.store.add_token(name, self.clock())
            self._reload_tokens()
            return token

    def register(self, name: str, block: int | None, dataset: str | None = None,
                 p2p_key: str | None = None) -> dict[str, Any]:
        """Assign ``name`` a block; ``dataset`` is the fingerprint of the worker's data (checked against the run's);
        ``p2p_key``: the worker averages on hivemind with this RSA key, and is issued a token for it."""
        with self.lock:  # every use of the store is under the lock
            if self.conduct.quarantined(name):
                raise ProtocolError(403, f"worker {name!r} is quarantined: its updates (or group means it was a member "
                                    "of) were refused too often; ask the run's operator", "quarantined")
        if p2p_key is not None and self.hub is None:
            raise ProtocolError(409, "this coordinator does not host hivemind averaging; start it with --hivemind, "
                                "or run the worker with --averaging coordinator", "hivemind_off")
        if block is not None and not 0 <= block < self.n_blocks:
            raise ProtocolError(
                422, f"block {block} does not exist; this run has B={self.n_blocks} (0..{self.n_blocks - 1})", "block"
            )
        if self.cfg.dataset and dataset != self.cfg.dataset:
            have = f"dataset {dataset[:12]}" if dataset else "no dataset fingerprint"
            raise ProtocolError(
                409,
                f"worker {name!r} has {have}, but this run trains on dataset {self.cfg.dataset[:12]} "
                f"(fingerprint {self.cfg.dataset}); point --data at the same prepared directory as the coordinator's "
                "(compare 'fingerprint' in its manifest.json)",
                "dataset",
            )
        with self.lock:
            now = self.clock()
            row = self.store.worker(name)
            if block is None and row is not None and row["block"] is not None and not self._should_move(int(row["block"])):
                k = int(row["block"])  # a returning worker keeps its block (stack: while it is open)
            elif block is None:
                k = self._least_replicated(name, now)
            else:
                k = block
            lease = now + self.settings.lease_seconds
            with self.store.tx():
                self.store.register_worker(name, k, block is not None, now, lease)
            state = self.state[k]
            message = self.state_message(k)
            log.info("worker %s registered on block %d (%s)%s", name, k, state.value, f": {message}" if message else "")
            return Registration(
                worker=name, block=k, block_state=state.value, message=message, config=self.cfg.to_json(),
                lease_seconds=self.settings.lease_seconds,
                rounds=self.block_rounds(k),  # this block's rounds (a stack's step split gives each block its own)
                n_blocks=self.n_blocks, local_steps=self.settings.local_steps, inner_reset=self.settings.inner_reset,
                p2p=self.hub.admit(name, p2p_key) if self.hub is not None and p2p_key is not None else None,
            ).model_dump(mode="json", exclude_none=True)

    def _least_replicated(self, name: str, now: float) -> int:
        """The block with the fewest live replicas other than ``name`` (stack: among the open blocks, if any)."""
        live = self.live_replicas(now)
        live = {b: {w for w in names if w != name} for b, names in live.items()}
        candidates = (self.open_blocks() if self.progressive else []) or list(range(self.n_blocks))
        return min(candidates, key=lambda b: (len(live[b]), b))

    def _should_move(self, k: int) -> bool:
        """Progressive schedule: an unpinned worker leaves a waiting or finished block k for an open one."""
        return self.progressive and self.state[k] is not BlockState.OPEN and bool(self.open_blocks())

    def _worker(self, name: str) -> Any:
        row = self.store.worker(name)
        if row is None or row["block"] is None:
            raise ProtocolError(409, f"worker {name!r} is not registered; POST /v1/register first", "not_registered")
        return row

    def heartbeat(self, name: str) -> dict[str, Any]:
        with self.lock:
            self._worker(name)
            now = self.clock()
            with self.store.tx():
                self.store.renew_lease(name, now + self.settings.lease_seconds)
            return {"lease_seconds": self.settings.lease_seconds}

    def leave(self, name: str) -> None:
        with self.lock:
            self._worker(name)
            with self.store.tx():
                self.store.worker_left(name)
            log.info("worker %s left", name)
            self._check_quorum(self.clock())

    def work(self, name: str) -> dict[str, Any]:
        """Renew the lease and say what to do: block, version, data stream, deadline."""
        with self.lock:
            row = self._worker(name)
            now = self.clock()
            k = int(row["block"])
            if not row["pinned"] and self._should_move(k):
                old, k = k, self._least_replicated(name, now)  # its block is waiting or finished: move it
                with self.store.tx():
                    self.store.move_worker(name, k)
                log.info("worker %s moved from block %d (%s) to open block %d", name, old, self.state[old].value, k)
            v = self.version[k]
            rnd = self.store.round(k, v)
            block_state = self.state[k]
            state = RoundState(rnd["state"]) if rnd is not None else RoundState.FINISHED
            stream = mix_seed(int(row["id"]), k, v)
            submitted = self.store.submitted(k, v, name)
            with self.store.tx():
                self.store.renew_lease(name, now + self.settings.lease_seconds)
                if state is RoundState.OPEN:
                    self.store.record_seed(name, k, v, self.cfg.train.seed, stream)
            return WorkAnswer(
                block=k, version=v, weights_sha=self.weights_sha[k], block_state=block_state.value,
                message=self.state_message(k),
                frozen=tuple(FrozenRef(**r) for r in self.frozen_refs(k)),  # the finished blocks block k reads
                # a waiting block has no round yet
                round_state=BlockState.WAITING.value if block_state is BlockState.WAITING else state.value,
                deadline_in=(float(rnd["deadline"]) - now) if rnd is not None else 0.0,
                seed=self.cfg.train.seed, stream=stream,
                steps=self.settings.local_steps, batch=self.cfg.train.batch_size,  # the budget: steps x batch samples
                submitted=submitted,
                fetch_first=self.take_first_fetch(k),  # the first to ask about this version (hivemind workers)
                finished=block_state is BlockState.FINISHED,  # this worker's block has no more rounds
            ).model_dump(mode="json")

    def submit(self, name: str, k: int, body: bytes) -> dict[str, Any]:
        """Validate and store one update; close the round if that makes a quorum."""
        try:
            return self._submit(name, k, body)
        except ProtocolError as exc:
            self.record_rejection(name, k, exc)
            raise

    def _submit(self, name: str, k: int, body: bytes) -> dict[str, Any]:
        self._check_block(k)
        arrived = self.clock()
        with self.lock:
            row = self._worker(name)
            self.conduct.admit(name)  # 403 quarantined, 429 over its refusal rate
            if int(row["block"]) != k:
                raise ProtocolError(
                    403, f"worker {name!r} is assigned to block {row['block']}, not {k}; GET /v1/work", "wrong_block"
                )
        if len(body) > self.max_body_bytes:
            raise ProtocolError(
                413, f"update of {len(body)} bytes exceeds the cap of {self.max_body_bytes}", "too_large"
            )
        upd = parse_update(body, k, self.block_shapes[k])
        if self.auditor.enabled and not upd.group and upd.state_sha is None:
            raise ProtocolError(422, "this coordinator audits updates: an update must name the sha256 of the worker's "
                                "inner state at the round's start (state_sha); run the same BlockTrain version", "commitment")
        with self.lock:
            self._check_version(k, upd.base_version)
            if self.store.update_blob(k, upd.base_version, name) == hashlib.sha256(body).hexdigest():
                return PushAnswer(accepted=True, duplicate=True, block=k, version=upd.base_version).model_dump()
            base = self._published(k)
        members = self._group_members(name, k, upd)
        try:
            checked = self.intake.check(upd, base, self.settings.local_steps * self.cfg.train.batch_size * max(1, len(members)))
        except ProtocolError as exc:
            if members and exc.status == 422:
                self._refuse_group(k, upd.base_version, name, members, exc.reason)
            raise
        # Written (and fsynced) outside the lock, but named only once the update is accepted:
        # a refused update leaves no blob behind.
        staged = self.store.stage_blob(body)
        try:
            stream = mix_seed(int(row["id"]), k, upd.base_version)  # the stream the work answer named
            return self._accept(name, k, upd, checked, staged, arrived, members, base, stream)
        finally:
            self.store.discard_blob(staged)  # no-op once committed

    def _published(self, k: int) -> Published:
        """Block k's open round as the intake checks updates against it (call under the lock)."""
        frozen = [(self.weights_sha[j], self.weights[j]) for j in range(self.objective.frozen_inputs(k))]
        return Published(k, self.version[k], self.weights_sha[k], self.weights[k], frozen)

    def _group_members(self, name: str, k: int, upd: ParsedUpdate) -> list[str]:
        """The workers a group upload names (cards verified), or [] for one worker's own update."""
        if not upd.group:
            return []
        if self.hub is None:
            raise ProtocolError(409, "this coordinator does not host hivemind averaging; send your own delta, "
                                "or start the coordinator with --hivemind", "hivemind_off")
        with self.lock:  # registration etc. are checked as it is recorded
            return self.hub.members(upd.group, k, upd.base_version)

    def _refuse_group(self, k: int, v: int, uploader: str, members: list[str], reason: str) -> None:
        with self.lock:
            with self.store.tx():
                self.store.record_group_refusal(k, v, uploader, members, reason, self.clock())
            caught = [m for m in members if self.conduct.quarantined(m)]
        log.warning("block %d v%d: refused the mean of group %s (%s)%s", k, v, members, reason,
                    f"; quarantined {caught}" if caught else "")

    def _accept(self, name: str, k: int, upd: ParsedUpdate, checked: Checked, staged: StagedBlob, arrived: float,
                members: list[str], base: Published, stream: int) -> dict[str, Any]:
        digest = staged.digest
        with self.lock:
            self._check_version(k, upd.base_version)
            v = upd.base_version
            prior = self.store.update_blob(k, v, name)
            if prior is not None:
                if prior == digest:
                    return PushAnswer(accepted=True, duplicate=True, block=k, version=v).model_dump()
                raise ProtocolError(
                    409, f"worker {name!r} already sent an update for block {k} version {v}", "duplicate"
                )
            if members:
                check_members(self.store, self.conduct, name, members, k, v)  # under the lock that records them
            elif self.store.submitted(k, v, name):
                raise ProtocolError(409, f"worker {name!r} already counts for block {k} version {v} as a member of a "
                                    "group's mean", "duplicate")
            self.intake.check_replay(k, checked.sketch)  # again, under the lock: two concurrent copies, one accepted
            rnd = self.store.round(k, v)
            opened = float(rnd["opened"]) if rnd is not None else arrived
            self.store.commit_blob(staged)  # durable before the row that names it
            with self.store.tx():
                self.store.record_update(k, v, name, samples=upd.samples, norm=upd.norm,
                                         compression=upd.compression.value, blob=digest, arrived=arrived,
                                         arrival_s=arrived - opened)
                if members:
                    self.store.record_group(k, v, name, members)
            self.intake.remember(k, checked)
            log.info("block %d v%d: accepted update from %s (norm %.4g, %d samples)", k, v, name, upd.norm, upd.samples)
            rounds = self.block_rounds(k)
            audit = self.auditor.draw(name, upd, base, stream,
                                      rounds * self.settings.local_steps if rounds else self.cfg.train.steps, self.clock())
            closed = self._check_quorum(self.clock())
            return PushAnswer(accepted=True, block=k, version=v, round_closed=k in closed, audit=audit).model_dump()

    def audit(self, name: str, k: int, v: int, body: bytes) -> dict[str, Any]:
        """Replay the audited push of ``name`` for (k, v) from its uploaded inner state; a failure quarantines it."""
        self._check_block(k)
        case = self.auditor.take(name, k, v)
        try:
            answer = self.auditor.judge(case, body, self.block_shapes[k])
        except ProtocolError as exc:  # a malformed state fails the audit too
            answer = AuditAnswer(passed=False, relative_error=1e30, tolerance=self.settings.audit_tolerance, seconds=0.0)
            why = f"its audit upload was refused ({exc})"
        else:
            why = (f"its push for block {k} v{v} did not replay: relative error {answer.relative_error:.3g} > "
                   f"{answer.tolerance:g}")
        if answer.passed:
            log.info("block %d v%d: audit of %s passed (relative error %.2g, %.2f s)", k, v, name,
                     answer.relative_error, answer.seconds)
        else:
            with self.lock:
                self.conduct.quarantine(name, f"failed audit: {why}", self.clock())
        return answer.model_dump()

    def _overdue_audits(self, now: float) -> None:
        """Quarantine the workers whose audit uploads are late (call under the lock)."""
        for case in self.auditor.overdue(now):
            if not self.conduct.quarantined(case.worker):
                self.conduct.quarantine(case.worker, f"failed audit: no state uploaded for block {case.update.block} "
                                        f"v{case.update.base_version} within {self.settings.audit_timeout_s:g} s", now)

    def _check_version(self, k: int, base: int) -> None:
        with self.lock:
            v = self.version[k]
            rnd = self.store.round(k, v)
            if base != v:
                raise ProtocolError(
                    409, f"the delta is against version {base} but block {k} is at version {v}; pull the new version",
                    "stale",
                )
            if self.state[k] is BlockState.WAITING:
                raise ProtocolError(409, f"{self.state_message(k)}; it takes no updates yet", "waiting")
            if rnd is None or rnd["state"] != RoundState.OPEN.value:
                raise ProtocolError(409, f"block {k} takes no more updates (the run finished)", "finished")

    def record_rejection(self, name: str | None, k: int | None, exc: ProtocolError) -> None:
        """Log and count a refused update; durably (a ``rejections`` row) only for an authenticated worker.

        ``name`` None means the request carried no valid token: it is counted in memory and its log
        line rate-limited, so unauthenticated traffic takes no lock and writes nothing to disk.
        """
        if name is None:
            self._record_unauthenticated(k, exc)
            return
        log.warning("rejected update from %s for block %s: %d %s: %s", name, k, exc.status, exc.reason, exc)
        block = k if k is not None and 0 <= k < self.n_blocks else None  # a bogus index is not stored
        if exc.reason == "rate_limited":  # not stored: a flood of refused requests writes nothing
            return
        with self.lock:
            now = self.clock()
            with self.store.tx():
                self.store.record_rejection(name, block, exc.status, exc.reason, str(exc), now)
            self.conduct.refused(name, exc.reason, now)

    def _record_unauthenticated(self, k: int | None, exc: ProtocolError) -> None:
        with self._unauth_lock:
            self._unauth_counts[exc.reason] = self._unauth_counts.get(exc.reason, 0) + 1
            now = time.monotonic()
            if now - self._unauth_logged < UNAUTH_LOG_SECONDS:
                self._unauth_quiet += 1
                return
            quiet, self._unauth_quiet, self._unauth_logged = self._unauth_quiet, 0, now
        more = f" (and {quiet} more in the last {UNAUTH_LOG_SECONDS:g} s)" if quiet else ""
        log.warning("rejected unauthenticated update for block %s: %d %s: %s%s", k, exc.status, exc.reason, exc, more)

    def unauthenticated_rejections(self) -> dict[str, int]:
        """Refused unauthenticated updates since start-up, by reason (kept in memory only)."""
        with self._unauth_lock:
            return dict(self._unauth_counts)

    # --- rounds ------------------------------------------------------------------
    def tick(self) -> None:
        """Lapse expired leases, close rounds at quorum or deadline, flush byte counters."""
        with self.lock:
            now = self.clock()
            lapsed = self.store.expired_leases(now)
            if lapsed:
                with self.store.tx():
                    for lapsed_name in lapsed:
                        self.store.lapse_worker(lapsed_name)
                        log.warning("worker %s: lease lapsed; it leaves the round", lapsed_name)
            self._overdue_audits(now)
            self._check_quorum(now)
            self._close_due_rounds(now)
            self.flush_bytes()

    # --- byte accounting ---------------------------------------------------------
    def count_bytes(self, name: str | None, n_in: int, n_out: int, route: str = "control") -> None:
        """Body bytes of one request; ``route``: "updates", "weights" (weights, steps, frozen blocks) or "control".
        By route only for workers' requests: traffic without a valid token adds no row to the database."""
        with self._bytes_lock:
            acc = self._pending_bytes.setdefault(name, [0, 0])
            acc[0] += n_in
            acc[1] += n_out
            if name is None:
                return
            by_route = self._route_bytes.setdefault(route, [0, 0])
            by_route[0] += n_in
            by_route[1] += n_out

    def flush_bytes(self) -> None:
        with self._bytes_lock:
            pending, self._pending_bytes = self._pending_bytes, {}
            routes, self._route_bytes = self._route_bytes, {}
        if not pending:
            return
        with self.lock, self.store.tx():
            for name, (n_in, n_out) in pending.items():
                self.store.add_bytes(name, n_in, n_out)
            for route, (n_in, n_out) in routes.items():
                self.store.add_counter(f"bytes_in:{route}", n_in)
                self.store.add_counter(f"bytes_out:{route}", n_out)

    def close(self) -> None:
        self.flush_bytes()
        if self.hub is not None:
            self.hub.close()
        self.store.close()
