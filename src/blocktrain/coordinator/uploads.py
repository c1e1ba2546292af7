"""Update uploads of the live coordinator: from an HTTP body to a stored, acknowledged update, and the audits.

Every update is validated (:mod:`.validate`), checked against the block's version, the intake (budget, base,
norms, replays, the loss gate: :mod:`.intake`), stored durably and only then acknowledged; every rejection is
logged, counted and answered with a 4xx. Rejections of authenticated workers are stored (and count toward
quarantine, :mod:`.conduct`); those of requests without a valid token are only counted in memory (:mod:`.auth`).
A group upload (the hivemind engine) names its members, whose proofs and standing are checked (:mod:`.groups`).
A sampled fraction of accepted pushes is audited: the worker uploads its inner state and the coordinator replays
its round (:mod:`.audit`); a failed or missing audit quarantines the worker.

:class:`Uploads` holds the steps of a push; the coordinator's front (:mod:`.service`) runs them in phases, each
step saying whether it is called under the lock (admit, screen, accept, decide) or without it (parse).
"""

from __future__ import annotations

import hashlib
import logging

from blocktrain.checkpoint.safetensors_io import unpack
from blocktrain.config import RunConfig
from blocktrain.coordinator.audit import AuditCase, Auditor
from blocktrain.coordinator.blobs import StagedBlob
from blocktrain.coordinator.checkpoints import Checkpoints
from blocktrain.coordinator.conduct import NOT_REFUSALS, Conduct
from blocktrain.coordinator.groups import PeerHub, check_members
from blocktrain.coordinator.intake import Checked, Intake, Published
from blocktrain.coordinator.lineage import Derivation, Lineage, StoreRecords, derive, trace
from blocktrain.coordinator.roster import Roster
from blocktrain.coordinator.rounds import Rounds
from blocktrain.coordinator.rows import AuditRow, WorkerRow
from blocktrain.coordinator.settings import CoordinatorSettings
from blocktrain.coordinator.store import Store
from blocktrain.coordinator.validate import ParsedUpdate, parse_update
from blocktrain.errors import ProtocolError
from blocktrain.protocol.codes import Reason
from blocktrain.protocol.delta import SCALE_SUFFIX, Compression, Sent, decode_delta
from blocktrain.protocol.messages import AuditAnswer, PushAnswer
from blocktrain.seeds import worker_stream

log = logging.getLogger(__name__)


