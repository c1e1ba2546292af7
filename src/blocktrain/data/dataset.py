"""Locate a data directory (prepared by ``blocktrain prepare``, or WikiText) and open its splits as uint8 memory maps.

Byte-level modelling means a split's file *is* its uint8 array: each split is
memory-mapped read-only straight from disk, never copied into RAM.

Resolution order (first hit wins):
  1. an explicit ``--data DIR``;
  2. the ``BLOCKTRAIN_DATA`` environment variable;
  3. the local cache (``$BLOCKTRAIN_CACHE`` or ``~/.cache/blocktrain``)/wikitext-2-raw, once it holds all three splits;
  4. a download of WikiText-2 raw from the Hugging Face hub into that cache (an interrupted one fetches only the
     splits it lacks).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from blocktrain.data.integrity import KNOWN_SHA256, mismatch_marker, sha256_file
from blocktrain.errors import DataError

log = logging.getLogger(__name__)

SPLITS = ("train", "valid", "test")
FLAVOURS = ("raw", "tokens")  # WikiText file suffixes, preferred first
PREPARED = "bin"  # the flavour of a prepared directory: {train,valid,test}.bin + manifest.json
MANIFEST = "manifest.json"  # a prepared directory's manifest
DATASET_FORMAT = "blocktrain-dataset"  # manifest "format"
DATASET_VERSION = 1  # manifest "version"
PREPARE_AGAIN = ("run 'blocktrain prepare' again into a fresh --out and use that directory (or delete {root} and "
                 "prepare into it again)")  # what to do about a damaged prepared split

def cache_dir() -> Path:
    return Path(os.environ.get("BLOCKTRAIN_CACHE", Path.home() / ".cache" / "blocktrain"))


def expected_files_message(root: Path) -> str:
    names = ", ".join(f"wiki.{s}.{{raw,tokens}}" for s in SPLITS)
    return (f"{root} must be a directory made by 'blocktrain prepare' ({MANIFEST} and train/valid/test.bin) "
            f"or hold {names} (WikiText-2/103, raw or tokenized)")


def fingerprint_of(split_sha: dict[str, str]) -> str:
    """One digest naming a dataset: sha256 of "blocktrain-dataset-v1" and each split's name and sha256."""
    h = hashlib.sha256(f"{DATASET_FORMAT}-v{DATASET_VERSION}".encode())
    for s in SPLITS:
        h.update(f"\n{s}:{split_sha[s]}".encode())
    return h.hexdigest()


def _wikitext_fingerprint(flavour: str) -> str:
    return fingerprint_of({s: KNOWN_SHA256[f"wiki.{s}.{flavour}"] for s in SPLITS})


WIKITEXT_FINGERPRINTS = frozenset(_wikitext_fingerprint(f) for f in FLAVOURS)  # the published WikiText-2 files'
_FINGERPRINTS: dict[tuple[str, int, int], str] = {}  # (split path, size, mtime_ns) -> sha256, per process


@dataclass(frozen=True)
class ByteSplit:
    """One split as a read-only uint8 memory map."""

    name: str  # split name: train, valid or test
    path: Path  # file on disk
    data: np.ndarray  # uint8 memory map of the whole file

    def __len__(self) -> int:
        return int(self.data.shape[0])


