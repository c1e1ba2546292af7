"""The coordinator's SQLite connection and schema, below every table accessor (:mod:`.tables`).

One :class:`Db` per run: WAL, ``synchronous=FULL`` unless fsync is off, ``sqlite3.Row`` rows, which never leave
:mod:`.tables` (its accessors return the frozen row types of :mod:`.rows`). Write methods begin no transaction: callers group them
in :meth:`Db.tx`. Nothing here knows what a table means.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

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
    momentum_blob TEXT, weights_sha TEXT NOT NULL, created REAL NOT NULL, moments_blob TEXT, PRIMARY KEY(block, version));
CREATE TABLE IF NOT EXISTS rounds(
    block INTEGER NOT NULL, version INTEGER NOT NULL, state TEXT NOT NULL, opened REAL NOT NULL,
    deadline REAL NOT NULL, closed REAL, close_reason TEXT, n_updates INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY(block, version));
CREATE TABLE IF NOT EXISTS updates(
    id INTEGER PRIMARY KEY AUTOINCREMENT, block INTEGER NOT NULL, version INTEGER NOT NULL,
    worker TEXT NOT NULL, samples INTEGER NOT NULL, norm REAL NOT NULL, compression TEXT NOT NULL,
    blob TEXT NOT NULL, arrived REAL NOT NULL, arrival_s REAL NOT NULL, state TEXT NOT NULL,
    UNIQUE(block, version, worker));
CREATE INDEX IF NOT EXISTS updates_by_worker ON updates(block, worker, version);
-- a counted refusal reads its worker's window-th newest applied update (conduct's quarantine_window): not a scan
CREATE INDEX IF NOT EXISTS updates_by_worker_state ON updates(worker, state, arrived);
CREATE TABLE IF NOT EXISTS seeds(
    worker TEXT NOT NULL, block INTEGER NOT NULL, version INTEGER NOT NULL, seed INTEGER NOT NULL,
    stream INTEGER NOT NULL, PRIMARY KEY(worker, block, version));
CREATE TABLE IF NOT EXISTS rejections(
    id INTEGER PRIMARY KEY AUTOINCREMENT, worker TEXT, block INTEGER, status INTEGER NOT NULL,
    reason TEXT NOT NULL, message TEXT NOT NULL, at REAL NOT NULL);
-- the status page reads a round's refusals by (block, time) for each of its last 50 rounds, and every counted refusal
-- counts the worker's: without these, each was a scan of a table that grows with every refusal, under the lock
CREATE INDEX IF NOT EXISTS rejections_by_block ON rejections(block, at);
CREATE INDEX IF NOT EXISTS rejections_by_worker ON rejections(worker, reason);
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
CREATE TABLE IF NOT EXISTS audits(
    worker TEXT NOT NULL, block INTEGER NOT NULL, version INTEGER NOT NULL, blob TEXT NOT NULL, stream INTEGER NOT NULL,
    schedule_steps INTEGER NOT NULL, round_steps INTEGER NOT NULL, due REAL NOT NULL, PRIMARY KEY(worker, block, version));
CREATE TABLE IF NOT EXISTS round_refusals(
    block INTEGER NOT NULL, version INTEGER NOT NULL, worker TEXT NOT NULL, PRIMARY KEY(block, version, worker));
CREATE TABLE IF NOT EXISTS group_refusals(
    id INTEGER PRIMARY KEY AUTOINCREMENT, worker TEXT NOT NULL, block INTEGER NOT NULL, version INTEGER NOT NULL,
    uploader TEXT NOT NULL, reason TEXT NOT NULL, at REAL NOT NULL);
CREATE INDEX IF NOT EXISTS group_refusals_by_worker ON group_refusals(worker, uploader);
CREATE INDEX IF NOT EXISTS rounds_by_close ON rounds(state, closed);
"""


# (table, column, type) added since schema 1, NULL in old rows: the moments published with a version; a worker's
# registrations so far (each starts its inner state afresh), whether the last one averages in hivemind groups, and
# the registration an update was sent in, or a group member's mean stood for (coordinator.lineage); the held-out loss
# rise the gate measured for an update (nats; NULL where the gate did not run), restored into its calibration, and
# whether its norm and rise joined the histories at all (0: it claimed less than half its budget; NULL: an old row);
# the blob of an update's count sketch, which a restart reads instead of decoding the delta (NULL: an old row)
ADDED_COLUMNS = (("versions", "moments_blob", "TEXT"), ("workers", "session", "INTEGER"), ("workers", "hivemind", "INTEGER"),
                 ("updates", "session", "INTEGER"), ("group_members", "session", "INTEGER"), ("updates", "rise", "REAL"),
                 ("updates", "counted", "INTEGER"), ("updates", "sketch", "TEXT"))


class Db:
    """The SQLite connection of a run's coordinator state that writes, shared by every table accessor (not
    thread-safe: the caller holds the coordinator's lock); or, ``reader``, a second one that only reads."""

    def __init__(self, path: Path, fsync: bool = True, *, reader: bool = False) -> None:
        """The run's connection, or (``reader``) a second one to the same file that only reads, without the
        coordinator's lock: in WAL it reads the last commit while the first writes (its user serialises its use)."""
        self.path = path
        conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=30.0)
        conn.row_factory = sqlite3.Row
        if reader:
            conn.execute("PRAGMA query_only=1")
            self.conn = conn
            return
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute(f"PRAGMA synchronous={'FULL' if fsync else 'NORMAL'}")
        conn.executescript(_SCHEMA)
        for table, column, kind in ADDED_COLUMNS:  # a store written before the column: add it, NULL in old rows
            if column not in {r["name"] for r in conn.execute(f"PRAGMA table_info({table})")}:
                conn.execute(f"ALTER TABLE {table} ADD COLUMN {column} {kind}")
        self.conn = conn

    @contextmanager
    def tx(self) -> Iterator[sqlite3.Connection]:
        self.conn.execute("BEGIN IMMEDIATE")
        try:
            yield self.conn
        except BaseException:
            self.conn.execute("ROLLBACK")
            raise
        self.conn.execute("COMMIT")

    @contextmanager
    def snapshot(self) -> Iterator[None]:
        """Reads from one commit (a deferred transaction), for a reader's several queries."""
        self.conn.execute("BEGIN")
        try:
            yield
        finally:
            self.conn.execute("COMMIT")

    def execute(self, sql: str, args: tuple[Any, ...] = ()) -> None:
        self.conn.execute(sql, args)

    def executemany(self, sql: str, rows: list[tuple[Any, ...]]) -> None:
        self.conn.executemany(sql, rows)

    def q(self, sql: str, *args: Any) -> list[sqlite3.Row]:
        return list(self.conn.execute(sql, args))

    def q1(self, sql: str, *args: Any) -> sqlite3.Row | None:
        return self.conn.execute(sql, args).fetchone()

    def add_counter(self, key: str, delta: int) -> None:
        self.conn.execute(
            "INSERT INTO counters(key, value) VALUES(?, ?) ON CONFLICT(key) DO UPDATE SET value=value+excluded.value",
            (key, delta),
        )

    def close(self) -> None:
        self.conn.close()
