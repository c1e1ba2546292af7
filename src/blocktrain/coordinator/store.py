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

A :class:`Store` composes one SQLite connection (:class:`Db`, shared), the blob
directory (:class:`.blobs.BlobStore`) and one accessor per owner of its tables
(:mod:`.tables`): ``store.tokens``, ``store.workers``, ``store.rounds``,
``store.updates``, ``store.conduct``, ``store.evals``, and ``store.meta`` (the
``meta`` and ``counters`` tables). Write methods begin no transaction: the caller
groups them in :meth:`Store.tx`. ``q``/``q1`` remain for read-only audits (tests).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

from blocktrain.coordinator.blobs import BlobStore
from blocktrain.coordinator.tables import (
    ConductTable,
    EvalTable,
    RoundTable,
    TokenTable,
    UpdateTable,
    WorkerTable,
    hash_token,
)
from blocktrain.errors import RunError

__all__ = ["SCHEMA_VERSION", "Db", "MetaTable", "Store", "hash_token"]

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


class Db:
    """The one SQLite connection of a run's coordinator state, shared by every table accessor. Not thread-safe: the
    caller holds the coordinator's lock."""

    def __init__(self, path: Path, fsync: bool = True) -> None:
        self.path = path
        self.conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=30.0)
        self.conn.row_factory = sqlite3.Row
        self.conn.execute("PRAGMA journal_mode=WAL")
        self.conn.execute(f"PRAGMA synchronous={'FULL' if fsync else 'NORMAL'}")
        self.conn.executescript(_SCHEMA)

    @contextmanager
    def tx(self) -> Iterator[sqlite3.Connection]:
        self.conn.execute("BEGIN IMMEDIATE")
        try:
            yield self.conn
        except BaseException:
            self.conn.execute("ROLLBACK")
            raise
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


class Store:
    """The coordinator's durable state: one SQLite file, the blob directory, and an accessor per table owner."""

    def __init__(self, root: Path, fsync: bool = True) -> None:
        self.root = Path(root) / "coordinator"
        self.blobs = BlobStore(self.root / "blobs", fsync)
        self.db_path = self.root / "state.sqlite3"
        self.db = Db(self.db_path, fsync)
        self.meta = MetaTable(self.db)
        self.tokens = TokenTable(self.db)
        self.workers = WorkerTable(self.db)
        self.rounds = RoundTable(self.db, self.blobs)
        self.updates = UpdateTable(self.db)
        self.conduct = ConductTable(self.db)
        self.evals = EvalTable(self.db)
        got = self.meta.get_meta("schema_version")
        if got is None:
            self.meta.set_meta("schema_version", SCHEMA_VERSION)
        elif got != SCHEMA_VERSION:
            raise RunError(f"{self.db_path} has state schema {got}, this BlockTrain reads {SCHEMA_VERSION}")

    def tx(self) -> AbstractContextManager[sqlite3.Connection]:
        """One transaction (BEGIN IMMEDIATE ... COMMIT, rolled back on an exception) around the writes in it."""
        return self.db.tx()

    def q(self, sql: str, *args: Any) -> list[sqlite3.Row]:
        return self.db.q(sql, *args)

    def q1(self, sql: str, *args: Any) -> sqlite3.Row | None:
        return self.db.q1(sql, *args)

    def close(self) -> None:
        self.db.close()