@dataclass(frozen=True)
class DataDir:
    """A validated data directory."""

    root: Path  # the directory
    flavour: str  # "bin" (prepared), "raw" or "tokens" (WikiText)

    def path(self, split: str) -> Path:
        if self.flavour == PREPARED:
            return self.root / f"{split}.bin"
        return self.root / f"wiki.{split}.{self.flavour}"

    def manifest(self) -> dict[str, Any] | None:
        """A prepared directory's manifest (None for WikiText)."""
        if self.flavour != PREPARED:
            return None
        try:
            doc = json.loads((self.root / MANIFEST).read_text())
        except (OSError, ValueError) as exc:
            raise DataError(f"{self.root / MANIFEST} cannot be read ({exc}); run 'blocktrain prepare' again") from None
        if not isinstance(doc, dict) or doc.get("format") != DATASET_FORMAT or doc.get("version") != DATASET_VERSION:
            raise DataError(f"{self.root / MANIFEST} is not a version-{DATASET_VERSION} {DATASET_FORMAT} manifest; "
                            "prepare the data with this BlockTrain")
        splits = doc.get("splits")
        if (not isinstance(doc.get("fingerprint"), str) or not isinstance(splits, dict)
                or not all(isinstance(splits.get(s), dict) for s in SPLITS)):
            raise DataError(f"{self.root / MANIFEST} lacks its fingerprint or a split's entry; run 'blocktrain prepare' "
                            "again")
        return dict(doc)

    def fingerprint(self) -> str:
        """The dataset's fingerprint: the manifest's, or for WikiText the same digest over its split files."""
        doc = self.manifest()
        if doc is not None:
            return str(doc["fingerprint"])
        shas = {}
        for s in SPLITS:
            path = self.path(s)
            if not path.is_file():
                raise DataError(f"split {s!r} is missing: {path} not found; a fingerprint needs all three splits")
            st = path.stat()
            key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
            if key not in _FINGERPRINTS:
                _FINGERPRINTS[key] = sha256_file(path)
            shas[s] = _FINGERPRINTS[key]
        return fingerprint_of(shas)

    def describe(self) -> str:
        """A short name for messages: the directory and its fingerprint's head."""
        return f"{self.root} (fingerprint {self.fingerprint()[:12]})"

    def open(self, split: str, verify: bool = False) -> ByteSplit:
        if split not in SPLITS:
            raise DataError(f"unknown split {split!r}; choose one of {', '.join(SPLITS)}")
        path = self.path(split)
        if not path.is_file():
            raise DataError(f"split {split!r} is missing: {path} not found; {expected_files_message(self.root)}")
        size = path.stat().st_size
        entry: dict[str, Any] = {}  # a prepared split's manifest entry (its bytes and sha256), read once
        if self.flavour == PREPARED:  # cheap, on every open: a cut-short or grown split would train under the
            # manifest's fingerprint, which then names bytes this machine does not hold
            entry = (self.manifest() or {})["splits"][split]
            want = entry.get("bytes")
            if not isinstance(want, int) or isinstance(want, bool) or size != want:
                raise DataError(f"{path} holds {size} bytes, but its {MANIFEST} lists {want}: the split was cut short "
                                f"or changed after 'blocktrain prepare' wrote it; {PREPARE_AGAIN.format(root=self.root)}")
        if size < 2:
            raise DataError(f"split {split!r} at {path} is empty; re-copy or re-download the data")
        with path.open("rb") as f:
            head = f.read(1 << 16)
        if self.flavour != PREPARED and b"\x00" in head:
            raise DataError(f"split {split!r} at {path} holds NUL bytes and is not WikiText text; the file is corrupt")
        if verify and self.flavour == PREPARED:
            if sha256_file(path) != str(entry.get("sha256")):
                raise DataError(f"{path} does not match the sha256 in its manifest; "
                                f"{PREPARE_AGAIN.format(root=self.root)}")
        elif verify:
            want = KNOWN_SHA256.get(path.name)
            got = sha256_file(path)
            if want is not None and got != want:
                log.warning("%s has sha256 %s, not the published %s; results will not be comparable", path, got, want)
        data = np.memmap(path, dtype=np.uint8, mode="r")
        return ByteSplit(name=split, path=path, data=data)


def find_flavour(root: Path, partial: bool = True) -> str | None:
    """The flavour of the dataset in ``root``, or None. ``partial``: also a WikiText directory holding only some of
    its splits (an eval-only copy a user made); the download cache is used only when it holds every split."""
    if (root / MANIFEST).is_file() and all((root / f"{s}.bin").is_file() for s in SPLITS):
        return PREPARED
    for flavour in FLAVOURS:
        if all((root / f"wiki.{s}.{flavour}").is_file() for s in SPLITS):
            return flavour
    if not partial:
        return None
    for flavour in FLAVOURS:  # partial directories (e.g. eval-only) still resolve
        if any((root / f"wiki.{s}.{flavour}").is_file() for s in SPLITS):
            return flavour
    return None


def open_data_dir(root: Path) -> DataDir:
    if not root.is_dir():
        raise DataError(f"data directory {root} does not exist; {expected_files_message(root)}")
    flavour = find_flavour(root)
    if flavour is None:
        raise DataError(f"no dataset found in {root}; {expected_files_message(root)}")
    return DataDir(root=root, flavour=flavour)


