"""The coordinator's SQLite tables, one accessor class per owner, over the one shared connection (:class:`.db.Db`).

Every SQL statement of the coordinator is here or in :mod:`.db`, behind a method named by what it does
(``record_update``, ``open_round``, ``live_workers``, ...), and every row leaves as a frozen row type of
:mod:`.rows` with typed fields (:class:`.rows.WorkerRow`, :class:`.rows.VersionRow`, ...): no ``sqlite3.Row``
leaves this module. Each class serves one part of the coordinator:

* :class:`TokenTable` (``tokens``): the bearer tokens (:mod:`.auth`).
* :class:`WorkerTable` (``workers``): identities, leases, blocks, per-worker byte counts (:mod:`.roster`).
* :class:`RoundTable` (``versions``, ``block_states``, ``rounds``, ``round_refusals``): what every block published,
  and the workers each round no longer waits for (:mod:`.rounds`).
* :class:`UpdateTable` (``updates``, ``seeds``, ``group_members``): accepted updates (:mod:`.uploads`).
* :class:`.conduct_tables.ConductTable` (``rejections``, ``quarantine``, ``group_refusals``): refusals
  (:mod:`.conduct`), and :class:`.conduct_tables.AuditTable` (``audits``): the audits drawn and not yet decided, so
  a restart still holds their rounds; in their own module.
* :class:`EvalTable` (``evals``): the periodic evaluations (:mod:`.checkpoints`).
* :class:`MetaTable` (``meta``, ``counters``): run-wide settings and counters.

A write that keeps another table's count in step (an accepted update counts in its round and for its worker) does so
in the same statement group. Write methods begin no transaction: the caller groups them in :meth:`.store.Db.tx`.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import sqlite3
from dataclasses import dataclass

from blocktrain.coordinator.blobs import BlobStore
from blocktrain.coordinator.db import Db
from blocktrain.coordinator.rows import EvalRow, KeptRound, RoundRow, RoundTraffic, UpdateRow, VersionRow, WorkerRow
from blocktrain.coordinator.settings import CloseReason, UpdateState, WorkerState
from blocktrain.errors import ConfigError
from blocktrain.protocol.codes import BlockState, RoundState
from blocktrain.protocol.delta import Compression
from blocktrain.protocol.messages import MAX_WORKER_NAME

# the updates (of block ?, not in state ?) whose norm and rise a restart restores: not dropped, counted (NULL: a row
# from before the column), and not awaiting an audit (held again until it is decided)
_RESTORED = ("block=? AND state != ? AND counted IS NOT 0 AND NOT EXISTS (SELECT 1 FROM audits a WHERE "
             "a.worker = u.worker AND a.block = u.block AND a.version = u.version)")
# an update that is a group's mean (hivemind): its uploader recorded the group's members for its round
_GROUP_MEAN = "EXISTS (SELECT 1 FROM group_members g WHERE g.block = u.block AND g.version = u.version AND g.uploader = u.worker)"


def _kind(grouped: bool) -> str:
    """The condition on ``updates u`` that keeps group means (``grouped``) or single workers' pushes."""
    return _GROUP_MEAN if grouped else f"NOT {_GROUP_MEAN}"


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def drop_from_rounds(db: Db, rows: list[sqlite3.Row]) -> None:
    """Mark accepted updates (rows of id, block, version) dropped, and their rounds one update short each."""
    for r in rows:
        db.execute("UPDATE rounds SET n_updates=n_updates-1 WHERE block=? AND version=?", (r["block"], r["version"]))
    db.executemany("UPDATE updates SET state=? WHERE id=?", [(UpdateState.DROPPED.value, r["id"]) for r in rows])


