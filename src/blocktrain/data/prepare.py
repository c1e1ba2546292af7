"""``blocktrain prepare``: any text a user has -> ``train.bin``, ``valid.bin``, ``test.bin`` and ``manifest.json``.

Sources (:func:`iter_documents`):

* one text file: each paragraph (lines up to a blank line) is a document, keyed by
  its ordinal in the file;
* a directory: every file matching ``include`` (recursive, sorted), each file one
  document keyed by its relative path; binary files (a NUL byte in the first
  8 KiB, git's test) are skipped and counted;
* a JSONL file: the string ``field`` of each line is a document, keyed by line number;
* a WikiText directory (``wiki.{train,valid,test}.{raw,tokens}``): its own splits,
  copied byte for byte, so its committed numbers do not move.

A document goes to one split by a hash of its key: u = sha256(key) / 2^256, test
if u < f_test, valid if u < f_test + f_valid, else train. Splits are raw bytes
(documents joined by newlines), memory-mapped as today. The manifest names the
source, the per-split document and byte counts and sha256, and one dataset
**fingerprint** = sha256 over the three splits' digests. Nothing in it depends on
time or machine, so the same source gives byte-identical output.

Everything is written into a temporary directory beside ``out`` and renamed into
place at the end: a failure leaves no partial output; the directory and its files
get the modes a plain mkdir/open would give (0o777 / 0o666 less the umask), not
the temporary directory's owner-only 0o700. Memory stays flat: files are streamed
in 1 MiB chunks and only the hashes and counts are kept.
"""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import itertools
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from blocktrain.checkpoint.safetensors_io import atomic_write_bytes, fsync_dir, umask
from blocktrain.data.dataset import DATASET_FORMAT, DATASET_VERSION, MANIFEST, SPLITS, find_flavour, fingerprint_of
from blocktrain.data.integrity import sha256_file
from blocktrain.errors import DataError
from blocktrain.progress import progress_bar

log = logging.getLogger(__name__)

CHUNK = 1 << 20  # bytes read at a time
BINARY_PROBE = 8192  # bytes inspected for a NUL to call a file binary
LONE_SURROGATE = re.compile("[\ud800-\udfff]")  # after json.loads every surrogate left in a str is a lone one
SMALL_FOLDER_RULE = "train files of lowest hash moved to test, then valid, until each holds a context window"


@dataclass(frozen=True)
class PrepareOptions:
    include: tuple[str, ...] = ("*.txt", "*.md", "*.rst", "*.py")  # globs of a directory's files (basename)
    exclude: tuple[str, ...] = ()  # globs of relative paths (files or folders) to leave out, e.g. site-packages
    field: str = "text"  # JSONL: the key holding each document's text
    valid_fraction: float = 0.01  # share of documents in valid
    test_fraction: float = 0.01  # share of documents in test
    min_split_bytes: int = 1025  # a split must hold one context window plus its target (bytes)
    progress: bool = True  # progress bar over the source's bytes

    def __post_init__(self) -> None:
        if not (0 < self.valid_fraction < 1 and 0 < self.test_fraction < 1
                and self.valid_fraction + self.test_fraction < 1):
            raise DataError("valid and test fractions must be in (0, 1) and sum to less than 1, e.g. 0.01 and 0.01")
        if not self.include:
            raise DataError("--include needs at least one glob, e.g. '*.txt'")
        if self.min_split_bytes < 2:
            raise DataError("min_split_bytes must be >= 2")


@dataclass
class SplitWriter:
    """One split's output file, its sha256 and counts, written as documents arrive."""

    name: str
    f: BinaryIO
    sha: Any = field(default_factory=hashlib.sha256)
    documents: int = 0
    size: int = 0  # bytes written

    def write(self, data: bytes) -> None:
        self.f.write(data)
        self.sha.update(data)
        self.size += len(data)


def _unit(key: str) -> float:
    """u = sha256(key) / 2^256 in [0, 1), from the digest's first 8 bytes."""
    return int.from_bytes(hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()[:8], "big") / 2**64


