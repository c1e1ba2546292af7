"""Content-addressed safetensors blobs of the coordinator: weights, steps, momentum, updates.

A blob is named by the sha256 of its bytes (``<sha256>.safetensors``) and written
atomically (temp file, fsync, rename), so a name always points at a complete
file. Named blobs are kept, but for the outer states (momentum, residual) of versions older than a block's newest,
which only a restart reads, from the newest: they are deleted once no row names them (:meth:`BlobStore.delete_blob`;
no update, weights or step blob can share their bytes, which name their kind). An update body is first staged in a temp
file and named only once it is accepted (:meth:`BlobStore.stage_blob`), so
refused updates leave nothing behind. The rows that name blobs live in
:mod:`.store`.
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

from blocktrain.checkpoint.safetensors_io import atomic_write_bytes, fsync_dir
from blocktrain.errors import CheckpointError

log = logging.getLogger(__name__)

STALE_TMP_S = 3600.0  # seconds after which a temp file in the blob directory is a crash's leftover


@dataclass
class StagedBlob:
    """A blob written to a temp file but not yet named (see :meth:`BlobStore.stage_blob`)."""

    digest: str
    tmp: Path | None  # None: nothing to rename (already stored, committed or discarded)


class BlobStore:
    """A directory of blobs named by their sha256."""

    def __init__(self, blob_dir: Path, fsync: bool = True) -> None:
        self.fsync = fsync  # False: survives process crashes (kill -9) but not power loss
        self.blob_dir = Path(blob_dir)
        self.blob_dir.mkdir(parents=True, exist_ok=True)
        self.sweep_stale()

    def sweep_stale(self, older_than_s: float = STALE_TMP_S) -> int:
        """Delete the temp files a crash left (a staged update body, a blob being written), once older than
        ``older_than_s``: a live writer's are seconds old (another process reading this store never removes them);
        a crash during N pushes left N bodies of up to the body cap for good. Returns how many were deleted."""
        now, n, size = time.time(), 0, 0
        for tmp in self.blob_dir.glob(".*.tmp"):
            try:
                st = tmp.stat()
                if now - st.st_mtime > older_than_s:
                    tmp.unlink()
                    n, size = n + 1, size + st.st_size
            except FileNotFoundError:  # committed or discarded meanwhile
                continue
        if n:
            log.info("deleted %d temp file(s) of %d bytes a crash left in %s", n, size, self.blob_dir)
        return n

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
        (:meth:`discard_blob`) never appears under a name. Named update blobs are never deleted, so a digest
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

    def commit_blob(self, *staged: StagedBlob) -> None:
        """Name staged blobs by their digests (atomic renames), the names made durable by one fsync of the directory
        (before the row that names them is committed: a power loss could keep the row and lose a name)."""
        renamed = False
        for blob in staged:
            if blob.tmp is not None:
                os.replace(blob.tmp, self.blob_path(blob.digest))
                blob.tmp = None
                renamed = True
        if renamed and self.fsync:
            fsync_dir(self.blob_dir)

    def discard_blob(self, staged: StagedBlob) -> None:
        """Delete a staged blob that was not committed (no-op after :meth:`commit_blob`)."""
        if staged.tmp is not None:
            staged.tmp.unlink(missing_ok=True)
            staged.tmp = None

    def delete_blob(self, digest: str) -> None:
        """Delete a named blob that no row names any more (an old version's outer state)."""
        self.blob_path(digest).unlink(missing_ok=True)

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