@dataclass(frozen=True)
class TokenTable:
    """Bearer tokens, kept hashed."""

    db: Db  # the shared connection

    def add_token(self, name: str, now: float) -> str:
        """Create (or replace) the bearer token of worker ``name``; return it (shown once). The name must be 1-128
        printable characters, the name every answer carries back: a longer one was stored, then failed its first
        registration's answer with a 500 after writing the worker's row."""
        if not (1 <= len(name) <= MAX_WORKER_NAME and name.isprintable()):
            raise ConfigError(f"a worker name must be 1 to {MAX_WORKER_NAME} printable characters, got {name[:40]!r} "
                              f"({len(name)} characters); choose another")
        token = "bt_" + secrets.token_urlsafe(32)
        self.db.execute("INSERT OR REPLACE INTO tokens(name, hash, created) VALUES(?, ?, ?)", (name, hash_token(token), now))
        return token

    def revoke_token(self, name: str) -> bool:
        """Delete worker ``name``'s bearer token (it is not quarantined: a new token lets it back); whether it had one."""
        had = self.db.q1("SELECT 1 FROM tokens WHERE name=?", name) is not None
        self.db.execute("DELETE FROM tokens WHERE name=?", (name,))
        return had

    def token_hashes(self) -> list[tuple[str, str]]:
        return [(r["name"], r["hash"]) for r in self.db.q("SELECT name, hash FROM tokens ORDER BY name")]


@dataclass(frozen=True)
class WorkerTable:
    """Worker identities, leases and blocks, and the bytes each moved."""

    db: Db  # the shared connection

    def worker(self, name: str) -> WorkerRow | None:
        """The row of worker ``name`` (None if it never registered)."""
        row = self.db.q1("SELECT * FROM workers WHERE name=?", name)
        return None if row is None else WorkerRow.of(row)

    def workers(self) -> list[WorkerRow]:
        """Every worker's row, by name."""
        return [WorkerRow.of(r) for r in self.db.q("SELECT * FROM workers ORDER BY name")]

    def register_worker(self, name: str, block: int, pinned: bool, now: float, lease_until: float,
                        hivemind: bool = False) -> None:
        """Add worker ``name``, or re-register it (block, pin, active, lease; its first ``registered`` time is kept).
        Either starts a new session: a registering worker starts its inner state afresh (``coordinator.lineage``).
        ``hivemind``: it averages in groups this session."""
        self.db.execute(
            "INSERT INTO workers(name, block, pinned, state, registered, lease_until, session, hivemind) "
            "VALUES(?,?,?,?,?,?,1,?) ON CONFLICT(name) DO UPDATE SET block=excluded.block, pinned=excluded.pinned, "
            "state=excluded.state, lease_until=excluded.lease_until, session=COALESCE(workers.session, 0) + 1, "
            "hivemind=excluded.hivemind",
            (name, block, int(pinned), WorkerState.ACTIVE.value, now, lease_until, int(hivemind)),
        )

    def traceable(self, name: str) -> bool:
        """Whether the rounds of worker ``name``'s current session are on record as such (``coordinator.lineage``):
        it registered since the store had sessions, and not to average in hivemind groups."""
        return self.db.q1("SELECT 1 FROM workers WHERE name=? AND session IS NOT NULL AND hivemind=0",
                          name) is not None

    def averages_in_groups(self, name: str) -> bool:
        """Whether worker ``name`` registered this session to average in hivemind groups."""
        return self.db.q1("SELECT 1 FROM workers WHERE name=? AND hivemind=1", name) is not None

    def renew_lease(self, name: str, lease_until: float) -> None:
        """Worker ``name`` is active and holds its lease until ``lease_until``."""
        self.db.execute("UPDATE workers SET lease_until=?, state=? WHERE name=?", (lease_until, WorkerState.ACTIVE.value, name))

    def worker_left(self, name: str) -> None:
        """Worker ``name`` gave its lease back (or was quarantined)."""
        self.db.execute("UPDATE workers SET state=?, lease_until=0 WHERE name=?", (WorkerState.LEFT.value, name))

    def move_worker(self, name: str, block: int) -> None:
        self.db.execute("UPDATE workers SET block=? WHERE name=?", (block, name))

    def expired_leases(self, now: float) -> list[str]:
        """Names of the active workers whose lease ended before ``now``."""
        rows = self.db.q("SELECT name FROM workers WHERE state=? AND lease_until<?", WorkerState.ACTIVE.value, now)
        return [str(r["name"]) for r in rows]

    def extend_leases(self, until: float) -> None:
        """Active workers' leases run until ``until`` at least (a restart: none could heartbeat while it was down)."""
        self.db.execute("UPDATE workers SET lease_until=? WHERE state=? AND lease_until<?",
                        (until, WorkerState.ACTIVE.value, until))

    def lapse_worker(self, name: str) -> None:
        self.db.execute("UPDATE workers SET state=? WHERE name=?", (WorkerState.LAPSED.value, name))

    def live_by_block(self, n_blocks: int, now: float) -> dict[int, set[str]]:
        """Block -> names of the active workers on it that hold a lease at ``now``."""
        live: dict[int, set[str]] = {k: set() for k in range(n_blocks)}
        rows = self.db.q("SELECT name, block FROM workers WHERE state=? AND lease_until>=?", WorkerState.ACTIVE.value, now)
        for r in rows:
            if r["block"] is not None and 0 <= int(r["block"]) < n_blocks:
                live[int(r["block"])].add(str(r["name"]))
        return live

    def registered_on(self, k: int) -> set[str]:
        """Names of every worker registered on block k, whatever its state."""
        return {str(r["name"]) for r in self.db.q("SELECT name FROM workers WHERE block=?", k)}

    def add_bytes(self, name: str | None, n_in: int, n_out: int) -> None:
        """Count body bytes received and sent, in total and (``name`` not None) for that worker."""
        self.db.add_counter("bytes_in", n_in)
        self.db.add_counter("bytes_out", n_out)
        if name is not None:
            self.db.execute("UPDATE workers SET bytes_in=bytes_in+?, bytes_out=bytes_out+? WHERE name=?", (n_in, n_out, name))


