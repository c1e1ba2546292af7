"""Update uploads of the live coordinator: from an HTTP body to a stored, acknowledged update, and the audits.

Every update is validated (:mod:`.validate`), checked against the block's version, the intake (budget, base,
norms, replays, the loss gate: :mod:`.intake`), stored durably and only then acknowledged; every rejection is
logged, counted and answered with a 4xx. Rejections of authenticated workers are stored (and count toward
quarantine, :mod:`.conduct`); those of requests without a valid token are only counted in memory (:mod:`.auth`).
A group upload (the hivemind engine) names its members, whose proofs and standing are checked (:mod:`.groups`).
A sampled fraction of accepted pushes is audited: the worker uploads its inner state and the coordinator replays
its round (:mod:`.audit`); a failed or missing audit quarantines the worker.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any

from blocktrain.coordinator.audit import Auditor
from blocktrain.coordinator.blobs import StagedBlob
from blocktrain.coordinator.conduct import Conduct
from blocktrain.coordinator.groups import PeerHub, check_members
from blocktrain.coordinator.intake import Checked, Intake, Published
from blocktrain.coordinator.roster import Roster
from blocktrain.coordinator.validate import ParsedUpdate, parse_update
from blocktrain.errors import ProtocolError
from blocktrain.protocol.messages import AuditAnswer, PushAnswer
from blocktrain.seeds import worker_stream

log = logging.getLogger(__name__)


class Uploads:
    """Update pushes, audits and the refusals they meet (the workers are the roster's, the rounds its rounds')."""

    def __init__(self, roster: Roster, intake: Intake, auditor: Auditor, conduct: Conduct, hub: PeerHub | None) -> None:
        self.roster, self.intake, self.auditor, self.conduct, self.hub = roster, intake, auditor, conduct, hub
        self.rounds, self.checkpoints, self.store = roster.rounds, roster.rounds.checkpoints, roster.store
        self.cfg, self.settings, self.lock, self.clock = roster.cfg, roster.settings, roster.lock, roster.clock

    def submit(self, name: str, k: int, body: bytes) -> dict[str, Any]:
        """Validate and store one update; close the round if that makes a quorum."""
        try:
            return self._submit(name, k, body)
        except ProtocolError as exc:
            self.record_rejection(name, k, exc)
            raise

    def _submit(self, name: str, k: int, body: bytes) -> dict[str, Any]:
        ck = self.checkpoints
        ck.check_block(k)
        arrived = self.clock()
        with self.lock:
            row = self.roster.get(name)
            self.conduct.admit(name)  # 403 quarantined, 429 over its refusal rate
            if int(row["block"]) != k:
                raise ProtocolError(403, f"worker {name!r} is assigned to block {row['block']}, not {k}; GET /v1/work", "wrong_block")
        if len(body) > ck.max_body_bytes:
            raise ProtocolError(413, f"update of {len(body)} bytes exceeds the cap of {ck.max_body_bytes}", "too_large")
        upd = parse_update(body, k, ck.block_shapes[k])
        if self.auditor.enabled and not upd.group and upd.state_sha is None:
            raise ProtocolError(422, "this coordinator audits updates: an update must name the sha256 of the worker's "
                                "inner state at the round's start (state_sha); run the same BlockTrain version", "commitment")
        with self.lock:
            self.rounds.check_version(k, upd.base_version)
            if self.store.updates.update_blob(k, upd.base_version, name) == hashlib.sha256(body).hexdigest():
                return PushAnswer(accepted=True, duplicate=True, block=k, version=upd.base_version).model_dump()
            base = ck.published(k)
        members = self._group_members(name, k, upd)
        try:
            checked = self.intake.check(upd, base, self.rounds.local_steps(k) * self.cfg.train.batch_size * max(1, len(members)))
        except ProtocolError as exc:
            if members and exc.status == 422:
                self._refuse_group(k, upd.base_version, name, members, exc.reason)
            if exc.status == 422:  # the round does not wait for them: the worker waits for the next version
                with self.lock:
                    self.rounds.refused.setdefault((k, upd.base_version), set()).update(members or [name])
            raise
        # Written (and fsynced) outside the lock, but named only once the update is accepted:
        # a refused update leaves no blob behind.
        staged = self.store.blobs.stage_blob(body)
        try:
            stream = worker_stream(int(row["id"]), k, upd.base_version)  # the stream the work answer named
            return self._accept(name, k, upd, checked, staged, arrived, members, base, stream)
        finally:
            self.store.blobs.discard_blob(staged)  # no-op once committed

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
                self.store.conduct.record_group_refusal(k, v, uploader, members, reason, self.clock())
            caught = [m for m in members if self.conduct.quarantined(m)]
        log.warning("block %d v%d: refused the mean of group %s (%s)%s", k, v, members, reason, f"; quarantined {caught}" if caught else "")

    def _accept(self, name: str, k: int, upd: ParsedUpdate, checked: Checked, staged: StagedBlob, arrived: float,
                members: list[str], base: Published, stream: int) -> dict[str, Any]:
        digest = staged.digest
        s = self.store
        with self.lock:
            self.rounds.check_version(k, upd.base_version)
            v = upd.base_version
            prior = s.updates.update_blob(k, v, name)
            if prior is not None:
                if prior == digest:
                    return PushAnswer(accepted=True, duplicate=True, block=k, version=v).model_dump()
                raise ProtocolError(409, f"worker {name!r} already sent an update for block {k} version {v}", "duplicate")
            if members:
                check_members(s, self.conduct, name, members, k, v)  # under the lock that records them
            elif s.updates.submitted(k, v, name):
                raise ProtocolError(409, f"worker {name!r} already counts for block {k} version {v} as a member of a "
                                    "group's mean", "duplicate")
            self.intake.check_replay(k, checked.sketch)  # again, under the lock: two concurrent copies, one accepted
            rnd = s.rounds.round(k, v)
            opened = float(rnd["opened"]) if rnd is not None else arrived
            s.blobs.commit_blob(staged)  # durable before the row that names it
            with s.tx():
                s.updates.record_update(k, v, name, samples=upd.samples, norm=upd.norm,
                                        compression=upd.compression.value, blob=digest, arrived=arrived,
                                        arrival_s=arrived - opened)
                if members:
                    s.updates.record_group(k, v, name, members)
            self.intake.remember(k, checked)
            log.info("block %d v%d: accepted update from %s (norm %.4g, %d samples)", k, v, name, upd.norm, upd.samples)
            rounds, h = self.rounds.block_rounds(k), self.rounds.local_steps(k)
            worker = s.workers.worker(name)
            audit = self.auditor.draw(name, upd, base, stream, rounds * h if rounds else self.cfg.train.steps, h,
                                      self.clock(), accepted=int(worker["accepted"]) if worker is not None else 0)
            closed = self.rounds.check_quorum(self.clock())
            return PushAnswer(accepted=True, block=k, version=v, round_closed=k in closed, audit=audit).model_dump()

    def audit(self, name: str, k: int, v: int, body: bytes) -> dict[str, Any]:
        """Replay the audited push of ``name`` for (k, v) from its uploaded inner state; a failure quarantines it.

        Its round has waited for this decision (``Rounds.audits_pending``): a failed push is dropped before the round
        closes, so it is never applied, also where it completed the quorum."""
        self.checkpoints.check_block(k)
        case = self.auditor.take(name, k, v)
        answer: AuditAnswer | None = None
        why = "its replay broke"
        try:
            answer = self.auditor.judge(case, body, self.checkpoints.block_shapes[k])
            why = (f"its push for block {k} v{v} did not replay: relative error {answer.relative_error:.3g} (at most "
                   f"{answer.tolerance:.3g}), scale on its replay {answer.scale:.4f} (within "
                   f"{self.settings.audit_scale_tolerance:g} of 1)")
        except ProtocolError as exc:  # a malformed state fails the audit too
            answer = AuditAnswer(passed=False, relative_error=1e30, tolerance=self.settings.audit_tolerance, seconds=0.0)
            why = f"its audit upload was refused ({exc})"
        finally:  # decided under the lock, before its round may close; a replay that broke fails it too
            with self.lock:
                if answer is not None and answer.passed:
                    log.info("block %d v%d: audit of %s passed (relative error %.2g, %.2f s)", k, v, name,
                             answer.relative_error, answer.seconds)
                else:
                    self.conduct.quarantine(name, f"failed audit: {why}", self.clock())
                self.auditor.decided(name, k, v)
                self.rounds.check_quorum(self.clock())  # the decided audit may complete its round
        return answer.model_dump()

    def overdue_audits(self, now: float) -> None:
        """Quarantine the workers whose audit uploads are late (call under the lock)."""
        for case in self.auditor.overdue(now):
            if not self.conduct.quarantined(case.worker):
                self.conduct.quarantine(case.worker, f"failed audit: no state uploaded for block {case.update.block} "
                                        f"v{case.update.base_version} within {self.settings.audit_timeout_s:g} s", now)

    def record_rejection(self, name: str, k: int | None, exc: ProtocolError) -> None:
        """Log and count a refused update of an authenticated worker, durably (a ``rejections`` row)."""
        log.warning("rejected update from %s for block %s: %d %s: %s", name, k, exc.status, exc.reason, exc)
        block = k if k is not None and 0 <= k < self.checkpoints.n_blocks else None  # a bogus index is not stored
        if exc.reason == "rate_limited":  # not stored: a flood of refused requests writes nothing
            return
        with self.lock:
            now = self.clock()
            with self.store.tx():
                self.store.conduct.record_rejection(name, block, exc.status, exc.reason, str(exc), now)
            self.conduct.refused(name, exc.reason, now)
