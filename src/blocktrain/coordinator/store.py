"""Durable coordinator state: SQLite (stdlib) plus content-addressed safetensors blobs.

Layout inside the run directory::

    RUN/coordinator/state.sqlite3          tables below (WAL, synchronous=FULL)
    RUN/coordinator/blobs/<sha256>.safetensors   weights, deltas, momentum, updates

A blob is named by the sha256 of its bytes and written atomically (temp file,
fsync, rename) *before* the row that refers to it is committed, so after a
crash every committed row points at a complete file. Nothing accepted is lost:
an update is acknowledged only after its row is committed. An update body is
first staged in a temp file and named only once it is accepted, so refused
updates leave nothing behind.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from blocktrain.checkpoint.safetensors_io import atomic_write_bytes
from blocktrain.errors import CheckpointError, RunError

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
"""


@dataclass
class StagedBlob:
    """A blob written to a temp file but not yet named (see :meth:`Store.stage_blob`)."""

    digest: str
    tmp: Path | None  # None: nothing to rename (already stored, committed or discarded)


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class Store:
    """SQLite connection + blob directory. Not thread-safe: the caller holds a lock."""

    def __init__(self, root: Path, fsync: bool = True) -> None:
        self.fsync = fsync  # False: survives process crashes (kill -9) but not power loss
        self.root = Path(root) / "coordinator"
        self.blob_dir = self.root / "blobs"
        self.blob_dir.mkdir(parents=True, exist_ok=True)
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

    # --- blobs ------------------------------------------------------------
    def put_blob(self, payload: bytes) -> str:
        """Write ``payload`` under its sha256 (idempotent); return the digest."""
        digest = hashlib.sha256(payload).hexdigest()
        path = self.blob_path(digest)
        if not path.exists():
            if self.fsync:
                atomic_write_bytes(path, payload)
            else:  # temp file + rename: atomic, and in the page cache once written (safe from kill -9)
                tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
                tmp.write_bytes(payload)
                os.replace(tmp, path)
        return digest

    def stage_blob(self, payload: bytes) -> StagedBlob:
        """Write ``payload`` to a temp file in the blob directory (fsynced); it is named only by :meth:`commit_blob`.

        Lets the slow write happen outside the caller's lock, while a blob that is then refused
        (:meth:`discard_blob`) never appears under a name. Named blobs are never deleted, so a digest
        that is already stored needs no temp file.
        """
        digest = hashlib.sha256(payload).hexdigest()
        if self.blob_path(digest).exists():
            return StagedBlob(digest, None)
        tmp = self.blob_dir / f".{digest}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(payload)
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return StagedBlob(digest, tmp)

    def commit_blob(self, staged: StagedBlob) -> str:
        """Name a staged blob by its digest (atomic rename); return the digest."""
        if staged.tmp is not None:
            os.replace(staged.tmp, self.blob_path(staged.digest))
            staged.tmp = None
        return staged.digest

    def discard_blob(self, staged: StagedBlob) -> None:
        """Delete a staged blob that was not committed (no-op after :meth:`commit_blob`)."""
        if staged.tmp is not None:
            staged.tmp.unlink(missing_ok=True)
            staged.tmp = None

    def blob_path(self, digest: str) -> Path:
        return self.blob_dir / f"{digest}.safetensors"

    def get_blob(self, digest: str) -> bytes:
        path = self.blob_path(digest)
        if not path.is_file():
            raise CheckpointError(f"blob {digest} is missing from {self.blob_dir}; the coordinator state is damaged")
        payload = path.read_bytes()
        if hashlib.sha256(payload).hexdigest() != digest:
            raise CheckpointError(f"blob {path} does not match its sha256 name; the coordinator state is damaged")
        return payload

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