@dataclass(frozen=True)
class RoundTable:
    """Published versions, block states and rounds of every block (and what each closed round moved)."""

    db: Db  # the shared connection
    blobs: BlobStore  # where the versions' and steps' tensors are

    def latest_version(self, k: int) -> VersionRow | None:
        """The newest ``versions`` row of block k (None before its first)."""
        row = self.db.q1("SELECT * FROM versions WHERE block=? ORDER BY version DESC LIMIT 1", k)
        return None if row is None else VersionRow.of(row)

    def add_version(self, k: int, v: int, weights_blob: str, weights_sha: str, created: float, *,
                    step_blob: str | None = None, momentum_blob: str | None = None,
                    moments_blob: str | None = None) -> None:
        """Publish version v of block k (its weights, the step and momentum that made it, the moments published
        with it)."""
        self.db.execute(
            "INSERT INTO versions(block, version, weights_blob, step_blob, momentum_blob, weights_sha, created, "
            "moments_blob) VALUES(?,?,?,?,?,?,?,?)",
            (k, v, weights_blob, step_blob, momentum_blob, weights_sha, created, moments_blob),
        )

    def drop_outer_states(self, k: int, v: int) -> set[str]:
        """Forget the outer states (momentum, residual) of block k's versions before v, which only a restart reads, from
        the newest version; returns the digests no version names any more (the caller deletes their blobs once this
        is committed)."""
        old = {str(r["momentum_blob"]) for r in self.db.q(
            "SELECT DISTINCT momentum_blob FROM versions WHERE block=? AND version<? AND momentum_blob IS NOT NULL", k, v)}
        if not old:
            return set()
        self.db.execute("UPDATE versions SET momentum_blob=NULL WHERE block=? AND version<?", (k, v))
        named = {str(r["momentum_blob"]) for r in self.db.q(
            "SELECT DISTINCT momentum_blob FROM versions WHERE momentum_blob IS NOT NULL")}
        return old - named

    def replace_weights(self, k: int, v: int, weights_blob: str, weights_sha: str) -> None:
        """Replace the weights of version v of block k, which no round has used yet (a warm start at opening)."""
        self.db.execute("UPDATE versions SET weights_blob=?, weights_sha=? WHERE block=? AND version=?", (weights_blob, weights_sha, k, v))

    def step_blob(self, k: int, v: int) -> str | None:
        """Digest of the published step that made version v of block k (None for v = 0 or unknown)."""
        row = self.db.q1("SELECT step_blob FROM versions WHERE block=? AND version=?", k, v)
        return None if row is None or not row["step_blob"] else str(row["step_blob"])

    def weights_blob(self, k: int, v: int) -> str | None:
        """Digest of the weights block k published as version v (None: unknown)."""
        row = self.db.q1("SELECT weights_blob FROM versions WHERE block=? AND version=?", k, v)
        return None if row is None else str(row["weights_blob"])

    def moments_blob(self, k: int, v: int) -> str | None:
        """Digest of the inner moments published with version v of block k (None: none)."""
        row = self.db.q1("SELECT moments_blob FROM versions WHERE block=? AND version=?", k, v)
        return None if row is None or not row["moments_blob"] else str(row["moments_blob"])

    def block_state(self, k: int) -> BlockState | None:
        """The stored state of block k (None in a store written before block states existed)."""
        row = self.db.q1("SELECT state FROM block_states WHERE block=?", k)
        return None if row is None else BlockState(row["state"])

    def set_block_state(self, k: int, state: BlockState, now: float) -> None:
        self.db.execute("INSERT OR REPLACE INTO block_states(block, state, changed) VALUES(?,?,?)", (k, state.value, now))

    def round(self, k: int, v: int) -> RoundRow | None:
        """The round of block k at version v (None if it was never opened)."""
        row = self.db.q1("SELECT * FROM rounds WHERE block=? AND version=?", k, v)
        return None if row is None else RoundRow.of(row)

    def open_round(self, k: int, v: int, opened: float, deadline: float) -> None:
        self.db.execute("INSERT OR REPLACE INTO rounds(block, version, state, opened, deadline) VALUES(?,?,?,?,?)",
                        (k, v, RoundState.OPEN.value, opened, deadline))

    def extend_round(self, k: int, v: int, deadline: float) -> None:
        self.db.execute("UPDATE rounds SET deadline=? WHERE block=? AND version=?", (deadline, k, v))

    def close_round(self, k: int, v: int, now: float, reason: CloseReason) -> None:
        """Close round v of block k: its updates are applied, and the round is counted."""
        self.db.execute("UPDATE rounds SET state=?, closed=?, close_reason=? WHERE block=? AND version=?",
                        (RoundState.CLOSED.value, now, reason.value, k, v))
        self.db.execute("UPDATE updates SET state=? WHERE block=? AND version=? AND state=?",
                        (UpdateState.APPLIED.value, k, v, UpdateState.ACCEPTED.value))
        self.db.add_counter("rounds_closed", 1)

    def mark_refused(self, k: int, v: int, names: list[str]) -> None:
        """Round v of block k refused these workers' update: it no longer waits for them (kept across a restart)."""
        self.db.executemany("INSERT OR IGNORE INTO round_refusals(block, version, worker) VALUES(?,?,?)",
                            [(k, v, n) for n in names])

    def refused(self, k: int, v: int) -> set[str]:
        """The workers round v of block k refused an update of."""
        return {str(r["worker"]) for r in self.db.q("SELECT worker FROM round_refusals WHERE block=? AND version=?", k, v)}

    def finish_round(self, k: int, v: int, now: float) -> None:
        """Version v is block k's last: its round is ``finished`` and takes no updates."""
        self.db.execute("INSERT OR REPLACE INTO rounds(block, version, state, opened, deadline) VALUES(?,?,?,?,?)",
                        (k, v, RoundState.FINISHED.value, now, now))

    def closed_rounds(self, limit: int) -> list[RoundRow]:
        """The ``limit`` most recently closed rounds, newest first."""
        rows = self.db.q("SELECT * FROM rounds WHERE state=? ORDER BY closed DESC LIMIT ?", RoundState.CLOSED.value, limit)
        return [RoundRow.of(r) for r in rows]

    def round_traffic(self, k: int, v: int, opened: float, closed: float) -> RoundTraffic:
        """What one round of block k moved and refused: its updates' body bytes, the step's bytes, refusals by reason."""
        def size(digest: str | None) -> int:
            path = None if digest is None else self.blobs.blob_path(digest)
            return path.stat().st_size if path is not None and path.is_file() else 0

        push = sum(size(str(r["blob"])) for r in self.db.q("SELECT blob FROM updates WHERE block=? AND version=?", k, v))
        rejected = {str(r["reason"]): int(r["n"]) for r in self.db.q(
            "SELECT reason, COUNT(*) AS n FROM rejections WHERE block=? AND at>=? AND at<=? GROUP BY reason",
            k, opened, closed)}
        # the step the round published is stored with the version it made
        return RoundTraffic(push, size(self.step_blob(k, v + 1)), rejected)