def split_of(key: str, opts: PrepareOptions) -> str:
    """The split of the document keyed ``key``: u = sha256(key) / 2^256 against the fractions."""
    u = _unit(key)
    if u < opts.test_fraction:
        return "test"
    if u < opts.test_fraction + opts.valid_fraction:
        return "valid"
    return "train"


def directory_splits(sizes: dict[str, int], opts: PrepareOptions) -> dict[str, str]:
    """Each file's split: :func:`split_of`, then, for a folder too small for the fractions to give test or valid
    one context window, the train files of lowest u moved there (test first) while train keeps a window of its own.
    The same folder gives the same splits on every run."""
    split = {rel: split_of(rel, opts) for rel in sizes}
    for name in ("test", "valid"):
        def total(s: str) -> int:
            return sum(sizes[r] for r in split if split[r] == s)

        while total(name) < opts.min_split_bytes:
            train = sorted((r for r in split if split[r] == "train"), key=_unit)
            if len(train) < 2 or total("train") - sizes[train[0]] < opts.min_split_bytes:
                break  # too small a folder: the size check names the split and what to do
            split[train[0]] = name
    return split


def source_kind(src: Path) -> str:
    """``wikitext``, ``directory``, ``jsonl`` (also a ``.json`` file whose first line is a JSON object: a JSONL dump
    under another name, whose ``--field`` was ignored as the file was read as text) or ``text``."""
    if src.is_dir():
        with contextlib.suppress(OSError, ValueError, AttributeError):  # another project's manifest.json is text
            if json.loads((src / MANIFEST).read_text()).get("format") == DATASET_FORMAT:
                raise DataError(f"{src} is a dataset 'blocktrain prepare' made already: pass it to training as "
                                f"--data {src}")
        return "wikitext" if find_flavour(src) is not None else "directory"
    if not src.is_file():
        raise DataError(f"source {src} does not exist; pass a text file, a JSONL file or a directory")
    if src.suffix.lower() == ".json":
        with src.open("rb") as f:  # the first line with text (of the first 64, each read up to 16 MiB)
            lines = (f.readline(1 << 24) for _ in range(64))
            first = next((line for line in lines if line.strip()), b"").removeprefix(b"\xef\xbb\xbf")
        with contextlib.suppress(ValueError):
            if isinstance(json.loads(first), dict):
                return "jsonl"
    return "jsonl" if src.suffix.lower() in (".jsonl", ".ndjson") else "text"


def _is_binary(path: Path) -> bool:
    with path.open("rb") as f:
        return b"\0" in f.read(BINARY_PROBE)


def directory_files(src: Path, include: tuple[str, ...], exclude: tuple[str, ...] = ()) -> list[tuple[str, Path]]:
    """(relative path, path) of the files under ``src`` whose name matches an ``include`` glob and whose relative
    path (or any folder on it) matches no ``exclude`` glob; hidden folders are skipped. Sorted by relative path."""

    def excluded(rel: str, name: str) -> bool:
        return any(fnmatch.fnmatch(rel, g) or fnmatch.fnmatch(name, g) for g in exclude)

    top = str(src)
    out = []
    for root, dirs, files in os.walk(top):
        base = root[len(top):].lstrip(os.sep).replace(os.sep, "/")
        prefix = base + "/" if base else ""
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and not excluded(prefix + d, d))
        for name in files:
            if any(fnmatch.fnmatch(name, g) for g in include) and not excluded(prefix + name, name):
                out.append((prefix + name, Path(root) / name))
    return sorted(out)


class Prepared:
    """The outcome of one prepare: counts per split, skipped files and the manifest written."""

    def __init__(self, manifest: dict[str, Any], out: Path) -> None:
        self.manifest = manifest
        self.out = out

    @property
    def fingerprint(self) -> str:
        return str(self.manifest["fingerprint"])


