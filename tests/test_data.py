from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest

from blocktrain.data import download
from blocktrain.data.dataset import eval_windows, open_data_dir, resolve_data_dir
from blocktrain.data.download import download_wikitext, rows_to_raw
from blocktrain.data.stream import TrainStream
from blocktrain.errors import DataError
from tests.conftest import write_data_dir


@pytest.mark.parametrize("n", [2, 3, 10, 33, 64, 65, 100, 257, 1000])
@pytest.mark.parametrize("context", [4, 16, 32])
def test_eval_windows_score_every_byte_once(n: int, context: int) -> None:
    seen = np.zeros(n, dtype=int)
    for start, length, first in eval_windows(n, context):
        assert length <= context and start >= 0 and start + length <= n - 1
        for pos in range(first, length):
            seen[start + pos + 1] += 1
            if start > 0:  # after the first window: at least half a window of context
                assert pos + 1 >= length // 2
    assert seen[0] == 0 and (seen[1:] == 1).all()


def test_resolution_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    explicit = write_data_dir(tmp_path / "explicit")
    env = write_data_dir(tmp_path / "env", flavour="raw")
    cache = tmp_path / "cache"
    monkeypatch.setenv("BLOCKTRAIN_CACHE", str(cache))
    monkeypatch.setenv("BLOCKTRAIN_DATA", str(env))
    assert resolve_data_dir(explicit).root == explicit
    assert resolve_data_dir().root == env and resolve_data_dir().flavour == "raw"
    monkeypatch.delenv("BLOCKTRAIN_DATA")
    write_data_dir(cache / "wikitext-2-raw", flavour="raw")
    assert resolve_data_dir().root == cache / "wikitext-2-raw"
    # nothing cached: the downloader is called with the cache path
    monkeypatch.setenv("BLOCKTRAIN_CACHE", str(tmp_path / "empty"))
    calls: list[Path] = []

    def fake_download(dest: Path) -> Path:
        calls.append(dest)
        return write_data_dir(dest, flavour="raw")

    dd = resolve_data_dir(download=fake_download)
    assert calls == [tmp_path / "empty" / "wikitext-2-raw"] and dd.root == calls[0]


def test_missing_and_empty_splits_are_clear(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"does not exist.*wiki\.train"):
        open_data_dir(tmp_path / "nope")
    (tmp_path / "d").mkdir()
    with pytest.raises(DataError, match=r"no dataset found.*wiki\.\{?train"):
        open_data_dir(tmp_path / "d")
    (tmp_path / "d" / "wiki.train.raw").write_bytes(b"")
    (tmp_path / "d" / "wiki.valid.raw").write_bytes(b"hello world")
    dd = open_data_dir(tmp_path / "d")
    with pytest.raises(DataError, match="empty"):
        dd.open("train")
    with pytest.raises(DataError, match="missing"):
        dd.open("test")
    (tmp_path / "d" / "wiki.test.raw").write_bytes(b"abc\x00def")
    with pytest.raises(DataError, match="corrupt"):
        dd.open("test")


def test_split_is_memory_mapped_bytes(data_dir: Path) -> None:
    split = open_data_dir(data_dir).open("valid")
    assert isinstance(split.data, np.memmap) and split.data.dtype == np.uint8
    assert bytes(split.data[:20]) == (data_dir / "wiki.valid.tokens").read_bytes()[:20]


def test_stream_is_deterministic_and_shifted(data_dir: Path) -> None:
    data = open_data_dir(data_dir).open("train").data
    s1 = TrainStream(data, 16, 4, seed=1, stream=0)
    s2 = TrainStream(data, 16, 4, seed=1, stream=1)
    x, y = s1.batch(5)
    x2, _ = s1.batch(5)
    assert (x == x2).all() and (x[:, 1:] == y[:, :-1]).all()
    assert not (s2.batch(5)[0] == x).all()


