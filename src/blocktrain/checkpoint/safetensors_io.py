"""Tensors on disk and on the wire: safetensors only, never pickle.

Every file or payload carries a metadata header with

* ``format`` = ``"blocktrain"`` and ``format_version`` (bumped on breaking change);
* ``sha256``: digest of the tensors' canonical form (sorted names, dtype,
  shape, byte count, raw little-endian bytes), checked on every load;
* ``meta_sha256`` (version 2 on): digest of the free-form fields' canonical JSON, checked on every load, so a
  damaged config or block index is caught like a damaged tensor;
* free-form string fields chosen by the caller (config JSON, block index, ...).

Version 1 files (no ``meta_sha256``) are still read; every file written is version 2.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from blocktrain.errors import CheckpointError

FORMAT = "blocktrain"
FORMAT_VERSION = "2"  # written; 2 added meta_sha256 and made the tensors' sha256 one-to-one
READ_VERSIONS = ("1", "2")  # read: a version 1 file has no meta_sha256 and its free-form fields go unchecked
RESERVED = ("format", "format_version", "sha256", "meta_sha256")
MAX_TENSORS = 16384  # tensors a payload may hold: far above any BlockTrain file (a paper E2E checkpoint: ~700),
# far below what makes building them a denial of service (200,000 empty tensors in 13 MB took seconds)
MAX_HEADER_BYTES = 8 << 20  # bytes of a payload's JSON header: MAX_TENSORS entries and their metadata fit easily; a
# larger one is refused before it is parsed (a 30 MB header of empty lists took 718 MB and 3.4 s to parse)


def tensors_sha256(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over the canonical form of a tensor dict (order-independent, one-to-one): per tensor in name order, the
    JSON line ``[name, dtype, shape, nbytes]`` then its raw bytes, so no tensor's bytes can pass for another's name."""
    h = hashlib.sha256()
    for name, t in _on_host(tensors):
        h.update(json.dumps([name, str(t.dtype), list(t.shape), t.numel() * t.element_size()]).encode() + b"\n")
        h.update(_raw_bytes(t))
    return h.hexdigest()


def legacy_tensors_sha256(tensors: dict[str, torch.Tensor]) -> str:
    """The digest format version 1 files carry: ``name NUL dtype shape bytes`` per tensor, with nothing to mark where
    a tensor's bytes end, so a tensor of UTF-8 bytes could be folded into the next one's name under the same digest
    (a hostile peer's copy of a block passed as the block). Read only, for files written before version 2."""
    h = hashlib.sha256()
    for name, t in _on_host(tensors):
        h.update(name.encode())
        h.update(b"\0")
        h.update(str(t.dtype).encode())
        h.update(json.dumps(list(t.shape)).encode())
        h.update(_raw_bytes(t))
    return h.hexdigest()


def _on_host(tensors: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, contiguous host copy) in name order: what a digest reads, one tensor at a time."""
    for name in sorted(tensors):
        yield name, tensors[name].detach().contiguous().cpu()


def metadata_sha256(meta: dict[str, str]) -> str:
    """sha256 over the canonical JSON (sorted keys, ASCII) of the free-form fields, the reserved ones left out."""
    free = {k: v for k, v in meta.items() if k not in RESERVED}
    return hashlib.sha256(json.dumps(free, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _raw_bytes(t: torch.Tensor) -> memoryview:
    """Zero-copy little-endian bytes of a contiguous CPU tensor (bf16 included)."""
    if not t.numel():
        return memoryview(b"")
    return t.reshape(-1).view(torch.uint8).numpy().data  # ndarray.data: the buffer itself, no copy


def pack(tensors: dict[str, torch.Tensor], meta: dict[str, str] | None = None) -> bytes:
    """Serialise tensors plus metadata to safetensors bytes with the versioned header."""
    clean, full_meta = _prepare(tensors, meta)
    return st_save(clean, metadata=full_meta)


def _prepare(
    tensors: dict[str, torch.Tensor], meta: dict[str, str] | None
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Contiguous CPU tensors and the metadata header with format, version and sha256."""
    meta = dict(meta or {})
    for key in RESERVED:
        if key in meta:
            raise ValueError(f"metadata key {key!r} is reserved")
    bad = [k for k, v in meta.items() if not isinstance(v, str)]
    if bad:
        raise ValueError(f"metadata values must be strings: {bad}")
    clean = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    meta.update(format=FORMAT, format_version=FORMAT_VERSION, sha256=tensors_sha256(clean),
                meta_sha256=metadata_sha256(meta))
    return clean, meta


