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

A :class:`Store` composes one SQLite connection (:class:`.db.Db`, shared), the blob
directory (:class:`.blobs.BlobStore`) and one accessor per owner of its tables
(:mod:`.tables`): ``store.tokens``, ``store.workers``, ``store.rounds``,
``store.updates``, ``store.conduct``, ``store.evals``, ``store.audits`` and ``store.meta`` (the
``meta`` and ``counters`` tables). Write methods begin no transaction: the caller
groups them in :meth:`Store.tx`. ``q``/``q1`` remain for read-only audits (tests), as plain dicts.
"""

from __future__ import annotations

import sqlite3
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from blocktrain.coordinator.blobs import BlobStore
from blocktrain.coordinator.conduct_tables import AuditTable, ConductTable
from blocktrain.coordinator.db import SCHEMA_VERSION, Db
from blocktrain.coordinator.tables import (
    EvalTable,
    MetaTable,
    RoundTable,
    TokenTable,
    UpdateTable,
    WorkerTable,
    hash_token,
)
from blocktrain.errors import RunError

__all__ = ["Store", "hash_token"]


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
        self.audits = AuditTable(self.db)
        # the token table and the revoked tokens read on a second connection, without the coordinator's lock (the
        # front serialises its use): an unknown token re-reads them while a round closes, in milliseconds
        self.reads = Db(self.db_path, reader=True)
        self.token_reads, self.revocation_reads = TokenTable(self.reads), ConductTable(self.reads)
        got = self.meta.get_meta("schema_version")
        if got is None:
            self.meta.set_meta("schema_version", SCHEMA_VERSION)
        elif got != SCHEMA_VERSION:
            self.close()
            raise RunError(f"{self.db_path} has state schema {got}, this BlockTrain reads {SCHEMA_VERSION}")

    def tx(self) -> AbstractContextManager[sqlite3.Connection]:
        """One transaction (BEGIN IMMEDIATE ... COMMIT, rolled back on an exception) around the writes in it."""
        return self.db.tx()

    def q(self, sql: str, *args: Any) -> list[dict[str, Any]]:
        """A read-only query's rows as plain dicts (for audits of the state: tests, scripts)."""
        return [dict(r) for r in self.db.q(sql, *args)]

    def q1(self, sql: str, *args: Any) -> dict[str, Any] | None:
        row = self.db.q1(sql, *args)
        return None if row is None else dict(row)

    def close(self) -> None:
        self.reads.close()
        self.db.close()