@dataclass(frozen=True)
class UpdateTable:
    """Accepted updates, the data streams handed out, and the members of group means (the hivemind engine)."""

    db: Db  # the shared connection

    def update_blob(self, k: int, v: int, worker: str) -> str | None:
        """Digest of ``worker``'s update for block k version v (None if it sent none)."""
        row = self.db.q1("SELECT blob FROM updates WHERE block=? AND version=? AND worker=?", k, v, worker)
        return None if row is None else str(row["blob"])

    def drop_update(self, k: int, v: int, worker: str) -> bool:
        """Drop ``worker``'s accepted update of block k version v from its round and from its accepted pushes (which
        probation counts: a push that was never verified does not count toward it); whether there was one."""
        rows = self.db.q("SELECT id, block, version FROM updates WHERE block=? AND version=? AND worker=? AND state=?",
                         k, v, worker, UpdateState.ACCEPTED.value)
        drop_from_rounds(self.db, rows)
        if rows:
            self.db.execute("UPDATE workers SET accepted=accepted-1 WHERE name=?", (worker,))
        return bool(rows)

    def probation_pushes(self, worker: str, k: int, cap: int) -> int:
        """``worker``'s pushes of block k that count toward its probation there, up to ``cap``: its own (a group's
        mean is never audited), not dropped (a push never verified does not count). Per block: counted over the run,
        a worker past its probation on one block met only the sampled audit on the next, so its first pushes there,
        which set the block's norm bound and gate calibration, went unchecked."""
        row = self.db.q1(f"SELECT COUNT(*) AS n FROM (SELECT 1 FROM updates u WHERE worker=? AND block=? AND state != ? "
                         f"AND {_kind(False)} LIMIT ?)", worker, k, UpdateState.DROPPED.value, cap)
        return 0 if row is None else int(row["n"])

    def previous_blobs(self, k: int, worker: str, before: int, n: int = 2) -> tuple[str, ...]:
        """Digests of ``worker``'s last ``n`` updates of block k against versions before ``before``, newest first."""
        rows = self.db.q("SELECT blob FROM updates WHERE block=? AND worker=? AND version<? ORDER BY version DESC "
                         "LIMIT ?", k, worker, before, n)
        return tuple(str(r["blob"]) for r in rows)

    def last_kept(self, k: int, worker: str, before: int) -> KeptRound | None:
        """``worker``'s newest update of block k against a version before ``before`` that it sent in its current session
        (answered as accepted: whatever became of it later, its inner state went on from that round), else None."""
        row = self.db.q1("SELECT u.version, u.blob, u.samples FROM updates u JOIN workers w ON w.name = u.worker "
                         "WHERE u.block=? AND u.worker=? AND u.version<? AND u.session IS w.session "
                         "ORDER BY u.version DESC LIMIT 1", k, worker, before)
        return None if row is None else KeptRound(int(row["version"]), str(row["blob"]), int(row["samples"]))

    def grouped(self, k: int, worker: str, low: int, high: int) -> bool:
        """Whether ``worker`` was in a group's mean of block k against a version in [low, high) in its current session
        (an earlier session's inner state is gone: its new one started afresh)."""
        return self.db.q1("SELECT 1 FROM group_members g JOIN workers w ON w.name = g.worker WHERE g.block=? AND "
                          "g.worker=? AND g.version>=? AND g.version<? AND g.session IS w.session LIMIT 1",
                          k, worker, low, high) is not None

    def record_update(self, k: int, v: int, worker: str, *, samples: int, norm: float, compression: str, blob: str,
                      arrived: float, arrival_s: float, rise: float | None = None, counted: bool = True,
                      sketch: str | None = None) -> None:
        """Store an accepted update and count it in its round, for its worker and in total (``rise``: the gate's
        loss rise for it, nats; ``counted``: whether its norm and rise join the block's histories; ``sketch``: the
        blob of its count sketch)."""
        self.db.execute(
            "INSERT INTO updates(block, version, worker, samples, norm, compression, blob, arrived, arrival_s, state, "
            "session, rise, counted, sketch) VALUES(?,?,?,?,?,?,?,?,?,?,(SELECT session FROM workers WHERE name=?),?,?,?)",
            (k, v, worker, samples, norm, compression, blob, arrived, arrival_s, UpdateState.ACCEPTED.value, worker,
             rise, int(counted), sketch),
        )
        self.db.execute("UPDATE rounds SET n_updates=n_updates+1 WHERE block=? AND version=?", (k, v))
        self.db.execute("UPDATE workers SET accepted=accepted+1 WHERE name=?", (worker,))
        self.db.add_counter("updates_accepted", 1)

    def reporters(self, k: int, v: int) -> set[str]:
        """Workers whose training reached block k version v: they sent an update, or were in a group's mean."""
        sent = {str(r["worker"]) for r in self.db.q("SELECT worker FROM updates WHERE block=? AND version=?", k, v)}
        grouped = self.db.q("SELECT worker FROM group_members WHERE block=? AND version=?", k, v)
        return sent | {str(r["worker"]) for r in grouped}

    def submitted(self, k: int, v: int, worker: str) -> bool:
        """``worker`` sent an update for block k version v, or was a member of a group that did."""
        return self.update_blob(k, v, worker) is not None or self.db.q1(
            "SELECT 1 FROM group_members WHERE block=? AND version=? AND worker=?", k, v, worker) is not None

    def record_group(self, k: int, v: int, uploader: str, members: list[str]) -> None:
        """The members (uploader included) whose mean ``uploader`` sent for block k version v, each with its session
        as it is now (a member that registered again since its group's round is tagged with the new one: its trace
        then stops at that round, and its uploaded moments go unbounded, never an honest worker failed)."""
        self.db.executemany("INSERT INTO group_members(block, version, worker, uploader, session) "
                            "VALUES(?,?,?,?,(SELECT session FROM workers WHERE name=?))",
                            [(k, v, m, uploader, m) for m in members])

    def groups(self, k: int, v: int) -> dict[str, list[str]]:
        """The groups of block k version v: uploader -> members."""
        out: dict[str, list[str]] = {}
        for r in self.db.q("SELECT worker, uploader FROM group_members WHERE block=? AND version=? ORDER BY worker", k, v):
            out.setdefault(str(r["uploader"]), []).append(str(r["worker"]))
        return out

    def accepted_updates(self, k: int, v: int) -> list[UpdateRow]:
        """The accepted, not yet applied updates of block k version v, in arrival order."""
        rows = self.db.q("SELECT * FROM updates WHERE block=? AND version=? AND state=? ORDER BY id", k, v,
                         UpdateState.ACCEPTED.value)
        return [UpdateRow.of(r) for r in rows]

    def update_blobs(self, k: int) -> list[tuple[str, Compression, str | None]]:
        """(blob digest, compression, sketch blob digest or None) of every update of block k ever accepted, oldest
        first, whatever became of it (applied, screened or dropped): a copy of any of them is a replay, as it was
        before a restart."""
        rows = self.db.q("SELECT blob, compression, sketch FROM updates WHERE block=? ORDER BY id", k)
        return [(str(r["blob"]), Compression(r["compression"]), None if r["sketch"] is None else str(r["sketch"]))
                for r in rows]

    def set_update_state(self, ids: list[int], state: UpdateState) -> None:
        self.db.executemany("UPDATE updates SET state=? WHERE id=?", [(state.value, i) for i in ids])

    def recent_rises(self, k: int, n: int, grouped: bool = False) -> list[float]:
        """The gate's loss rises (nats) of the ``n`` latest updates of block k that have one, newest first, chosen as
        :meth:`recent_norms` chooses its updates: what a restart restores to the gate's calibration."""
        rows = self.db.q(f"SELECT rise FROM updates u WHERE {_RESTORED} AND {_kind(grouped)} AND rise IS NOT NULL ORDER BY id "
                         "DESC LIMIT ?", k, UpdateState.DROPPED.value, n)
        return [float(r["rise"]) for r in rows]

    def held_entry(self, k: int, v: int, worker: str) -> tuple[bool, float | None]:
        """Whether ``worker``'s update of block k version v counts in the histories once its audit passes, and its
        gate's loss rise (None: none measured)."""
        row = self.db.q1("SELECT rise, counted FROM updates WHERE block=? AND version=? AND worker=?", k, v, worker)
        if row is None:
            return False, None
        return row["counted"] != 0, None if row["rise"] is None else float(row["rise"])

    def recent_norms(self, k: int, n: int, grouped: bool = False) -> list[tuple[int, float]]:
        """(version, norm) of the ``n`` latest updates of block k a restart restores to the intake's history, newest
        first: not a dropped one (its worker was quarantined, a failed audit among the reasons; a coordinator that
        never restarted keeps the norm of one dropped for its worker's refusals), nor one whose audit is pending (held
        again until it is decided, :meth:`blocktrain.coordinator.intake.Intake.hold`), nor one that did not count
        (``counted`` 0: it claimed less than half its budget, :func:`blocktrain.coordinator.intake.full_claim`);
        single workers' pushes, or (``grouped``) group means."""
        rows = self.db.q(f"SELECT version, norm FROM updates u WHERE {_RESTORED} AND {_kind(grouped)} ORDER BY id DESC LIMIT ?",
                         k, UpdateState.DROPPED.value, n)
        return [(int(r["version"]), float(r["norm"])) for r in rows]

    def record_seed(self, worker: str, k: int, v: int, seed: int, stream: int) -> None:
        """Remember the data stream handed to ``worker`` for block k version v (the first one is kept)."""
        self.db.execute("INSERT OR IGNORE INTO seeds(worker, block, version, seed, stream) VALUES(?,?,?,?,?)", (worker, k, v, seed, stream))