def prepare(src: Path, out: Path, opts: PrepareOptions = PrepareOptions()) -> Prepared:
    """Prepare ``src`` into ``out``; see the module docstring. Raises DataError with what to do."""
    src, out = src.expanduser(), out.expanduser()
    kind = source_kind(src)
    if out.exists() and any(out.iterdir()):
        _check_out(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        writers = {s: SplitWriter(s, (tmp / f"{s}.bin").open("wb")) for s in SPLITS}
        try:
            skipped = _fill(kind, src, writers, opts)
            for w in writers.values():  # durable before they are named
                w.f.flush()
                os.fsync(w.f.fileno())
        finally:
            for w in writers.values():
                w.f.close()
        total = sum(w.documents for w in writers.values())
        if total == 0 or sum(w.size for w in writers.values()) == 0:
            raise DataError(f"source {src} holds no text" + (f" ({skipped} binary files skipped)" if skipped else "")
                            + "; point prepare at text files" + (", or widen --include" if kind == "directory" else ""))
        for w in writers.values():
            if w.size < opts.min_split_bytes:
                raise DataError(
                    f"split {w.name!r} would hold {w.size} bytes ({w.documents} documents), less than one context "
                    f"window ({opts.min_split_bytes} bytes); add text, or raise --{w.name}-fraction (of {total} "
                    f"documents, a fraction near {min(0.45, 3 / total):.2g} gives it about three)"
                    if w.name != "train" else
                    f"split 'train' would hold {w.size} bytes, less than one context window; add text"
                )
        shas = {s: w.sha.hexdigest() for s, w in writers.items()}
        manifest = {
            "format": DATASET_FORMAT,
            "version": DATASET_VERSION,
            "source": {"path": str(src), "kind": kind, "include": list(opts.include) if kind == "directory" else None,
                       "exclude": list(opts.exclude) if kind == "directory" else None,
                       "field": opts.field if kind == "jsonl" else None},
            "split_rule": {"valid_fraction": opts.valid_fraction, "test_fraction": opts.test_fraction,
                           "hash": "sha256(document key)",
                           "small_folder": SMALL_FOLDER_RULE if kind == "directory" else None}
            if kind != "wikitext" else {"wikitext": "official splits"},
            "splits": {s: {"file": f"{s}.bin", "documents": w.documents, "bytes": w.size, "sha256": shas[s]}
                       for s, w in writers.items()},
            "binary_files_skipped": skipped,
            "fingerprint": fingerprint_of(shas),
        }
        atomic_write_bytes(tmp / MANIFEST, (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode())
        _publish_modes(tmp)
        _install(tmp, out, manifest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Prepared(manifest, out)


def _publish_modes(tmp: Path) -> None:
    """Give the temporary dataset directory and its files the modes a plain mkdir/open would (0o777 / 0o666 less the
    umask): mkdtemp makes the directory 0o700 and the manifest's atomic write (mkstemp) 0o600, so without this the
    dataset would be readable by its owner alone, e.g. not by workers run as another user."""
    mask = umask()
    for path in tmp.iterdir():
        path.chmod(0o666 & ~mask)
    tmp.chmod(0o777 & ~mask)


def _check_out(out: Path) -> None:
    """``out`` may be empty or hold a prepared dataset (replaced only by the identical one)."""
    if not (out / MANIFEST).is_file():
        raise DataError(f"output directory {out} is not empty and holds no {MANIFEST}; choose an empty or new directory")


def _install(tmp: Path, out: Path, manifest: dict[str, Any]) -> None:
    if out.exists() and any(out.iterdir()):
        try:
            old = json.loads((out / MANIFEST).read_text())
        except (OSError, ValueError, RecursionError):
            old = None
        if not isinstance(old, dict):
            raise DataError(f"output directory {out} holds a {MANIFEST} that cannot be read; choose another --out or "
                            "delete it first")
        if old.get("fingerprint") != manifest["fingerprint"]:
            raise DataError(
                f"output directory {out} already holds another dataset (fingerprint {str(old.get('fingerprint'))[:12]}, "
                f"this one {manifest['fingerprint'][:12]}); choose another --out or delete it first"
            )
        # The same fingerprint names the same bytes, but the files there may have been cut short or changed since
        # they were written: check each split's size and sha256 (a read of the output, cheaper than the prepare just
        # done) before calling the dataset identical. A damaged split is replaced by the one just made rather than
        # refused: its own manifest proves it wrong, the new file is byte for byte what that manifest names (so runs
        # that trained on this fingerprint stay valid), and re-running the same prepare is the repair a user expects,
        # where an error would only send them to delete the directory and run it again. os.replace swaps the name:
        # a process with the old file open or mapped keeps its bytes.
        damaged = [s for s in SPLITS if not _holds(out / f"{s}.bin", manifest["splits"][s])]
        if damaged or old.get("splits") != manifest["splits"]:
            for s in damaged:
                os.replace(tmp / f"{s}.bin", out / f"{s}.bin")
            os.replace(tmp / MANIFEST, out / MANIFEST)
            fsync_dir(out)
            log.warning("%s held this dataset (fingerprint %s) but %s; replaced with the files just prepared", out,
                        manifest["fingerprint"][:12], f"split(s) {', '.join(damaged)} did not match it" if damaged
                        else f"its {MANIFEST} listed other split entries")
        else:
            log.info("%s already holds this dataset (fingerprint %s)", out, manifest["fingerprint"][:12])
        shutil.rmtree(tmp)
        return
    if out.exists():
        out.rmdir()
    tmp.rename(out)
    fsync_dir(out.parent)  # the dataset's name durable (its files and manifest were fsynced before)


def _holds(path: Path, entry: dict[str, Any]) -> bool:
    """Whether ``path`` is the split a manifest's ``entry`` names: its byte count, then its sha256."""
    return path.is_file() and path.stat().st_size == entry["bytes"] and sha256_file(path) == entry["sha256"]


def _fill(kind: str, src: Path, writers: dict[str, SplitWriter], opts: PrepareOptions) -> int:
    """Stream the source's documents into the split writers; returns the binary files skipped."""
    if kind == "wikitext":
        flavour = find_flavour(src)
        for s in SPLITS:
            path = src / f"wiki.{s}.{flavour}"
            if not path.is_file():
                raise DataError(f"WikiText directory {src} lacks {path.name}; all three splits are needed")
            writers[s].documents = 1
            _copy(path, writers[s], opts, desc=path.name)
        return 0
    if kind == "directory":
        return _fill_directory(src, writers, opts)
    if kind == "jsonl":
        _fill_jsonl(src, writers, opts)
        return 0
    if _is_binary(src):
        raise DataError(f"{src} looks binary (a NUL byte in its first {BINARY_PROBE} bytes); prepare reads text")
    _fill_text(src, writers, opts)
    return 0


def _bytes_bar(total: int, desc: str, opts: PrepareOptions) -> Any:
    """A progress bar over ``total`` bytes of the source."""
    return progress_bar(total=total, desc=desc, unit="B", unit_scale=True, disable=not opts.progress, dynamic_ncols=True)


def _copy(path: Path, w: SplitWriter, opts: PrepareOptions, desc: str) -> None:
    with path.open("rb") as f, _bytes_bar(path.stat().st_size, desc, opts) as bar:
        for chunk in iter(lambda: f.read(CHUNK), b""):
            w.write(chunk)
            bar.update(len(chunk))


def _append_document(w: SplitWriter, chunks: Iterator[bytes]) -> None:
    """One document: its bytes, then a newline separating it from the next one (if it lacks one)."""
    last = b""
    for chunk in chunks:
        if chunk:
            w.write(chunk)
            last = chunk
    if last and not last.endswith(b"\n"):
        w.write(b"\n")
    w.documents += 1


def _fill_directory(src: Path, writers: dict[str, SplitWriter], opts: PrepareOptions) -> int:
    files = directory_files(src, opts.include, opts.exclude)
    # binary files are told apart before the splits are chosen and left out of the sizes: a split chosen by bytes
    # that are then skipped could end up empty
    sizes: dict[str, int] = {}  # text files only
    unreadable: list[str] = []
    skipped = 0
    for rel, p in files:
        try:
            if _is_binary(p):  # binary: skipped and counted
                skipped += 1
            else:
                sizes[rel] = os.stat(p).st_size
        except OSError:
            unreadable.append(rel)
    if unreadable:
        raise DataError(_unreadable_message(src, unreadable))
    split = directory_splits(sizes, opts)
    with _bytes_bar(sum(sizes.values()), f"prepare {src.name}", opts) as bar:
        for rel, p in files:
            if rel not in split:  # binary, skipped above
                continue
            try:
                with open(p, "rb") as f:
                    head = f.read(BINARY_PROBE)
                    if b"\0" in head:  # turned binary since it was probed: skipped too
                        skipped += 1
                    elif head:
                        rest = iter(lambda f=f: f.read(CHUNK), b"")  # type: ignore[misc]
                        _append_document(writers[split[rel]], itertools.chain([head], rest))
            except OSError:
                unreadable.append(rel)
            bar.update(sizes[rel])
    if unreadable:
        raise DataError(_unreadable_message(src, unreadable))
    return skipped


def _unreadable_message(src: Path, paths: list[str]) -> str:
    names = ", ".join(paths[:10])
    more = f" and {len(paths) - 10} more" if len(paths) > 10 else ""
    return f"cannot read {len(paths)} file(s) under {src}: {names}{more}; fix their permissions or --include fewer"


def _fill_jsonl(src: Path, writers: dict[str, SplitWriter], opts: PrepareOptions) -> None:
    """Each line's string ``opts.field`` is a document. A lone surrogate escape ("\\ud800": JSON allows it, UTF-8
    cannot hold it) becomes U+FFFD, so every split stays valid UTF-8; how many were replaced is logged once."""
    replaced = 0
    with src.open("rb") as f, _bytes_bar(src.stat().st_size, f"prepare {src.name}", opts) as bar:
        for n, line in enumerate(f, start=1):
            bar.update(len(line))
            if not line.strip():
                continue
            try:
                doc = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
                raise DataError(f"{src} line {n} is not valid JSON ({exc}); fix or remove that line") from None
            text = doc.get(opts.field) if isinstance(doc, dict) else None
            if not isinstance(text, str):
                raise DataError(
                    f"{src} line {n} has no string field {opts.field!r}"
                    + (f" (its keys: {', '.join(sorted(doc)[:8])})" if isinstance(doc, dict) else "")
                    + "; pass --field NAME"
                )
            if text:
                text, lone = LONE_SURROGATE.subn("\ufffd", text)
                replaced += lone
                _append_document(writers[split_of(f"line:{n}", opts)], iter([text.encode("utf-8")]))
    if replaced:
        log.warning("%s: replaced %d lone surrogate escape(s) (e.g. \\ud800, not valid UTF-8) with U+FFFD", src,
                    replaced)


BLANK = re.compile(rb"\n(?:[ \t\r]*\n)+")  # the end of a paragraph: a newline, then blank lines


def _fill_text(src: Path, writers: dict[str, SplitWriter], opts: PrepareOptions) -> None:
    """Paragraphs of one text file (runs of lines up to a blank line), each keyed by its ordinal, streamed."""
    index = 0  # ordinal of the current paragraph
    current: SplitWriter | None = None  # its split, chosen as it starts
    tail = b""  # bytes after the last newline seen: a separator may continue in the next chunk
    with src.open("rb") as f, _bytes_bar(src.stat().st_size, f"prepare {src.name}", opts) as bar:
        for chunk in iter(lambda: f.read(CHUNK), b""):
            bar.update(len(chunk))
            buf = tail + chunk
            content_end = len(buf.rstrip(b" \t\r\n"))  # a separator reaching past this may go on
            pos = 0
            cut = -1
            for m in BLANK.finditer(buf):
                if m.end() > content_end:  # more blank lines may follow in the next chunk: keep it whole
                    cut = m.start()
                    break
                current = current or writers[split_of(f"paragraph:{index}", opts)]
                current.write(buf[pos:m.end()])
                current.documents += 1
                current, index, pos = None, index + 1, m.end()
            if cut < 0:  # no separator reaches past the content: keep only the trailing whitespace from its first
                # newline (where one may begin), not the text after the last newline (a file without newlines was
                # kept whole and copied at every chunk: quadratic)
                nl = buf.find(b"\n", content_end)
                cut = len(buf) if nl < 0 else nl
            if cut > pos:
                current = current or writers[split_of(f"paragraph:{index}", opts)]
                current.write(buf[pos:cut])
            tail = buf[cut:]
        if tail.strip() or current is not None:
            current = current or writers[split_of(f"paragraph:{index}", opts)]
            current.write(tail if tail.endswith(b"\n") else tail + b"\n")
            current.documents += 1
