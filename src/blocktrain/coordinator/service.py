"""The coordinator service: the front over its parts, the one owner of their lock, independent of HTTP.

:class:`Coordinator` builds the parts, each with exactly the collaborators it uses, and is the only object that takes
the lock they share. Every operation the HTTP layer (:mod:`.app`) calls runs here in named phases: unlocked parsing
and screening, then a locked admit, record or quorum; the slow work of a push (its checks against a snapshot of the
block's history, the staging of its body on disk) and of an audit (the replay) runs between them, unlocked. The
parts, none of which inherits from another and none of which takes a lock:

* :class:`.auth.Tokens`: bearer tokens, authentication, unauthenticated refusals.
* :class:`.roster.Roster`: registration, leases, assignment to blocks, the work answer.
* :class:`.uploads.Uploads`: the steps of an update push and of an audit upload; refusals, with their consequences
  (:class:`.conduct.Conduct`); the :class:`.intake.Intake` every update passes; audits (:class:`.audit.Auditor`).
* :class:`.rounds.Rounds`: block states, round open and close, aggregation, the progressive schedule.
* :class:`.checkpoints.Checkpoints`: the published versions, the checkpoint mirror, downloads.
* :class:`.observe.Traffic`: byte counting; :class:`.observe.Observed`: the ``/v1/status`` document.
* :class:`.groups.PeerHub`: the hivemind engine's authority and bootstrap peer (``--hivemind``).

Durable state is the :class:`.store.Store`'s, one accessor per table owner.
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from types import MappingProxyType

import torch

from blocktrain.checkpoint.run import RunDir
from blocktrain.config import RunConfig
from blocktrain.coordinator.aggregate import OuterState
from blocktrain.coordinator.audit import AuditCase, Auditor
from blocktrain.coordinator.auth import Tokens
from blocktrain.coordinator.checkpoints import Checkpoints
from blocktrain.coordinator.conduct import Conduct
from blocktrain.coordinator.evaluation import Evaluator
from blocktrain.coordinator.groups import PeerHub
from blocktrain.coordinator.intake import Intake, pack_sketch
from blocktrain.coordinator.observe import Observed, Traffic, prometheus
from blocktrain.coordinator.roster import Roster
from blocktrain.coordinator.rounds import Rounds, progressive_schedule
from blocktrain.coordinator.settings import SETTINGS_META, CoordinatorSettings
from blocktrain.coordinator.store import Store
from blocktrain.coordinator.uploads import Uploads
from blocktrain.data.dataset import DataDir
from blocktrain.errors import ProtocolError
from blocktrain.objectives import get_objective
from blocktrain.protocol.codes import BlockState
from blocktrain.protocol.messages import (
    CLOCK_SKEW_S,
    MAX_REVOKED,
    P2P_TOKEN_TTL_S,
    AuditAnswer,
    Heartbeat,
    Left,
    P2PToken,
    PushAnswer,
    Registration,
    WorkAnswer,
)
from blocktrain.protocol.status import Status

log = logging.getLogger(__name__)


class Coordinator:
    """All coordinator logic, independent of HTTP (the app in :mod:`.app` is a thin layer)."""

    def __init__(
        self,
        run_dir: Path,
        cfg: RunConfig,
        settings: CoordinatorSettings,
        data: DataDir | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.run = RunDir(run_dir)
        self.cfg = self.run.init(cfg, data.root if data is not None else None)
        self.objective = get_objective(self.cfg)
        self.settings = settings.for_objective(self.objective.outer_step())
        self.clock = clock
        self.store = Store(self.run.root, fsync=settings.fsync)
        self.hub: PeerHub | None = None
        try:
            self._open(settings, data)
        except BaseException:  # a start that failed leaves no connection or DHT peer behind
            if self.hub is not None:
                self.hub.close()
            self.store.close()
            raise

    def _open(self, settings: CoordinatorSettings, data: DataDir | None) -> None:
        """The parts of a start, on the opened store (``settings`` as given, before the objective's outer step)."""
        stored = self.store.meta.get_meta(SETTINGS_META)
        if stored is not None and self.store.q1("SELECT 1 FROM updates LIMIT 1") is not None:
            self.settings.refuse_push_changes(json.loads(stored))  # pushes are stored: what decides one stays
        self.lock = threading.RLock()  # serialises every state change and every use of the store; only this front takes it
        self._reload_claim = threading.Lock()  # serialises re-reads of the token table (the store's second connection)
        self.n_blocks = self.cfg.model.n_blocks
        self.evaluator = Evaluator(self.cfg, settings, data)
        self.checkpoints = Checkpoints(self.run, self.cfg, self.settings, self.objective, self.store)
        self.intake = Intake(self.settings, self.checkpoints.block_shapes, self.evaluator)  # what every update passes
        self.conduct = Conduct(self.settings, self.store,  # rate limit and quarantine, which ends the audits it awaits
                               on_quarantine=self._quarantined)
        if self.settings.gate and not self.intake.gating:
            log.warning("no validation data: the loss gate is off (give the coordinator --data to turn it on)")
        self.auditor = Auditor(self.cfg, self.settings, data,  # replays a sampled fraction of accepted pushes
                               key=self._audit_key())
        self.rounds = Rounds(self.cfg, self.settings, progressive_schedule(self.cfg, settings), self.store,
                             self.checkpoints, self.intake, self.conduct,
                             audits_pending=self.auditor.holds)  # a round waits for its audits
        self.tokens = Tokens(self.store, self.conduct)
        # the hivemind engine's authority and bootstrap peer (coordinator.groups)
        self.hub = PeerHub(self.run.root, self.store, settings.hivemind_host) if settings.hivemind else None
        self.roster = Roster(self.cfg, self.settings, self.store, self.rounds, self.checkpoints, self.conduct, self.hub)
        self.uploads = Uploads(self.cfg, self.settings, self.store, self.roster, self.rounds, self.checkpoints,
                               self.intake, self.auditor, self.conduct, self.hub)
        self.traffic = Traffic(self.store)
        self.observed = Observed(self.cfg, self.settings, self.store, self.checkpoints, self.rounds, self.conduct,
                                 self.intake, self.auditor, self.tokens, self.hub)
        with self.lock:
            self.rounds.start(self.clock())
            self.uploads.restore_audits(self.clock())
            self.conduct.finish_group_quarantines(self.clock())  # a crash between a group refusal and its quarantine
            self._revoke_in_dht()
            # what a restart goes on with, once this start has held (a start that failed leaves the last good ones)
            self.store.meta.set_meta(SETTINGS_META, json.dumps(self.settings.to_dict()))

    def _quarantined(self, name: str) -> None:
        """(Locked.) What a quarantine of ``name`` ends beyond its token: the audits that await its uploads, and (with
        --hivemind) its access to the run's DHT."""
        self.uploads.forget_audits(name)
        self._revoke_in_dht()

    def _revoke_in_dht(self) -> None:
        """(Locked.) The run's DHT peer refuses the quarantined workers whose tokens may still be valid."""
        if self.hub is not None:
            since = self.clock() - P2P_TOKEN_TTL_S - CLOCK_SKEW_S
            self.hub.revoke(self.store.conduct.revoked_peers(MAX_REVOKED, since))

    # --- read-only views (tests, benchmarks, the HTTP layer's caps) -----------------------
    @property
    def version(self) -> Mapping[int, int]:
        """Block -> its published version."""
        with self.lock:
            return MappingProxyType(self.checkpoints.versions())

    @property
    def weights(self) -> Mapping[int, dict[str, torch.Tensor]]:
        """Block -> its published weights W_v."""
        with self.lock:
            return MappingProxyType({k: self.checkpoints.current(k).weights for k in range(self.n_blocks)})

    @property
    def weights_sha(self) -> Mapping[int, str]:
        """Block -> the sha256 of its published weights."""
        with self.lock:
            return MappingProxyType({k: self.checkpoints.current(k).sha for k in range(self.n_blocks)})

    @property
    def state(self) -> Mapping[int, BlockState]:
        """Block -> waiting, open or finished."""
        with self.lock:
            return MappingProxyType(dict(self.rounds.state))

    @property
    def block_shapes(self) -> Mapping[int, dict[str, tuple[int, ...]]]:
        """Block -> its trainable tensors' shapes."""
        return MappingProxyType(self.checkpoints.block_shapes)

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Block 0's trainable tensors' shapes (every block's, for diffusion)."""
        return self.checkpoints.shapes

    @property
    def outer(self) -> Mapping[int, OuterState]:
        """Block -> what its outer step carries to the next round."""
        with self.lock:
            return MappingProxyType({k: self.checkpoints.current(k).outer for k in range(self.n_blocks)})

    @property
    def block_fp32_bytes(self) -> int:
        """Bytes of the largest block in float32."""
        return self.checkpoints.block_fp32_bytes

    @property
    def max_body_bytes(self) -> int:
        """The cap on an update's body."""
        return self.checkpoints.max_body_bytes

    def block_rounds(self, k: int) -> int:
        return self.rounds.block_rounds(k)

    def finished(self) -> bool:
        with self.lock:
            return self.rounds.finished()

    def live_replicas(self, now: float) -> dict[int, set[str]]:
        with self.lock:
            return self.roster.live_replicas(now)

    # --- who is asking ---------------------------------------------------------------------
    def worker_for_token(self, token: str) -> str | None:
        """(Unlocked: every request's byte count asks.) The worker a token names, from the cache."""
        return self.tokens.worker_for_token(token)

    def _audit_key(self) -> bytes:
        """The run's secret key of the audit draw, made once and kept (a restart drew every push sent again anew)."""
        with self.lock:
            hexed = self.store.meta.get_meta("audit_key")
            if hexed is None:
                hexed = secrets.token_hex(32)
                with self.store.tx():
                    self.store.meta.set_meta("audit_key", hexed)
            return bytes.fromhex(hexed)

    def authenticate(self, token: str | None) -> str:
        """The worker ``token`` names; 401 or 403 from the cache unless the token table is due to be re-read (a
        stranger's made-up tokens never wait for the lock that a round's close or an evaluation holds)."""
        if token:
            name = self.tokens.worker_for_token(token)
            if name is not None:
                return name
        if not token or not self.tokens.reload_due():
            self.tokens.refuse(token)
        with self._reload_claim:  # one re-read at a time, on the store's second connection: never the coordinator's lock
            return self.tokens.authenticate(token)

    def add_token(self, name: str) -> str:
        with self.lock, self._reload_claim:
            return self.tokens.add_token(name, self.clock())

    # --- workers ---------------------------------------------------------------------------
    def register(self, name: str, block: int | None, dataset: str | None = None, p2p_key: str | None = None) -> Registration:
        with self.lock:
            return self.roster.register(name, block, self.clock(), dataset, p2p_key)

    def renew_p2p(self, name: str) -> P2PToken:
        with self.lock:
            return self.roster.renew_p2p(name)

    def heartbeat(self, name: str) -> Heartbeat:
        with self.lock:
            return self.roster.heartbeat(name, self.clock())

    def leave(self, name: str) -> Left:
        with self.lock:
            self.roster.leave(name)
            self.rounds.check_quorum(self.clock())
        return Left()

    def work(self, name: str) -> WorkAnswer:
        with self.lock:
            return self.roster.work(name, self.clock())

    # --- downloads ---------------------------------------------------------------------------
    def weights_bytes(self, k: int) -> tuple[int, bytes]:
        with self.lock:
            return self.checkpoints.weights_bytes(k)

    def step_bytes(self, k: int, from_version: int) -> bytes:
        with self.lock:
            return self.checkpoints.step_bytes(k, from_version)

    def moments_bytes(self, k: int, v: int) -> bytes:
        with self.lock:
            return self.checkpoints.moments_bytes(k, v)

    def frozen_bytes(self, k: int) -> tuple[int, str, bytes]:
        with self.lock:
            return self.rounds.frozen_bytes(k)

    # --- a push ------------------------------------------------------------------------------
    def submit(self, name: str, k: int, body: bytes) -> PushAnswer:
        """Validate and store one update; close the round if that makes a quorum."""
        try:
            return self._submit(name, k, body)
        except ProtocolError as exc:
            self.record_rejection(name, k, exc)
            raise

    def admit(self, name: str, k: int) -> None:
        """Refuse a push of ``name`` to block k before its body is read: 403 quarantined or another block, 429 over its
        refusal rate (:meth:`submit` checks again)."""
        with self.lock:
            self.uploads.admit(name, k)

    def _submit(self, name: str, k: int, body: bytes) -> PushAnswer:
        up = self.uploads
        arrived = self.clock()
        with self.lock:  # admit: registered on block k, not quarantined, not over its refusal rate
            worker = up.admit(name, k)
        upd = up.parse(k, body)  # unlocked: size, tensors, metadata
        with self.lock:  # screen against the round; snapshot what the checks read
            pushed = up.probation(name, k)  # its pushes of block k so far (probation)
            resend = up.screen(name, upd, body, pushed)
            if resend is not None:
                return resend
            members = up.members(name, upd)
            base = self.checkpoints.published(k)
            view = self.intake.view(base, grouped=bool(members))
            scale = self.rounds.lr_scale(k, upd.base_version)
        t0 = time.perf_counter()
        try:  # unlocked: budget, norm, replay and the loss gate, on the snapshot
            checked = self.intake.check(upd, base, up.budget(k, members), view, scale)
        except ProtocolError as exc:
            with self.lock:
                self.intake.count(time.perf_counter() - t0)
                up.refused(name, upd, members, exc, self.clock())
            raise
        if self.auditor.drawn(name, upd, pushed + 1, checked.outlier):  # drawn as an outlier: no room is a
            self.auditor.check_room()  # 503 before its blobs are written (accept checks again, under the lock)
        staged = self.store.blobs.stage_blob(body)  # unlocked: written and fsynced, named only once accepted
        sketch = self.store.blobs.stage_blob(pack_sketch(k, checked.sketch))  # what a restart reads for the delta
        try:
            with self.lock:  # record: checked again against the round as it is now, stored, audited, quorum
                self.intake.count(time.perf_counter() - t0)
                try:
                    return up.accept(name, worker, upd, checked, staged, sketch, arrived, members, base, self.clock())
                except ProtocolError as exc:  # a replay of what was accepted since the checks: refused as they refuse
                    up.refused(name, upd, members, exc, self.clock())
                    raise
        finally:
            self.store.blobs.discard_blob(staged)  # no-op once committed
            self.store.blobs.discard_blob(sketch)

    def record_rejection(self, name: str | None, k: int | None, exc: ProtocolError) -> None:
        """Log and count a refused update; durably (a ``rejections`` row) only for an authenticated worker.

        ``name`` None means the request carried no valid token: it is counted in memory and its log
        line rate-limited, so unauthenticated traffic takes no lock and writes nothing to disk.
        """
        if name is None:
            self.tokens.refused(k, exc)
            return
        with self.lock:
            self.uploads.record_rejection(name, k, exc, self.clock())

    # --- an audit ------------------------------------------------------------------------------
    def expect_audit(self, name: str, k: int, v: int) -> tuple[int, float]:
        """404 unless an audit of ``name`` for (k, v) awaits its upload (asked before the body is read); from here
        until :meth:`audit` or :meth:`audit_upload_cut`, the audit is not overdue while its body arrives."""
        with self.lock:
            return self.auditor.expect(name, k, v, self.clock())

    def audit_upload_received(self, name: str, k: int, v: int, upload: int) -> None:
        """(Unlocked.) The audit upload of ``name`` for (k, v) is whole: not overdue while it is decoded."""
        self.auditor.received(name, k, v, upload)

    def audit_upload_cut(self, name: str, k: int, v: int, upload: int) -> None:
        """(Unlocked: called as a request unwinds.) The audit upload of ``name`` for (k, v) ended before its replay
        (cut, past ``upload_timeout_s``, malformed): the audit is overdue again once past its deadline."""
        self.auditor.cut(name, k, v, upload)

    def audit(self, name: str, k: int, v: int, body: bytes) -> AuditAnswer:
        """Replay the audited push of ``name`` for (k, v) from its uploaded inner state; a failure quarantines it
        (:meth:`take_audit`, then :meth:`replay_audit`)."""
        return self.replay_audit(self.take_audit(name, k, v), body)

    def take_audit(self, name: str, k: int, v: int) -> AuditCase:
        """The audit of ``name``'s push for (k, v), taken for its replay: a resend of its upload is 404 from here, and
        its round stays held until :meth:`replay_audit` decides it."""
        self.checkpoints.check_block(k)
        with self.lock:
            return self.auditor.take(name, k, v)

    def replay_audit(self, case: AuditCase, body: bytes) -> AuditAnswer:
        """Replay a taken audit from its uploaded inner state ``body`` and decide it.

        Its round has waited for this decision (``Rounds.audits_pending``): a failed push is dropped before the round
        closes, so it is never applied, also where it completed the quorum."""
        name, k, v = case.worker, case.update.block, case.update.base_version
        answer: AuditAnswer | None = None
        why = "its replay broke"
        try:  # unlocked: the replay (the app runs at most --audit-replays at once: a round's uploads arrive together)
            answer = self.auditor.judge(case, body, self.checkpoints.block_shapes[k], self.uploads.prior(case),
                                        self.uploads.derivation(case))
            why = self._audit_failure(k, v, answer)
        except ProtocolError as exc:  # a malformed state fails the audit too
            answer = self.auditor.unjudged()
            why = f"its audit upload was refused ({exc})"
        except Exception as exc:  # the coordinator's own fault (out of memory, a bug): logged, the push not counted
            log.exception("block %d v%d: the replay of %s's push broke", k, v, name)
            why = f"{type(exc).__name__}: {exc}"
        finally:  # decided under the lock, before its round may close
            with self.lock:
                self.uploads.decide(name, k, v, answer, why, self.clock())
        if answer is None:  # answered as a push that does not count (the worker goes on; the log says why)
            return self.auditor.unjudged()
        return answer

    def _audit_failure(self, k: int, v: int, answer: AuditAnswer) -> str:
        """What a failed audit missed, each bound it broke with its limit (the quarantine's reason)."""
        st = self.settings
        if answer.relative_error >= 1e30 and answer.scale >= 1e30:  # judge found no replay to make
            return f"its audit upload for block {k} v{v} is not the state its push committed to (its sha256 differs)"
        missed = []
        if answer.relative_error > answer.tolerance:
            missed.append(f"relative error {answer.relative_error:.3g} (at most {answer.tolerance:.3g})")
        if abs(answer.scale - 1.0) > st.audit_scale_tolerance:
            missed.append(f"scale on its replay {answer.scale:.4f} (within {st.audit_scale_tolerance:g} of 1)")
        if answer.moment_error > st.audit_moment_tolerance:
            missed.append(f"its moments {answer.moment_error:.3g} from those its earlier rounds give (at most "
                          f"{st.audit_moment_tolerance:g})")
        if answer.pushed_moment_error > st.audit_pushed_moment_tolerance:
            missed.append(f"the moments it pushed {answer.pushed_moment_error:.3g} from its replay's (at most "
                          f"{st.audit_pushed_moment_tolerance:g}, each scaled within x2)")
        return f"its push for block {k} v{v} did not replay: {'; '.join(missed) or 'no bound broken'}"

    # --- time, evaluation, observation -----------------------------------------------------------
    def tick(self) -> None:
        """Lapse expired leases, quarantine late audits, close rounds at quorum or deadline, flush byte counters."""
        with self.lock:
            now = self.clock()
            self.roster.lapse(now)
            self.uploads.overdue_audits(now)
            self.rounds.check_quorum(now)
            self.rounds.close_due_rounds(now)
            self.traffic.flush_bytes()
            self.tokens.unauthenticated_rejections()  # folds the queued counts
            with self._reload_claim:
                self.tokens.refresh()  # tokens replaced or revoked by another process

    def maybe_evaluate(self, force: bool = False) -> float | None:
        """Evaluate the assembled model if an epoch (the least version over the blocks) is due: the weights are taken
        under the lock, scored without it."""
        if not self.evaluator.enabled:
            return None
        with self.lock:
            due = self.checkpoints.eval_due(force)
        if due is None:
            return None
        epoch, versions, snapshot = due
        ce, n = self.evaluator.evaluate(snapshot, self.checkpoints.E)
        with self.lock, self.store.tx():
            self.store.evals.record_eval(epoch, versions, ce, n, self.clock())
        log.info("eval at epoch %d (versions %s): CE %.4f nats/byte on %d bytes", epoch, versions, ce, n)
        return ce

    def count_bytes(self, name: str | None, n_in: int, n_out: int, route: str = "control") -> None:
        """(Unlocked: the HTTP layer counts every request.)"""
        self.traffic.count_bytes(name, n_in, n_out, route)

    def flush_bytes(self) -> None:
        with self.lock:
            self.traffic.flush_bytes()

    def status(self, recent_rounds: int = 50) -> Status:
        with self.lock:
            self.traffic.flush_bytes()
            return self.observed.status(self.clock(), recent_rounds)

    def metrics(self) -> str:
        """Prometheus text for ``/metrics``."""
        return prometheus(self.status(recent_rounds=0))

    def close(self) -> None:
        self.flush_bytes()
        if self.hub is not None:
            self.hub.close()
        self.store.close()
