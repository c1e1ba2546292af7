"""Digests of data files: the published sha256 of the official WikiText files, and a file's own sha256.

Both the data directory (``dataset.py``, checking the files it opens) and the downloader (``download.py``,
checking what it fetched) use them; neither imports the other for them.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

# Published digests of the official files (see PROVENANCE of the shared data).
KNOWN_SHA256 = {
    "wiki.train.raw": "6707892fa3788b5ab9ed78ab5ff37d9fe825f6011a2ad4fcd6a6d467f0e7da57",
    "wiki.valid.raw": "4cd0f6876d07a413aa911261ff6d363c72d757d47f0fdd6015702014c89cb9c7",
    "wiki.test.raw": "173c87a53759e0201f33e0ccf978e510c2042d7f2cb78229d9a50d79b9e7dd08",
    "wiki.train.tokens": "9e9fa1ad55b1c2c95b08e37dd8e653f638fac2c6de904b79e813611eefbc985f",
    "wiki.valid.tokens": "f0737ed31fc1329026e95cb8b98e19c2a182c39c240ab909dc31abf2f8af58e8",
    "wiki.test.tokens": "d790b833ef8cf03a90db7bf1271b7520b83c45ce07ba3c1a9699df81e239eca0",
}


def mismatch_marker(target: Path) -> Path:
    """The file that marks a downloaded split whose sha256 is not the published one (its digest, then the published):
    written by the download, read by every run that resolves the cache."""
    return target.with_name(target.name + ".sha256-mismatch")


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