def test_rows_to_raw_rebuilds_official_layout() -> None:
    assert rows_to_raw(["", " = A = \n", "", "text .\n"]) == b" \n = A = \n \ntext .\n"


def test_download_from_local_parquet(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                     caplog: pytest.LogCaptureFixture) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    src = tmp_path / "hub"
    files = {}
    for split, rows in {"train": ["", " = T = \n", "a b\n"], "validation": ["", "v\n"], "test": ["", "t\n"]}.items():
        p = src / f"{split}.parquet"
        p.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table({"text": rows}), p)
        files[split] = p
    asked: list[tuple[str, str]] = []

    def fetch(repo: str, filename: str) -> Path:
        asked.append((repo, filename))
        split = filename.split("/")[-1].split("-")[0]
        return files[split]

    monkeypatch.setattr(download, "KNOWN_SHA256", {  # these tiny files stand in for the published ones
        "wiki.train.raw": hashlib.sha256(b" \n = T = \na b\n").hexdigest(),
        "wiki.valid.raw": hashlib.sha256(b" \nv\n").hexdigest(), "wiki.test.raw": hashlib.sha256(b" \nt\n").hexdigest()})
    dest = download_wikitext("wikitext-2", tmp_path / "out", fetch=fetch)
    assert (dest / "wiki.train.raw").read_bytes() == b" \n = T = \na b\n"
    assert (dest / "wiki.valid.raw").read_bytes() == b" \nv\n"
    assert asked[0] == ("Salesforce/wikitext", "wikitext-2-raw-v1/train-00000-of-00001.parquet")
    assert open_data_dir(dest).flavour == "raw"
    # second call re-uses the files (no fetch)
    asked.clear()
    download_wikitext("wikitext-2", dest, fetch=fetch)
    assert asked == []
    with pytest.raises(DataError, match="unknown dataset"):
        download_wikitext("wikitext-5", dest, fetch=fetch)
    # a download that is not the published one was kept with one warning, then every later run without --data
    # trained on it in silence: it is marked, and every run that resolves the cache says so
    files["test"] = src / "other.parquet"
    pq.write_table(pa.table({"text": ["", "not t\n"]}), files["test"])
    monkeypatch.setenv("BLOCKTRAIN_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("BLOCKTRAIN_DATA", raising=False)
    with caplog.at_level("WARNING"):
        resolve_data_dir(download=lambda d: download_wikitext("wikitext-2", d, fetch=fetch))
        caplog.clear()
        again = resolve_data_dir(download=lambda d: download_wikitext("wikitext-2", d, fetch=fetch))
    assert (again.root / "wiki.test.raw.sha256-mismatch").is_file()
    assert [r.getMessage().split(" was downloaded")[0] for r in caplog.records] == [str(again.root / "wiki.test.raw")]


def test_an_interrupted_download_in_the_cache_is_resumed_not_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cache holding only some splits (a download cut short) resolved as data, so the download was never resumed
    and every run failed on the missing split. It is used only once complete; until then the download is called
    (it fetches only what is missing). A directory the user names still resolves with some splits (eval-only)."""
    monkeypatch.setenv("BLOCKTRAIN_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("BLOCKTRAIN_DATA", raising=False)
    cached = tmp_path / "cache" / "wikitext-2-raw"
    cached.mkdir(parents=True)
    (cached / "wiki.train.raw").write_bytes(b" \n = T = \n" * 100)
    calls: list[Path] = []

    def fake_download(dest: Path) -> Path:
        calls.append(dest)
        return write_data_dir(dest, flavour="raw")

    dd = resolve_data_dir(download=fake_download)
    assert calls == [cached] and dd.root == cached and len(dd.open("valid")) > 0
    calls.clear()
    assert resolve_data_dir(download=fake_download).root == cached and calls == []  # complete now: used as it is
    (cached / "wiki.test.raw").unlink()
    assert open_data_dir(cached).flavour == "raw"  # named by the user, a partial directory is still data
