"""Durable coordinator state: SQLite (stdlib) plus content-addressed safetensors blobs (:mod:`.blobs`).

Layout inside the run directory::

    RUN/coordinator/state.sqlite3          tables below (WAL, synchronous=FULL)
    RUN/coordinator/blobs/<sha256>.safetensors   weights, deltas, momentum, updates

A blob is named by the sha256 of its bytes and written atomically (temp file,
fsync, rename) *before* the row that refers to it is committed, so after a
crash every committed row points at a complete file. Nothing accepted is lost:
an update is acknowledged only after its row is committed. An update body is
first staged in a temp file and named only once it is accepted, so refused
updates leave nothing behind.

Every SQL statement of the coordinator is here, behind a :class:`Store` method
named by what it does (``record_update``, ``open_round``, ``live_workers``, ...).
Write methods begin no transaction: the caller groups them in :meth:`Store.tx`.
``q``/``q1`` remain for read-only audits (tests).
"""

from __future__ import annotations

import hashlib
import json
import secrets
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from blocktrain.coordinator.blobs import BlobStore
from blocktrain.coordinator.settings import BlockState, CloseReason, RoundState, UpdateState, WorkerState
from blocktrain.errors import RunError

SCHEMA_VERSION = "1"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta(key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS tokens(name TEXT PRIMARY KEY, hash TEXT NOT NULL, created REAL NOT NULL);
CREATE TABLE IF NOT EXISTS workers(
    id INTEGER PRIMARY KEY AUTOINCREMENT, name TEXT UNIQUE NOT NULL, block INTEGER, pinned INTEGER NOT NULL,
    state TEXT NOT NULL, registered REAL NOT NULL, lease_until REAL NOT NULL,
    bytes_in INTEGER NOT NULL DEFAULT 0, bytes_out INTEGER NOT NULL DEFAULT 0,
    accepted INTEGER NOT NULL DEFAULT 0, rejected INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS versions(
    block INTEGER NOT NULL, version INTEGER NOT NULL, weights_blob TEXT NOT NULL, step_blob TEXT,
    momentum_blob TEXT, weights_sha TEXT NOT NULL, created REAL NOT NULL, PRIMARY KEY(block, version));
CREATE TABLE IF NOT EXISTS rounds(
    block INTEGER NOT NULL, version INTEGER NOT NULL, state TEXT NOT NULL, opened REAL NOT NULL,
    deadline REAL NOT NULL, closed REAL, close_reason TEXT, n_updates INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY(block, version));
CREATE TABLE IF NOT EXISTS updates(
    id INTEGER PRIMARY KEY AUTOINCREMENT, block INTEGER NOT NULL, version INTEGER NOT NULL,
    worker TEXT NOT NULL, samples INTEGER NOT NULL, norm REAL NOT NULL, compression TEXT NOT NULL,
    blob TEXT NOT NULL, arrived REAL NOT NULL, arrival_s REAL NOT NULL, state TEXT NOT NULL,
    UNIQUE(block, version, worker));
CREATE TABLE IF NOT EXISTS seeds(
    worker TEXT NOT NULL, block INTEGER NOT NULL, version INTEGER NOT NULL, seed INTEGER NOT NULL,
    stream INTEGER NOT NULL, PRIMARY KEY(worker, block, version));
CREATE TABLE IF NOT EXISTS rejections(
    id INTEGER PRIMARY KEY AUTOINCREMENT, worker TEXT, block INTEGER, status INTEGER NOT NULL,
    reason TEXT NOT NULL, message TEXT NOT NULL, at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS evals(
    id INTEGER PRIMARY KEY AUTOINCREMENT, epoch INTEGER NOT NULL, versions TEXT NOT NULL,
    ce REAL NOT NULL, bytes INTEGER NOT NULL, at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS counters(key TEXT PRIMARY KEY, value INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS block_states(block INTEGER PRIMARY KEY, state TEXT NOT NULL, changed REAL NOT NULL);
CREATE TABLE IF NOT EXISTS group_members(
    block INTEGER NOT NULL, version INTEGER NOT NULL, worker TEXT NOT NULL, uploader TEXT NOT NULL,
    PRIMARY KEY(block, version, worker));
CREATE TABLE IF NOT EXISTS quarantine(
    worker TEXT PRIMARY KEY, token_hash TEXT, reason TEXT NOT NULL, at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS group_refusals(
    id INTEGER PRIMARY KEY AUTOINCREMENT, worker TEXT NOT NULL, block INTEGER NOT NULL, version INTEGER NOT NULL,
    uploader TEXT NOT NULL, reason TEXT NOT NULL, at REAL NOT NULL);
"""


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class Store(BlobStore):
    """SQLite connection + blob directory (:class:`.blobs.BlobStore`). Not thread-safe: the caller holds a lock."""

    def __init__(self, root: Path, fsync: bool = True) -> None:
        self.root = Path(root) / "coordinator"
        super().__init__(self.root / "blobs", fsync)
        self.db_path = self.root / "state.sqlite3"
        self.db = sqlite3.connect(self.db_path, isolation_level=None, check_same_thread=False, timeout=30.0)
        self.db.row_factory = sqlite3.Row
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute(f"PRAGMA synchronous={'FULL' if fsync else 'NORMAL'}")
        self.db.executescript(_SCHEMA)
        got = self.get_meta("schema_version")
        if got is None:
            self.set_meta("schema_version", SCHEMA_VERSION)
        elif got != SCHEMA_VERSION:
            raise RunError(f"{self.db_path} has state schema {got}, this BlockTrain reads {SCHEMA_VERSION}")

    def close(self) -> None:
        self.db.close()

    # --- transactions ----------------------------------------------------
    @contextmanager
    def tx(self) -> Iterator[sqlite3.Connection]:
        self.db.execute("BEGIN IMMEDIATE")
        try:
            yield self.db
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        self.db.execute("COMMIT")

    def q(self, sql: str, *args: Any) -> list[sqlite3.Row]:
        return list(self.db.execute(sql, args))

    def q1(self, sql: str, *args: Any) -> sqlite3.Row | None:
        return self.db.execute(sql, args).fetchone()

    # --- meta and counters ------------------------------------------------
    def get_meta(self, key: str) -> str | None:
        row = self.q1("SELECT value FROM meta WHERE key=?", key)
        return None if row is None else str(row["value"])

    def set_meta(self, key: str, value: str) -> None:
        self.db.execute("INSERT OR REPLACE INTO meta(key, value) VALUES(?, ?)", (key, value))

    def add_counter(self, key: str, delta: int) -> None:
        self.db.execute(
            "INSERT INTO counters(key, value) VALUES(?, ?) ON CONFLICT(key) DO UPDATE SET value=value+excluded.value",
            (key, delta),
        )

    def counters(self) -> dict[str, int]:
        return {r["key"]: int(r["value"]) for r in self.q("SELECT key, value FROM counters")}

    # --- tokens -----------------------------------------------------------
    def add_token(self, name: str, now: float) -> str:
        """Create (or replace) the bearer token of worker ``name``; return it (shown once)."""
        token = "bt_" + secrets.token_urlsafe(32)
        self.db.execute(
            "INSERT OR REPLACE INTO tokens(name, hash, created) VALUES(?, ?, ?)", (name, hash_token(token), now)
        )
        return token

    def token_hashes(self) -> list[tuple[str, str]]:
        return [(r["name"], r["hash"]) for r in self.q("SELECT name, hash FROM tokens ORDER BY name")]

    # --- workers ----------------------------------------------------------
    def worker(self, name: str) -> sqlite3.Row | None:
        """The row of worker ``name`` (None if it never registered)."""
        return self.q1("SELECT * FROM workers WHERE name=?", name)

    def workers(self) -> list[sqlite3.Row]:
        """Every worker's row, by name."""
        return self.q("SELECT * FROM workers ORDER BY name")

    def register_worker(self, name: str, block: int, pinned: bool, now: float, lease_until: float) -> None:
        """Add worker ``name``, or re-register it (block, pin, active, lease; its first ``registered`` time is kept)."""
        self.db.execute(
            "INSERT INTO workers(name, block, pinned, state, registered, lease_until) VALUES(?,?,?,?,?,?) "
            "ON CONFLICT(name) DO UPDATE SET block=excluded.block, pinned=excluded.pinned, "
            "state=excluded.state, lease_until=excluded.lease_until",
            (name, block, int(pinned), WorkerState.ACTIVE.value, now, lease_until),
        )

    def renew_lease(self, name: str, lease_until: float) -> None:
        """Worker ``name`` is active and holds its lease until ``lease_until``."""
        self.db.execute(
            "UPDATE workers SET lease_until=?, state=? WHERE name=?", (lease_until, WorkerState.ACTIVE.value, name)
        )

    def worker_left(self, name: str) -> None:
        """Worker ``name`` gave its lease back."""
        self.db.execute("UPDATE workers SET state=?, lease_until=0 WHERE name=?", (WorkerState.LEFT.value, name))

    def move_worker(self, name: str, block: int) -> None:
        self.db.execute("UPDATE workers SET block=? WHERE name=?", (block, name))

    def expired_leases(self, now: float) -> list[str]:
        """Names of the active workers whose lease ended before ``now``."""
        rows = self.q("SELECT name FROM workers WHERE state=? AND lease_until<?", WorkerState.ACTIVE.value, now)
        return [str(r["name"]) for r in rows]

    def lapse_worker(self, name: str) -> None:
        self.db.execute("UPDATE workers SET state=? WHERE name=?", (WorkerState.LAPSED.value, name))

    def live_workers(self, now: float) -> list[tuple[str, int | None]]:
        """(name, block) of every active worker that holds a lease at ``now``."""
        rows = self.q("SELECT name, block FROM workers WHERE state=? AND lease_until>=?", WorkerState.ACTIVE.value, now)
        return [(str(r["name"]), r["block"]) for r in rows]

    def add_bytes(self, name: str | None, n_in: int, n_out: int) -> None:
        """Count body bytes received and sent, in total and (``name`` not None) for that worker."""
        self.add_counter("bytes_in", n_in)
        self.add_counter("bytes_out", n_out)
        if name is not None:
            self.db.execute(
                "UPDATE workers SET bytes_in=bytes_in+?, bytes_out=bytes_out+? WHERE name=?", (n_in, n_out, name)
            )

    # --- versions and block states -----------------------------------------
    def latest_version(self, k: int) -> sqlite3.Row | None:
        """The newest ``versions`` row of block k (None before its first)."""
        return self.q1("SELECT * FROM versions WHERE block=? ORDER BY version DESC LIMIT 1", k)

    def add_version(self, k: int, v: int, weights_blob: str, weights_sha: str, created: float, *,
                    step_blob: str | None = None, momentum_blob: str | None = None) -> None:
        """Publish version v of block k (its weights, and the step and momentum that made it)."""
        self.db.execute(
            "INSERT INTO versions(block, version, weights_blob, step_blob, momentum_blob, weights_sha, created) "
            "VALUES(?,?,?,?,?,?,?)",
            (k, v, weights_blob, step_blob, momentum_blob, weights_sha, created),
        )

    def replace_weights(self, k: int, v: int, weights_blob: str, weights_sha: str) -> None:
        """Replace the weights of version v of block k, which no round has used yet (a warm start at opening)."""
        self.db.execute("UPDATE versions SET weights_blob=?, weights_sha=? WHERE block=? AND version=?",
                        (weights_blob, weights_sha, k, v))

    def step_blob(self, k: int, v: int) -> str | None:
        """Digest of the published step that made version v of block k (None for v = 0 or unknown)."""
        row = self.q1("SELECT step_blob FROM versions WHERE block=? AND version=?", k, v)
        return None if row is None or not row["step_blob"] else str(row["step_blob"])

    def block_state(self, k: int) -> BlockState | None:
        """The stored state of block k (None in a store written before block states existed)."""
        row = self.q1("SELECT state FROM block_states WHERE block=?", k)
        return None if row is None else BlockState(row["state"])

    def set_block_state(self, k: int, state: BlockState, now: float) -> None:
        self.db.execute(
            "INSERT OR REPLACE INTO block_states(block, state, changed) VALUES(?,?,?)", (k, state.value, now)
        )

    # --- rounds -------------------------------------------------------------
    def round(self, k: int, v: int) -> sqlite3.Row | None:
        """The round of block k at version v (None if it was never opened)."""
        return self.q1("SELECT * FROM rounds WHERE block=? AND version=?", k, v)

    def open_round(self, k: int, v: int, opened: float, deadline: float) -> None:
        self.db.execute(
            "INSERT OR REPLACE INTO rounds(block, version, state, opened, deadline) VALUES(?,?,?,?,?)",
            (k, v, RoundState.OPEN.value, opened, deadline),
        )

    def extend_round(self, k: int, v: int, deadline: float) -> None:
        self.db.execute("UPDATE rounds SET deadline=? WHERE block=? AND version=?", (deadline, k, v))

    def close_round(self, k: int, v: int, now: float, reason: CloseReason) -> None:
        """Close round v of block k: its updates are applied, and the round is counted."""
        self.db.execute(
            "UPDATE rounds SET state=?, closed=?, close_reason=? WHERE block=? AND version=?",
            (RoundState.CLOSED.value, now, reason.value, k, v),
        )
        self.db.execute("UPDATE updates SET state=? WHERE block=? AND version=? AND state=?",
                        (UpdateState.APPLIED.value, k, v, UpdateState.ACCEPTED.value))
        self.add_counter("rounds_closed", 1)

    def finish_round(self, k: int, v: int, now: float) -> None:
        """Version v is block k's last: its round is ``finished`` and takes no updates."""
        self.db.execute(
            "INSERT OR REPLACE INTO rounds(block, version, state, opened, deadline) VALUES(?,?,?,?,?)",
            (k, v, RoundState.FINISHED.value, now, now),
        )

    def closed_rounds(self, limit: int) -> list[sqlite3.Row]:
        """The ``limit`` most recently closed rounds, newest first."""
        return self.q("SELECT * FROM rounds WHERE state=? ORDER BY closed DESC LIMIT ?", RoundState.CLOSED.value, limit)

    # --- updates, seeds, rejections -------------------------------------------
    def update_blob(self, k: int, v: int, worker: str) -> str | None:
        """Digest of ``worker``'s update for block k version v (None if it sent none)."""
        row = self.q1("SELECT blob FROM updates WHERE block=? AND version=? AND worker=?", k, v, worker)
        return None if row is None else str(row["blob"])

    def record_update(self, k: int, v: int, worker: str, *, samples: int, norm: float, compression: str, blob: str,
                      arrived: float, arrival_s: float) -> None:
        """Store an accepted update and count it in its round, for its worker and in total."""
        self.db.execute(
            "INSERT INTO updates(block, version, worker, samples, norm, compression, blob, arrived, arrival_s, state) "
            "VALUES(?,?,?,?,?,?,?,?,?,?)",
            (k, v, worker, samples, norm, compression, blob, arrived, arrival_s, UpdateState.ACCEPTED.value),
        )
        self.db.execute("UPDATE rounds SET n_updates=n_updates+1 WHERE block=? AND version=?", (k, v))
        self.db.execute("UPDATE workers SET accepted=accepted+1 WHERE name=?", (worker,))
        self.add_counter("updates_accepted", 1)

    def round_traffic(self, k: int, v: int, opened: float, closed: float) -> dict[str, Any]:
        """What one round of block k moved and refused: its updates' body bytes, the step's bytes, refusals by reason."""
        push = sum(self.blob_path(str(r["blob"])).stat().st_size if self.blob_path(str(r["blob"])).is_file() else 0
                   for r in self.q("SELECT blob FROM updates WHERE block=? AND version=?", k, v))
        step = self.step_blob(k, v + 1)  # the step the round published, stored with the version it made
        step_bytes = self.blob_path(step).stat().st_size if step is not None and self.blob_path(step).is_file() else 0
        rejected = {str(r["reason"]): int(r["n"]) for r in self.q(
            "SELECT reason, COUNT(*) AS n FROM rejections WHERE block=? AND at>=? AND at<=? GROUP BY reason",
            k, opened, closed)}
        return {"push_bytes": push, "step_bytes": step_bytes, "rejected": rejected}

    def reporters(self, k: int, v: int) -> set[str]:
        """Workers whose training reached block k version v: they sent an update, or were in a group's mean."""
        sent = {str(r["worker"]) for r in self.q("SELECT worker FROM updates WHERE block=? AND version=?", k, v)}
        return sent | {str(r["worker"]) for r in self.q("SELECT worker FROM group_members WHERE block=? AND version=?", k, v)}

    def submitted(self, k: int, v: int, worker: str) -> bool:
        """``worker`` sent an update for block k version v, or was a member of a group that did."""
        return self.update_blob(k, v, worker) is not None or self.q1(
            "SELECT 1 FROM group_members WHERE block=? AND version=? AND worker=?", k, v, worker) is not None

    # --- groups (the hivemind engine) ----------------------------------------------
    def record_group(self, k: int, v: int, uploader: str, members: list[str]) -> None:
        """The members (uploader included) whose mean ``uploader`` sent for block k version v."""
        self.db.executemany("INSERT INTO group_members(block, version, worker, uploader) VALUES(?,?,?,?)",
                            [(k, v, m, uploader) for m in members])

    def groups(self, k: int, v: int) -> dict[str, list[str]]:
        """The groups of block k version v: uploader -> members."""
        out: dict[str, list[str]] = {}
        for r in self.q("SELECT worker, uploader FROM group_members WHERE block=? AND version=? ORDER BY worker", k, v):
            out.setdefault(str(r["uploader"]), []).append(str(r["worker"]))
        return out

    def record_group_refusal(self, k: int, v: int, uploader: str, members: list[str], reason: str, at: float) -> None:
        self.db.executemany(
            "INSERT INTO group_refusals(worker, block, version, uploader, reason, at) VALUES(?,?,?,?,?,?)",
            [(m, k, v, uploader, reason, at) for m in members])
        self.add_counter("groups_refused", 1)

    def refused_groups(self, worker: str) -> int:
        """How many refused group means ``worker`` was a member of."""
        row = self.q1("SELECT COUNT(DISTINCT block || ':' || version || ':' || uploader) AS n FROM group_refusals "
                      "WHERE worker=?", worker)
        return 0 if row is None else int(row["n"])

    def accepted_updates(self, k: int, v: int) -> list[sqlite3.Row]:
        """The accepted, not yet applied updates of block k version v, in arrival order."""
        return self.q(
            "SELECT * FROM updates WHERE block=? AND version=? AND state=? ORDER BY id", k, v, UpdateState.ACCEPTED.value
        )

    def update_blobs(self, k: int) -> list[tuple[str, str]]:
        """(blob digest, compression) of every accepted or applied update of block k, oldest first."""
        rows = self.q("SELECT blob, compression FROM updates WHERE block=? AND state IN (?, ?) ORDER BY id", k,
                      UpdateState.ACCEPTED.value, UpdateState.APPLIED.value)
        return [(str(r["blob"]), str(r["compression"])) for r in rows]

    def set_update_state(self, ids: list[int], state: UpdateState) -> None:
        self.db.executemany("UPDATE updates SET state=? WHERE id=?", [(state.value, i) for i in ids])

    # --- quarantine ------------------------------------------------------------------
    def counted_refusals(self, worker: str, reasons: tuple[str, ...]) -> int:
        """Stored refusals of ``worker`` for one of ``reasons``."""
        marks = ",".join("?" * len(reasons))
        row = self.q1(f"SELECT COUNT(*) AS n FROM rejections WHERE worker=? AND reason IN ({marks})", worker, *reasons)
        return 0 if row is None else int(row["n"])

    def quarantine(self, worker: str, reason: str, at: float) -> int:
        """Quarantine ``worker``: its token is revoked (its hash kept, to say so), it leaves, and its updates not yet
        applied are dropped from their rounds; returns how many were dropped."""
        row = self.q1("SELECT hash FROM tokens WHERE name=?", worker)
        self.db.execute("INSERT OR REPLACE INTO quarantine(worker, token_hash, reason, at) VALUES(?,?,?,?)",
                        (worker, None if row is None else str(row["hash"]), reason, at))
        self.db.execute("DELETE FROM tokens WHERE name=?", (worker,))
        self.worker_left(worker)
        pending = self.q("SELECT id, block, version FROM updates WHERE worker=? AND state=?", worker,
                         UpdateState.ACCEPTED.value)
        for r in pending:
            self.db.execute("UPDATE rounds SET n_updates=n_updates-1 WHERE block=? AND version=?", (r["block"], r["version"]))
        self.set_update_state([int(r["id"]) for r in pending], UpdateState.DROPPED)
        self.add_counter("workers_quarantined", 1)
        return len(pending)

    def quarantined(self, worker: str) -> bool:
        return self.q1("SELECT 1 FROM quarantine WHERE worker=?", worker) is not None

    def quarantined_workers(self) -> dict[str, str]:
        """Every quarantined worker and why."""
        return {str(r["worker"]): str(r["reason"]) for r in self.q("SELECT worker, reason FROM quarantine ORDER BY at")}

    def quarantined_token(self, token_hash: str) -> str | None:
        """The quarantined worker whose revoked token has this hash, if any."""
        row = self.q1("SELECT worker FROM quarantine WHERE token_hash=?", token_hash)
        return None if row is None else str(row["worker"])

    def recent_norms(self, k: int, n: int) -> list[float]:
        """Norms of the ``n`` latest updates of block k, newest first."""
        return [float(r["norm"]) for r in self.q("SELECT norm FROM updates WHERE block=? ORDER BY id DESC LIMIT ?", k, n)]

    def record_seed(self, worker: str, k: int, v: int, seed: int, stream: int) -> None:
        """Remember the data stream handed to ``worker`` for block k version v (the first one is kept)."""
        self.db.execute(
            "INSERT OR IGNORE INTO seeds(worker, block, version, seed, stream) VALUES(?,?,?,?,?)",
            (worker, k, v, seed, stream),
        )

    def record_rejection(self, worker: str, block: int | None, status: int, reason: str, message: str, at: float) -> None:
        """Store a refused update of an authenticated worker and count it, by reason and for that worker."""
        self.db.execute(
            "INSERT INTO rejections(worker, block, status, reason, message, at) VALUES(?,?,?,?,?,?)",
            (worker, block, status, reason, message, at),
        )
        self.add_counter(f"rejected:{reason}", 1)
        self.db.execute("UPDATE workers SET rejected=rejected+1 WHERE name=?", (worker,))

    # --- evaluations --------------------------------------------------------------
    def last_eval_epoch(self) -> int | None:
        row = self.q1("SELECT epoch FROM evals ORDER BY id DESC LIMIT 1")
        return None if row is None else int(row["epoch"])

    def record_eval(self, epoch: int, versions: dict[int, int], ce: float, n_bytes: int, at: float) -> None:
        self.db.execute(
            "INSERT INTO evals(epoch, versions, ce, bytes, at) VALUES(?,?,?,?,?)",
            (epoch, json.dumps(versions), ce, n_bytes, at),
        )

    def evals(self) -> list[sqlite3.Row]:
        """Every evaluation, oldest first (``versions`` is JSON)."""
        return self.q("SELECT * FROM evals ORDER BY id")