def unpack(payload: bytes, source: str = "payload") -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Parse and verify safetensors bytes; raise CheckpointError on any problem."""
    if len(payload) < 8:
        raise CheckpointError(f"{source}: {len(payload)} bytes is too short to be a safetensors file")
    header_len = int.from_bytes(payload[:8], "little")
    if header_len <= 0 or 8 + header_len > len(payload):
        raise CheckpointError(f"{source}: not a safetensors file (bad header length); it may be truncated")
    if header_len > MAX_HEADER_BYTES:
        raise CheckpointError(f"{source}: its header of {header_len} bytes is larger than the {MAX_HEADER_BYTES} a "
                              "BlockTrain file's takes")
    try:
        header = json.loads(payload[8 : 8 + header_len], object_pairs_hook=_unique_keys)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:  # RecursionError: nested too deep
        raise CheckpointError(f"{source}: not a safetensors file (header is not JSON)") from exc
    except _DuplicateKeyError as exc:
        raise CheckpointError(f"{source}: its header names {exc} twice; every tensor and metadata key is named once")\
            from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{source}: not a safetensors file (header is not a JSON object)")
    n = len(header) - ("__metadata__" in header)
    if n > MAX_TENSORS:
        raise CheckpointError(f"{source}: {n} tensors is more than the {MAX_TENSORS} a BlockTrain file holds")
    for name, entry in header.items():
        dtype = entry.get("dtype") if isinstance(entry, dict) else entry
        if name != "__metadata__" and not (isinstance(dtype, str) and dtype in _READABLE):  # a list is unhashable
            raise CheckpointError(f"{source}: tensor {name!r} has dtype {dtype!r}; BlockTrain reads "
                                  f"{', '.join(sorted(_READABLE))}")
    meta = header.get("__metadata__") or {}
    if not isinstance(meta, dict):
        raise CheckpointError(f"{source}: not a BlockTrain file (metadata is not a JSON object)")
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{source}: not a BlockTrain file (metadata 'format' is {meta.get('format')!r})")
    version = meta.get("format_version")
    if version not in READ_VERSIONS:
        raise CheckpointError(
            f"{source}: format version {version!r} is not supported "
            f"(this BlockTrain reads versions {', '.join(READ_VERSIONS)}); upgrade or re-create the file"
        )
    if version != "1" and meta.get("meta_sha256") != metadata_sha256(meta):
        raise CheckpointError(
            f"{source}: its metadata does not match its meta_sha256; the header is corrupt or was modified; "
            "delete the file and re-create it"
        )
    try:
        tensors = st_load(payload)
    except Exception as exc:  # safetensors and torch raise many kinds on a stranger's bytes: each is a bad file
        raise CheckpointError(f"{source}: corrupt safetensors data ({type(exc).__name__}: {exc}); it may be "
                              "truncated") from exc
    digest = legacy_tensors_sha256(tensors) if version == "1" else tensors_sha256(tensors)
    if digest != meta.get("sha256"):
        raise CheckpointError(
            f"{source}: sha256 mismatch (stored {meta.get('sha256')}, computed {digest}); "
            "the file is corrupt or was modified; delete it and re-create it"
        )
    return tensors, dict(meta)


class _DuplicateKeyError(Exception):
    """A JSON object naming one key twice (the last would silently win)."""


def _unique_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKeyError(repr(key))
        out[key] = value
    return out


def fsync_dir(directory: Path) -> None:
    """Make the names last changed in ``directory`` (a rename into it) durable: without it a power loss may keep the
    file's bytes and lose its name, while a database row written after the rename names it (POSIX; else nothing)."""
    if os.name != "posix":
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_open(path: Path) -> Iterator[BinaryIO]:
    """A file that appears at ``path`` only once fully written: temp file in the same directory, fsync, rename, and
    the directory fsynced (the new name durable)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~umask())  # a plain open's mode: mkstemp's 0o600 kept a run's files from its other users
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def umask() -> int:
    """The process's umask, read by setting one and restoring it (a strict one meanwhile: a file another thread
    makes in that instant is private rather than public)."""
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def atomic_write_bytes(path: Path, payload: bytes) -> None:
    with atomic_open(path) as f:
        f.write(payload)


_ST_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
}
_READABLE = frozenset(_ST_DTYPES.values())  # header dtypes unpack reads (safetensors parses more than torch maps)


def save_file(path: Path, tensors: dict[str, torch.Tensor], meta: dict[str, str] | None = None) -> str:
    """Atomically write a checkpoint, streaming one tensor at a time; returns the tensors' sha256.

    Writes the safetensors layout directly (8-byte header length, JSON header padded
    to 8 bytes, raw tensor data), so the process never holds a second copy of the
    state in memory: a training run's peak RSS is not raised by checkpointing.
    """
    clean, full_meta = _prepare(tensors, meta)
    header: dict[str, object] = {"__metadata__": full_meta}
    offset = 0
    names = sorted(clean)
    for name in names:
        t = clean[name]
        if t.dtype not in _ST_DTYPES:
            raise ValueError(f"tensor {name!r} has dtype {t.dtype}, which safetensors cannot store")
        size = t.numel() * t.element_size()
        header[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    with atomic_open(path) as f:
        f.write(len(head).to_bytes(8, "little"))
        f.write(head)
        for name in names:
            f.write(_raw_bytes(clean[name]))
    return full_meta["sha256"]


def load_file(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} not found")
    return unpack(path.read_bytes(), source=str(path))