class Uploads:
    """The steps of an update push and of an audit upload (see the module docstring for which run under the lock)."""

    def __init__(self, cfg: RunConfig, settings: CoordinatorSettings, store: Store, roster: Roster, rounds: Rounds,
                 checkpoints: Checkpoints, intake: Intake, auditor: Auditor, conduct: Conduct,
                 hub: PeerHub | None) -> None:
        self.cfg, self.settings, self.store, self.roster, self.rounds = cfg, settings, store, roster, rounds
        self.checkpoints, self.intake, self.auditor, self.conduct, self.hub = checkpoints, intake, auditor, conduct, hub
        # audits judged whose outcome could not be written (a full disk): decided again at each tick, rounds held
        self._undecided: dict[tuple[str, int, int], tuple[AuditAnswer | None, str]] = {}

    # --- a push ------------------------------------------------------------------------
    def admit(self, name: str, k: int) -> WorkerRow:
        """(Locked.) The pushing worker's row: registered on block k, not quarantined, not over its refusal rate."""
        self.checkpoints.check_block(k)
        row = self.roster.get(name)
        self.conduct.admit(name)  # 403 quarantined, 429 over its refusal rate
        if row.block != k:
            raise ProtocolError(403, f"worker {name!r} is assigned to block {row.block}, not {k}; GET /v1/work",
                                Reason.WRONG_BLOCK)
        return row

    def parse(self, k: int, body: bytes) -> ParsedUpdate:
        """(Unlocked.) The body as an update for block k: its size, its tensors and metadata, its commitment."""
        ck = self.checkpoints
        if len(body) > ck.max_body_bytes:
            raise ProtocolError(413, f"update of {len(body)} bytes exceeds the cap of {ck.max_body_bytes}", Reason.TOO_LARGE)
        upd = parse_update(body, k, ck.block_shapes[k], self.settings.inner_start.shares, self.settings.moment_every)
        if self.auditor.enabled and not upd.group and upd.state_sha is None:
            raise ProtocolError(422, "this coordinator audits updates: an update must name the sha256 of the worker's "
                                "inner state at the round's start (state_sha); run the same BlockTrain version",
                                Reason.COMMITMENT)
        return upd

    def screen(self, name: str, upd: ParsedUpdate, body: bytes, accepted: int) -> PushAnswer | None:
        """(Locked.) Answer a byte-identical resend as its first sending was (its answer may have been lost, also after
        its round closed; with its audit, if one awaits its upload); refuse an update for a round that does not take
        it, or one drawn for an audit with no room for it (``accepted``: the worker's pushes of the block so far, as
        :meth:`.tables.UpdateTable.probation_pushes` counts them; None: go on)."""
        k, v = upd.block, upd.base_version
        if self.store.updates.update_blob(k, v, name) == hashlib.sha256(body).hexdigest():
            return self._resent(name, k, v)
        self.rounds.check_version(k, v)
        if self.auditor.drawn(name, upd, accepted + 1):  # before the checks' cost:
            self.auditor.check_room()  # a resend refused for want of audit room paid for the gate every time
        return None

    def probation(self, name: str, k: int) -> int:
        """(Locked.) ``name``'s pushes of block k that count toward its probation there, up to one past it (all that
        matters: the count stays one short query however long the run)."""
        n = self.settings.probation_pushes
        return self.store.updates.probation_pushes(name, k, n + 1) if n and self.auditor.enabled else 0

    def _resent(self, name: str, k: int, v: int) -> PushAnswer:
        """The answer to a byte-identical resend of ``name``'s push for (k, v): taken, audited if its audit awaits."""
        return PushAnswer(accepted=True, duplicate=True, block=k, version=v, audit=self.auditor.awaits(name, k, v))

    def members(self, name: str, upd: ParsedUpdate) -> list[str]:
        """(Locked.) The workers a group upload names (cards verified, each one that may be named: check_members),
        or [] for one worker's own update."""
        if not upd.group:
            return []
        if self.hub is None:
            raise ProtocolError(409, "this coordinator does not host hivemind averaging; send your own delta, "
                                "or start the coordinator with --hivemind", Reason.HIVEMIND_OFF)
        names = self.hub.members(upd.group, upd.block, upd.base_version)
        check_members(self.store, self.conduct, name, names, upd.block, upd.base_version)
        claims, each = [m.samples for m in upd.group], self.budget(upd.block, [])
        if max(claims) > each:  # a member's claim is its weight in the mean (parse_update checked their sum)
            raise ProtocolError(422, f"group members claim {claims} samples; each may claim at most {each} "
                                "(H x batch of its round)", Reason.CLAIM)
        return names

    def budget(self, k: int, members: list[str]) -> int:
        """The samples an update of block k may claim: H x batch, times the members of a group mean."""
        return self.rounds.local_steps(k) * self.cfg.train.batch_size * max(1, len(members))

    def refused(self, name: str, upd: ParsedUpdate, members: list[str], exc: ProtocolError, now: float) -> None:
        """(Locked.) What an intake refusal means beyond the refusal itself: the round stops waiting for the workers
        behind it, and a refused group mean is recorded against every member (those in GROUP_REFUSALS of them are
        quarantined)."""
        if exc.status != 422:
            return
        k, v = upd.block, upd.base_version
        with self.store.tx():  # one transaction: a restart finds both or neither
            if members:
                self.store.conduct.record_group_refusal(k, v, name, members, exc.reason, now)
            # the round does not wait for them (stored: a restarted coordinator does not either)
            self.store.rounds.mark_refused(k, v, members or [name])
        if members:
            caught = self.conduct.group_refused(members, now)
            log.warning("block %d v%d: refused the mean of group %s (%s)%s", k, v, members, exc.reason,
                        f"; quarantined {caught}" if caught else "")

    def accept(self, name: str, worker: WorkerRow, upd: ParsedUpdate, checked: Checked, staged: StagedBlob,
               sketch: StagedBlob, arrived: float, members: list[str], base: Published, now: float) -> PushAnswer:
        """(Locked.) Check the update again against the round as it is now (version, duplicates, the replays accepted
        since its checks), store it (``staged``: its body, ``sketch``: its count sketch's blob, both written unlocked),
        draw its audit, close the round if that makes a quorum."""
        k, v, s = upd.block, upd.base_version, self.store
        prior = s.updates.update_blob(k, v, name)
        if prior == staged.digest:  # a resend that raced its first sending (answered as that was, as in screen)
            return self._resent(name, k, v)
        self.rounds.check_version(k, v)
        if prior is not None:
            raise ProtocolError(409, f"worker {name!r} already sent an update for block {k} version {v}", Reason.DUPLICATE)
        if members:
            check_members(s, self.conduct, name, members, k, v)  # under the lock that records them
        elif self.conduct.quarantined(name):  # since its admission: another of its requests was refused meanwhile
            raise ProtocolError(403, f"worker {name!r} was quarantined while its update was checked; ask the run's "
                                "operator", Reason.QUARANTINED)
        elif s.updates.submitted(k, v, name):
            raise ProtocolError(409, f"worker {name!r} already counts for block {k} version {v} as a member of a "
                                "group's mean", Reason.DUPLICATE)
        self.intake.check_replay(k, checked.sketch)  # again, against every delta accepted since its checks' snapshot
        rnd = s.rounds.round(k, v)
        opened = rnd.opened if rnd is not None else arrived
        rounds, h = self.rounds.block_rounds(k), self.rounds.local_steps(k)
        stream = worker_stream(worker.id, k, v)  # the stream the work answer named
        case = self.auditor.draw(name, upd, base, stream, rounds * h if rounds else self.cfg.train.steps, h, now,
                                 accepted=self.probation(name, k) + 1, outlier=checked.outlier,
                                 prior=s.updates.previous_blobs(k, name, v), lineage=lambda: self._trace(name, k, v))
        try:
            s.blobs.commit_blob(staged, sketch)  # durable before the row that names them
            with s.tx():  # the update and, if drawn, its audit: a restart still holds its round for the audit
                s.updates.record_update(k, v, name, samples=upd.samples, norm=upd.norm, compression=upd.compression.value,
                                        blob=staged.digest, arrived=arrived, arrival_s=arrived - opened, rise=checked.rise,
                                        counted=checked.full, sketch=sketch.digest)
                if members:
                    s.updates.record_group(k, v, name, members)
                if case is not None:
                    s.audits.record_audit(AuditRow(name, k, v, staged.digest, stream, case.schedule_steps, h, case.due))
        except BaseException:
            if case is not None:
                self.auditor.forget(case)
            raise
        self.intake.remember(k, checked, held=(name, k, v) if case is not None else None)
        log.info("block %d v%d: accepted update from %s (norm %.4g, %d samples)", k, v, name, upd.norm, upd.samples)
        closed = self.rounds.check_quorum(now)
        return PushAnswer(accepted=True, block=k, version=v, round_closed=k in closed, audit=case is not None)

    def restore_audits(self, now: float) -> None:
        """(Locked, at start-up.) The audits drawn before a restart and not decided wait for their uploads again, so
        their rounds stay held, each for a whole ``audit_timeout_s`` from ``now`` at least (the worker could not
        upload while the coordinator was down); one whose round has moved on, or whose update was dropped, is
        forgotten."""
        s = self.store
        for a in s.audits.pending_audits():
            current = self.checkpoints.current(a.block)
            pending = {r.worker for r in s.updates.accepted_updates(a.block, a.version)}
            if current.version != a.version or a.worker not in pending:
                with s.tx():
                    s.audits.drop_audit(a.worker, a.block, a.version)
                continue
            upd = parse_update(s.blobs.get_blob(a.blob), a.block, self.checkpoints.block_shapes[a.block],
                               self.settings.inner_start.shares, self.settings.moment_every)
            self.auditor.restore(AuditCase(a.worker, upd, self.checkpoints.published(a.block), self.cfg.train.seed,
                                           a.stream, a.schedule_steps, a.round_steps,
                                           max(a.due, now + self.settings.audit_timeout_s),
                                           s.updates.previous_blobs(a.block, a.worker, a.version),
                                           self._trace(a.worker, a.block, a.version)))
            counted, rise = s.updates.held_entry(a.block, a.version, a.worker)
            if counted:  # as remember() held it: a push that claimed too little holds nothing
                self.intake.hold((a.worker, a.block, a.version), a.block,
                                 upd.norm / self.rounds.lr_scale(a.block, a.version), rise)
            log.info("block %d v%d: the audit of %s awaits its upload again (drawn before the restart)", a.block,
                     a.version, a.worker)

    def _trace(self, name: str, k: int, v: int) -> Lineage | None:
        """(Locked.) The rounds ``name``'s moments at the start of its round (k, v) came from (None: a claim)."""
        lineage = trace(StoreRecords(self.store), k, name, v, self.settings.inner_start, self.settings.moment_every)
        if lineage is None:
            log.info("block %d v%d: %s's moments cannot be derived from the records; its audit replays from the "
                     "uploaded ones", k, v, name)
        return lineage

    # --- an audit upload ---------------------------------------------------------------
    def derivation(self, case: AuditCase) -> Derivation | None:
        """(Unlocked: blobs never change.) ``case.lineage`` read back for its replay (None: none traced)."""
        if case.lineage is None:
            return None
        k = case.update.block
        try:
            return derive(self.store.blobs.get_blob, case.lineage, k, self.checkpoints.block_shapes[k], self.settings.inner_start,
                          self.settings.moment_codec, self.cfg.train.batch_size)
        except ProtocolError as exc:  # its own records do not read back: its fault, not the worker's
            raise RuntimeError(f"the rounds {case.worker}'s moments came from do not read back: {exc}") from exc

    def prior(self, case: AuditCase) -> list[Sent]:
        """(Unlocked: blobs never change.) The worker's last pushes of the block as it sent them: their deltas decoded,
        read as this coordinator stored them (their moments, which today's settings may not expect, left out)."""
        shapes = self.checkpoints.block_shapes[case.update.block]
        out = []
        for digest in case.prior:
            tensors, meta = unpack(self.store.blobs.get_blob(digest), source=f"update {digest[:12]}")
            compression = Compression(meta["compression"])
            wire = {n: t for n, t in tensors.items() if n.removesuffix(SCALE_SUFFIX) in shapes}
            out.append((decode_delta(wire, compression), compression))
        return out

    def decide(self, name: str, k: int, v: int, answer: AuditAnswer | None, why: str, now: float) -> None:
        """(Locked.) An audit's outcome, before its round may close: a failure quarantines the worker and drops its
        update; a replay that broke (``answer`` None: the coordinator's own fault, such as running out of memory)
        drops the update, which is not applied unverified, and blames no one; either way the round may now close.

        A push that did not pass is let go only once its drop is durable: if writing it fails (a full disk, an I/O
        error), the audit stays undecided and its round held; each tick decides it again (a restart awaits the audit
        again). Marking it decided whatever happened let the next quorum check apply the push that had failed its
        audit."""
        settled = answer is not None and answer.passed  # nothing to undo: the round may close whatever follows
        self._undecided.pop((name, k, v), None)
        try:
            passed = settled and not self.conduct.quarantined(name)  # not if since dropped
            self.intake.release((name, k, v), passed=passed)
            if answer is None:
                with self.store.tx():
                    self.store.updates.drop_update(k, v, name)
                log.error("block %d v%d: the replay of %s's push broke (%s); its update is dropped, it is not "
                          "quarantined", k, v, name, why)
            elif answer.passed:
                log.info("block %d v%d: audit of %s passed (relative error %.2g, %.2f s)", k, v, name,
                         answer.relative_error, answer.seconds)
            else:
                self.conduct.quarantine(name, f"failed audit: {why}", now)
            settled = True  # its update is dropped (and its worker quarantined) for good
            if answer is not None:
                self.auditor.record(answer)
        finally:
            if settled:
                self.auditor.decided(name, k, v)
                with self.store.tx():
                    self.store.audits.drop_audit(name, k, v)
            else:  # decided again at the next tick (:meth:`overdue_audits`)
                self._undecided[(name, k, v)] = (answer, why)
        self.rounds.check_quorum(now)  # the decided audit may complete its round

    def forget_audits(self, name: str) -> None:
        """(Locked.) ``name`` was quarantined: its audits that await an upload are forgotten (its updates are dropped,
        so their rounds close without them; their held norms never count)."""
        for key in self.auditor.forget_worker(name):
            self._unheld(key)

    def _unheld(self, key: tuple[str, int, int]) -> None:
        """(Locked.) An audit no longer awaited (its worker, block and version): its held norm never counts, and a
        restart does not wait for it."""
        self.intake.release(key, passed=False)
        with self.store.tx():
            self.store.audits.drop_audit(*key)

    def overdue_audits(self, now: float) -> None:
        """(Locked.) Decide again the audits whose outcome could not be written; quarantine the workers whose audit
        uploads are late."""
        for (name, k, v), (answer, why) in list(self._undecided.items()):
            try:  # one that still cannot be written holds its own round only: the tick goes on
                self.decide(name, k, v, answer, why, now)
            except Exception:
                log.exception("block %d v%d: the outcome of %s's audit still cannot be written", k, v, name)
        late = self.auditor.overdue(now)
        for i, case in enumerate(late):
            try:  # its quarantine drops its update: durable before the round stops waiting for the audit
                if not self.conduct.quarantined(case.worker):
                    self.conduct.quarantine(case.worker, f"failed audit: no state uploaded for block "
                                            f"{case.update.block} v{case.update.base_version} within "
                                            f"{self.settings.audit_timeout_s:g} s", now)
                self._unheld((case.worker, case.update.block, case.update.base_version))
            except BaseException:  # not written: this case and the ones after it are awaited again (the next tick
                for rest in late[i:]:  # retries), their rounds still held
                    self.auditor.restore(rest)
                raise

    def record_rejection(self, name: str, k: int | None, exc: ProtocolError, now: float) -> None:
        """(Locked.) Log and count a refused update of an authenticated worker, durably (a ``rejections`` row)."""
        log.warning("rejected update from %s for block %s: %d %s: %s", name, k, exc.status, exc.reason, exc)
        block = k if k is not None and 0 <= k < self.checkpoints.n_blocks else None  # a bogus index is not stored
        if exc.reason in NOT_REFUSALS:  # not stored: a flood of refused requests writes nothing; a busy one is no fault
            return
        with self.store.tx():
            self.store.conduct.record_rejection(name, block, exc.status, exc.reason, str(exc), now)
        self.conduct.refused(name, exc.reason, now)