def resolve_data_dir(
    explicit: str | Path | None = None,
    *,
    download: Callable[[Path], Path] | None = None,
    no_download: str | None = None,
) -> DataDir:
    """Find the data directory in the documented order; see the module docstring. ``no_download``: where nothing
    is given or cached, fail with this message instead of downloading WikiText-2."""
    if explicit is not None:
        return open_data_dir(Path(explicit).expanduser())
    env = os.environ.get("BLOCKTRAIN_DATA")
    if env:
        return open_data_dir(Path(env).expanduser())
    cached = cache_dir() / "wikitext-2-raw"
    if find_flavour(cached, partial=False) is not None:  # an interrupted download is resumed below, not used
        for split in SPLITS:
            if mismatch_marker(target := cached / f"wiki.{split}.raw").is_file():
                log.warning("%s was downloaded with another sha256 than the published one: runs on it are not "
                            "comparable with WikiText-2's (delete the folder to download it again, or pass --data DIR)",
                            target)
        return open_data_dir(cached)
    if no_download is not None:
        raise DataError(no_download)
    if download is None:
        from blocktrain.data.download import download_wikitext

        def download(dest: Path) -> Path:
            return download_wikitext("wikitext-2", dest)

    log.info("no data directory given; downloading WikiText-2 raw into %s", cached)
    return open_data_dir(download(cached))


def resolve_run_data(explicit: str | Path | None, recorded: dict[str, str] | None, trained_on: str, what: str,
                     *, download: Callable[[Path], Path] | None = None) -> DataDir:
    """The data of a trained run (``what``, for messages): ``--data`` or ``$BLOCKTRAIN_DATA`` when given, else the
    directory its run.json records (``recorded``, checked against the fingerprint it trained on), else the default
    order of :func:`resolve_data_dir`, never a download for a run that trained on other data than WikiText-2."""
    if explicit is not None or os.environ.get("BLOCKTRAIN_DATA"):
        return resolve_data_dir(explicit, download=download)
    if recorded is not None:
        root = Path(recorded["dir"])
        if find_flavour(root) is None:
            raise DataError(f"{what} trained on the data at {root}, which is gone or no longer a dataset; pass "
                            f"--data DIR with that data (fingerprint {trained_on[:12] or '?'})")
        data = open_data_dir(root)
        if trained_on and data.fingerprint() != trained_on:
            raise DataError(f"{what} trained on dataset {trained_on[:12]}, but {root} now holds "
                            f"{data.fingerprint()[:12]}; pass --data DIR with the run's own data")
        log.info("%s: data from its run.json: %s", what, data.describe())
        return data
    foreign = bool(trained_on) and trained_on not in WIKITEXT_FINGERPRINTS  # WikiText-2 would be the wrong data
    return resolve_data_dir(None, download=download, no_download=(
        f"{what} trained on dataset {trained_on[:12]} and does not record where it is (a run made before runs "
        "recorded their data); pass --data DIR") if foreign else None)


def eval_windows(n: int, context: int) -> list[tuple[int, int, int]]:
    """Windows that score every target byte 1..n-1 exactly once, laid out from the start of the text.

    Returns (start, length, first_scored) triples: inputs are bytes [start, start+length), targets
    [start+1, start+length+1), and positions >= first_scored of the window are scored. With stride
    s = max(1, context // 2), window i starts at i * s; window 0 scores all its positions, every later one its
    positions >= context - s,
    so every scored byte after the first window sees at least half a window of context. Only the last window may
    be short (length < context). The layout is prefix-stable: the window that scores byte j, and the bytes it
    reads, depend on j and ``context`` alone, never on n, so appending bytes never moves an earlier byte's score.
    """
    if n < 2:
        raise DataError(f"a split of {n} bytes has nothing to score")
    if context < 1:
        raise DataError(f"a scoring window must hold at least one byte, got context {context}")
    stride = max(1, context // 2)
    first = context - stride  # positions of a later window that the window before it has not scored
    windows = [(0, min(context, n - 1), 0)]
    start = stride
    while start + first < n - 1:  # targets start+first+1 .. n-1 are left
        windows.append((start, min(context, n - 1 - start), first))
        start += stride
    return windows