@dataclass(frozen=True)
class EvalTable:
    """The periodic evaluations of the assembled model."""

    db: Db  # the shared connection

    def last_eval_epoch(self) -> int | None:
        row = self.db.q1("SELECT epoch FROM evals ORDER BY id DESC LIMIT 1")
        return None if row is None else int(row["epoch"])

    def record_eval(self, epoch: int, versions: dict[int, int], ce: float, n_bytes: int, at: float) -> None:
        self.db.execute("INSERT INTO evals(epoch, versions, ce, bytes, at) VALUES(?,?,?,?,?)",
                        (epoch, json.dumps(versions), ce, n_bytes, at))

    def evals(self) -> list[EvalRow]:
        """Every evaluation, oldest first."""
        return [EvalRow.of(r) for r in self.db.q("SELECT * FROM evals ORDER BY id")]


class MetaTable:
    """Run-wide settings (``meta``: the config, the schema version, hivemind keys) and counters (``counters``)."""

    def __init__(self, db: Db) -> None:
        self.db = db

    def get_meta(self, key: str) -> str | None:
        row = self.db.q1("SELECT value FROM meta WHERE key=?", key)
        return None if row is None else str(row["value"])

    def set_meta(self, key: str, value: str) -> None:
        self.db.execute("INSERT OR REPLACE INTO meta(key, value) VALUES(?, ?)", (key, value))

    def add_counter(self, key: str, delta: int) -> None:
        self.db.add_counter(key, delta)

    def counters(self) -> dict[str, int]:
        return {r["key"]: int(r["value"]) for r in self.db.q("SELECT key, value FROM counters")}
