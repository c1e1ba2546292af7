"""The coordinator's tables of what it refused and holds workers to account for: refused updates and group means,
quarantine (:class:`ConductTable`, for :mod:`.conduct`), and the audits drawn and not yet decided
(:class:`AuditTable`, for :mod:`.uploads`). Like every table accessor (:mod:`.tables`), they hold the one shared
connection, begin no transaction and return frozen row types."""

from __future__ import annotations

import math
from dataclasses import dataclass

from blocktrain.coordinator.db import Db
from blocktrain.coordinator.rows import AuditRow
from blocktrain.coordinator.settings import UpdateState, WorkerState
from blocktrain.coordinator.tables import drop_from_rounds

__all__ = ["AuditTable", "ConductTable"]


@dataclass(frozen=True)
class ConductTable:
    """Refused updates, refused group means, and the quarantined workers."""

    db: Db  # the shared connection

    def record_rejection(self, worker: str, block: int | None, status: int, reason: str, message: str, at: float) -> None:
        """Store a refused update of an authenticated worker and count it, by reason and for that worker."""
        self.db.execute("INSERT INTO rejections(worker, block, status, reason, message, at) VALUES(?,?,?,?,?,?)",
                        (worker, block, status, reason, message, at))
        self.db.add_counter(f"rejected:{reason}", 1)
        self.db.execute("UPDATE workers SET rejected=rejected+1 WHERE name=?", (worker,))

    def counted_refusals(self, worker: str, reasons: tuple[str, ...], window: int = 0) -> int:
        """Stored refusals of ``worker`` for one of ``reasons``; with ``window``, only those since the arrival of its
        ``window``-th newest applied update (all of them while it has fewer)."""
        marks = ",".join("?" * len(reasons))
        since = None
        if window:
            row = self.db.q1("SELECT arrived FROM updates WHERE worker=? AND state=? ORDER BY arrived DESC LIMIT 1 "
                             "OFFSET ?", worker, UpdateState.APPLIED.value, window - 1)
            since = None if row is None else float(row["arrived"])
        row = self.db.q1(f"SELECT COUNT(*) AS n FROM rejections WHERE worker=? AND reason IN ({marks}) AND at > ?",
                         worker, *reasons, -math.inf if since is None else since)
        return 0 if row is None else int(row["n"])

    def record_group_refusal(self, k: int, v: int, uploader: str, members: list[str], reason: str, at: float) -> None:
        self.db.executemany("INSERT INTO group_refusals(worker, block, version, uploader, reason, at) VALUES(?,?,?,?,?,?)",
                            [(m, k, v, uploader, reason, at) for m in members])
        self.db.add_counter("groups_refused", 1)

    def refused_groups(self, worker: str) -> int:
        """How many uploaders sent refused group means ``worker`` was a member of: a mean's cards do not bind it, so
        one uploader's refused means, however many, count once (else one hostile uploader naming honest workers got
        them quarantined); its own counted refusals hold that uploader to account."""
        row = self.db.q1("SELECT COUNT(DISTINCT uploader) AS n FROM group_refusals WHERE worker=?", worker)
        return 0 if row is None else int(row["n"])

    def group_refused_workers(self) -> list[str]:
        """Every worker recorded in a refused group mean."""
        return [str(r["worker"]) for r in self.db.q("SELECT DISTINCT worker FROM group_refusals ORDER BY worker")]

    def quarantine(self, worker: str, reason: str, at: float) -> int:
        """Quarantine ``worker``: its token is revoked (its hash kept, to say so), it leaves, and its updates not yet
        applied are dropped from their rounds, group means it is a member of included (its share of one is not told
        apart); returns how many were dropped."""
        row = self.db.q1("SELECT hash FROM tokens WHERE name=?", worker)
        self.db.execute("INSERT OR REPLACE INTO quarantine(worker, token_hash, reason, at) VALUES(?,?,?,?)",
                        (worker, None if row is None else str(row["hash"]), reason, at))
        self.db.execute("DELETE FROM tokens WHERE name=?", (worker,))
        self.db.execute("UPDATE workers SET state=?, lease_until=0 WHERE name=?", (WorkerState.LEFT.value, worker))
        pending = self.db.q("SELECT id, block, version FROM updates u WHERE state=? AND (worker=? OR EXISTS (SELECT 1 "
                            "FROM group_members g WHERE g.block=u.block AND g.version=u.version AND g.uploader=u.worker "
                            "AND g.worker=?))", UpdateState.ACCEPTED.value, worker, worker)
        drop_from_rounds(self.db, pending)
        self.db.add_counter("workers_quarantined", 1)
        return len(pending)

    def quarantined(self, worker: str) -> bool:
        return self.db.q1("SELECT 1 FROM quarantine WHERE worker=?", worker) is not None

    def quarantined_workers(self) -> dict[str, str]:
        """Every quarantined worker and why."""
        return {str(r["worker"]): str(r["reason"]) for r in self.db.q("SELECT worker, reason FROM quarantine ORDER BY at")}

    def quarantined_on_block(self, k: int, since: float) -> set[str]:
        """The workers registered on block k that were quarantined after ``since`` (coordinator clock)."""
        rows = self.db.q("SELECT q.worker AS worker FROM quarantine q JOIN workers w ON w.name=q.worker "
                         "WHERE w.block=? AND q.at>?", k, since)
        return {str(r["worker"]) for r in rows}

    def revoked_peers(self, limit: int, since: float) -> list[str]:
        """The newest ``limit`` workers quarantined after ``since`` that were admitted to hivemind groups (a
        ``p2p_key``): their DHT tokens stay valid until they expire, so the workers are told whose cards no longer
        count. ``since``: the oldest quarantine whose tokens may still be valid (its tokens were issued before it).
        A name no work answer could carry, over 128 characters, is left out: it could never have registered."""
        rows = self.db.q("SELECT q.worker AS worker FROM quarantine q WHERE length(q.worker) BETWEEN 1 AND 128 AND "
                         "q.at > ? AND EXISTS (SELECT 1 FROM meta m WHERE m.key = 'p2p_key:' || q.worker) "
                         "ORDER BY q.at DESC, q.worker LIMIT ?", since, limit)
        return [str(r["worker"]) for r in rows]

    def revoked_tokens(self) -> dict[str, str]:
        """The revoked token hash of every quarantined worker that had one -> the worker."""
        return {str(r["token_hash"]): str(r["worker"])
                for r in self.db.q("SELECT worker, token_hash FROM quarantine WHERE token_hash IS NOT NULL")}


@dataclass(frozen=True)
class AuditTable:
    """The audits drawn and not yet decided."""

    db: Db  # the shared connection

    def record_audit(self, a: AuditRow) -> None:
        self.db.execute("INSERT OR REPLACE INTO audits(worker, block, version, blob, stream, schedule_steps, round_steps, "
                        "due) VALUES(?,?,?,?,?,?,?,?)", (a.worker, a.block, a.version, a.blob, a.stream,
                                                         a.schedule_steps, a.round_steps, a.due))

    def drop_audit(self, worker: str, k: int, v: int) -> None:
        self.db.execute("DELETE FROM audits WHERE worker=? AND block=? AND version=?", (worker, k, v))

    def pending_audits(self) -> list[AuditRow]:
        rows = self.db.q("SELECT * FROM audits ORDER BY block, version, worker")
        return [AuditRow(str(r["worker"]), int(r["block"]), int(r["version"]), str(r["blob"]), int(r["stream"]),
                         int(r["schedule_steps"]), int(r["round_steps"]), float(r["due"])) for r in rows]
