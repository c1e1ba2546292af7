"""``blocktrain prepare`` and the dataset fingerprint (issue 22): small corpora made here, nothing fetched."""

from __future__ import annotations

import json
import os
import random
import stat
from pathlib import Path

import pytest

from blocktrain.cli.main import main as cli
from blocktrain.data.dataset import MANIFEST, SPLITS, fingerprint_of, open_data_dir
from blocktrain.data.integrity import sha256_file
from blocktrain.data.prepare import PrepareOptions, _unit, prepare, split_of
from blocktrain.errors import DataError

SMALL = PrepareOptions(valid_fraction=0.2, test_fraction=0.2, min_split_bytes=64, progress=False)


def _paragraphs(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "river", "song", "city", "album"]
    return [f"paragraph {i}: " + " ".join(rng.choice(words) for _ in range(rng.randint(5, 30))) + ".\n"
            for i in range(n)]


def _text_file(path: Path, n: int = 200) -> list[str]:
    paras = _paragraphs(n)
    path.write_text("\n".join(paras))  # paragraphs separated by one blank line
    return paras


def _splits(out: Path) -> dict[str, bytes]:
    return {s: (out / f"{s}.bin").read_bytes() for s in SPLITS}


def test_text_file_paragraphs_go_whole_to_one_split_by_their_hash(tmp_path: Path) -> None:
    paras = _text_file(tmp_path / "book.txt")
    done = prepare(tmp_path / "book.txt", tmp_path / "out", SMALL)
    splits = _splits(tmp_path / "out")
    for i, p in enumerate(paras):
        want = split_of(f"paragraph:{i}", SMALL)
        assert p.encode() in splits[want], i  # whole, in the split its key hashes to
        assert all(p.encode() not in splits[s] for s in SPLITS if s != want)
    m = done.manifest
    assert sum(m["splits"][s]["documents"] for s in SPLITS) == len(paras)
    assert all(m["splits"][s]["sha256"] == sha256_file(tmp_path / "out" / f"{s}.bin") for s in SPLITS)
    assert m["fingerprint"] == fingerprint_of({s: m["splits"][s]["sha256"] for s in SPLITS})
    assert 0 < m["splits"]["test"]["documents"] < m["splits"]["train"]["documents"]


def test_rerun_is_byte_identical_and_a_large_file_streams_across_chunks(tmp_path: Path) -> None:
    from blocktrain.data import prepare as mod

    _text_file(tmp_path / "a.txt", 400)
    prepare(tmp_path / "a.txt", tmp_path / "one", SMALL)
    (tmp_path / "b.txt").write_text((tmp_path / "a.txt").read_text().replace("\n\n", "\n \n\t\n\n"))
    prepare(tmp_path / "b.txt", tmp_path / "b-one", SMALL)
    chunk = mod.CHUNK
    try:
        for size in (1, 2, 7, 97):  # paragraph separators now straddle chunk boundaries
            mod.CHUNK = size
            for src, ref in (("a.txt", "one"), ("b.txt", "b-one")):
                out = tmp_path / f"{ref}-{size}"
                prepare(tmp_path / src, out, SMALL)
                for name in ("train.bin", "valid.bin", "test.bin"):
                    assert (tmp_path / ref / name).read_bytes() == (out / name).read_bytes(), (src, size)
    finally:
        mod.CHUNK = chunk
    prepare(tmp_path / "a.txt", tmp_path / "two", SMALL)
    one = json.loads((tmp_path / "one" / MANIFEST).read_text())
    two = json.loads((tmp_path / "two" / MANIFEST).read_text())
    assert one == two
    again = prepare(tmp_path / "a.txt", tmp_path / "one", SMALL)  # the same dataset into the same place: fine
    assert again.fingerprint == one["fingerprint"]


def test_a_text_without_newlines_is_scanned_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file with no newline was kept whole as the tail and copied and scanned again at every chunk (quadratic: a
    32 MB minified file took 0.9 s, a 1 GB one would take minutes); each byte is now scanned about once."""
    import re

    from blocktrain.data import prepare as mod

    text = b"\n\n".join(f"paragraph {i} ".encode() + b"word " * 2_000 for i in range(40))  # 400 kB, long lines
    (tmp_path / "flat.txt").write_bytes(text)
    scanned, blank = [0], re.compile(mod.BLANK.pattern)

    class Counting:
        def finditer(self, buf: bytes) -> object:
            scanned[0] += len(buf)
            return blank.finditer(buf)

    prepare(tmp_path / "flat.txt", tmp_path / "ref", SMALL)
    monkeypatch.setattr(mod, "CHUNK", 1024)
    monkeypatch.setattr(mod, "BLANK", Counting())
    prepare(tmp_path / "flat.txt", tmp_path / "out", SMALL)
    assert _splits(tmp_path / "out") == _splits(tmp_path / "ref")
    assert sum(len(v.replace(b"\n", b"")) for v in _splits(tmp_path / "out").values()) == len(text.replace(b"\n", b""))
    assert scanned[0] <= 2 * len(text), scanned[0]


def test_a_manifest_of_another_shape_is_a_data_error(tmp_path: Path) -> None:
    """A manifest that is a JSON list, or lacks its fingerprint or a split's entry, was an AttributeError or a
    KeyError; it is a DataError saying to prepare the data again."""
    _text_file(tmp_path / "a.txt")
    prepare(tmp_path / "a.txt", tmp_path / "out", SMALL)
    path = tmp_path / "out" / MANIFEST
    good = json.loads(path.read_text())
    for bad in ([1, 2], {**good, "fingerprint": None}, {**good, "splits": []},
                {**good, "splits": {**good["splits"], "test": 3}}):
        path.write_text(json.dumps(bad))
        with pytest.raises(DataError, match="prepare"):
            open_data_dir(tmp_path / "out").fingerprint()
    path.write_text("[1, 2]")
    with pytest.raises(DataError, match="cannot be read"):  # prepare into it again: its old manifest is no object
        prepare(tmp_path / "a.txt", tmp_path / "out", SMALL)


def test_directory_include_exclude_and_binary_files(tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "pkg" / "sub").mkdir(parents=True)
    (src / "skip").mkdir()
    paras = _paragraphs(60)
    for i, p in enumerate(paras):
        (src / ("pkg" if i % 2 else "pkg/sub") / f"f{i}.py").write_text(p * 3)
    (src / "skip" / "x.py").write_text("never read\n")
    (src / "notes.bin").write_bytes(b"\0\1\2" * 100)
    (src / "image.py").write_bytes(b"\x89PNG\0\0" * 10)  # matches the glob, but is binary
    done = prepare(src, tmp_path / "out", PrepareOptions(include=("*.py",), exclude=("skip",), valid_fraction=0.2,
                                                         test_fraction=0.2, min_split_bytes=64, progress=False))
    m = done.manifest
    assert m["binary_files_skipped"] == 1 and m["source"]["kind"] == "directory"
    assert sum(m["splits"][s]["documents"] for s in SPLITS) == 60
    joined = b"".join(_splits(tmp_path / "out").values())
    assert b"never read" not in joined and b"PNG" not in joined
    rel = "pkg/f1.py"
    assert (paras[1] * 3).encode() in _splits(tmp_path / "out")[split_of(rel, SMALL)]


def test_jsonl_field_and_its_errors(tmp_path: Path) -> None:
    rows = [{"text": p, "id": i} for i, p in enumerate(_paragraphs(80))]
    src = tmp_path / "dump.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    done = prepare(src, tmp_path / "out", SMALL)
    assert sum(done.manifest["splits"][s]["documents"] for s in SPLITS) == 80
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "ok " * 50}) + "\n" + json.dumps({"body": "no text"}) + "\n")
    with pytest.raises(DataError, match=r"line 2 has no string field .text.*body"):
        prepare(bad, tmp_path / "out2", SMALL)
    bad.write_text(json.dumps({"text": "ok"}) + "\n{not json\n")
    with pytest.raises(DataError, match="line 2 is not valid JSON"):
        prepare(bad, tmp_path / "out3", SMALL)
    assert not (tmp_path / "out2").exists() and not (tmp_path / "out3").exists()
    assert not list(tmp_path.glob(".*partial*"))  # nothing partial left behind


def test_a_jsonl_dump_named_json_and_a_prepared_dataset_as_the_source(tmp_path: Path) -> None:
    """A JSONL dump named .json was read as plain text, its --field ignored, and failed with advice to raise
    --valid-fraction; a prepared dataset given as the source failed for want of a wiki.train.bin no one makes."""
    rows = [{"body": p, "id": i} for i, p in enumerate(_paragraphs(80))]
    src = tmp_path / "dump.json"
    src.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    done = prepare(src, tmp_path / "out", PrepareOptions(valid_fraction=0.2, test_fraction=0.2, min_split_bytes=64,
                                                         progress=False, field="body"))
    assert sum(done.manifest["splits"][s]["documents"] for s in SPLITS) == 80
    assert b'"body"' not in (tmp_path / "out" / "train.bin").read_bytes()  # the field's text, not the JSON lines
    with pytest.raises(DataError, match=r"made already: pass it to training as --data"):
        prepare(tmp_path / "out", tmp_path / "again", SMALL)
    src.write_bytes(b"\n\xef\xbb\xbf" + src.read_bytes())  # a blank first line, a byte-order mark: still JSONL
    from blocktrain.data.prepare import source_kind

    assert source_kind(src) == "jsonl"
    web = tmp_path / "web"  # another project's manifest.json is only text
    web.mkdir()
    (web / MANIFEST).write_text('{"name": "site", "icons": []}\n')
    assert source_kind(web) == "directory"


def test_wikitext_layout_is_copied_byte_for_byte_and_keeps_its_fingerprint(tmp_path: Path) -> None:
    from tests.distributed_utils import write_corpus

    wiki = write_corpus(tmp_path / "wiki")
    done = prepare(wiki.root, tmp_path / "out", PrepareOptions(progress=False))
    for s in SPLITS:
        assert (tmp_path / "out" / f"{s}.bin").read_bytes() == wiki.path(s).read_bytes()
    prepared = open_data_dir(tmp_path / "out")
    assert prepared.flavour == "bin"
    assert prepared.fingerprint() == done.fingerprint == wiki.fingerprint()  # the same bytes, the same dataset
    assert len(prepared.open("train")) == len(wiki.open("train"))
    prepared.open("test", verify=True)


def test_errors_exit_2_with_no_partial_output(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "a.txt").write_text("")
    assert cli(["prepare", str(empty), "--out", str(tmp_path / "o1"), "--no-progress"]) == 2
    assert "holds no text" in capsys.readouterr().err
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("just one short paragraph\n")
    assert cli(["prepare", str(tiny), "--out", str(tmp_path / "o2"), "--no-progress"]) == 2
    assert "less than one context window" in capsys.readouterr().err
    src = tmp_path / "src"
    src.mkdir()
    (src / "ok.txt").write_text("x" * 100)
    (src / "gone.txt").symlink_to(tmp_path / "nowhere")
    assert cli(["prepare", str(src), "--out", str(tmp_path / "o3"), "--no-progress"]) == 2
    assert "gone.txt" in capsys.readouterr().err  # the unreadable file is named
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "mine.txt").write_text("keep me")
    _text_file(tmp_path / "book.txt")
    assert cli(["prepare", str(tmp_path / "book.txt"), "--out", str(busy), "--no-progress"]) == 2
    assert "not empty" in capsys.readouterr().err and (busy / "mine.txt").read_text() == "keep me"
    _text_file(tmp_path / "other.txt", 300)
    ok = ["--valid-fraction", "0.2", "--test-fraction", "0.2", "--no-progress"]
    assert cli(["prepare", str(tmp_path / "book.txt"), "--out", str(tmp_path / "ds"), *ok]) == 0
    assert cli(["prepare", str(tmp_path / "other.txt"), "--out", str(tmp_path / "ds"), *ok]) == 2
    assert "already holds another dataset" in capsys.readouterr().err
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists() and not (tmp_path / "o3").exists()
    assert not list(tmp_path.glob(".*partial*"))


def test_run_dir_refuses_another_dataset(tmp_path: Path) -> None:
    from blocktrain.checkpoint.run import RunDir
    from blocktrain.errors import ConfigError
    from blocktrain.presets import get_preset

    cfg = get_preset("tiny")
    run = RunDir(tmp_path / "run")
    run.init(cfg.with_dataset("a" * 64))
    assert run.load_config().dataset == "a" * 64
    with pytest.raises(ConfigError, match="trains on dataset aaaaaaaaaaaa"):
        run.init(cfg.with_dataset("b" * 64))
    with pytest.raises(Exception, match="fingerprint"):
        cfg.with_dataset("not hex")


def test_coordinator_refuses_every_worker_with_another_dataset(tmp_path: Path) -> None:
    from blocktrain.coordinator.service import Coordinator
    from blocktrain.coordinator.settings import CoordinatorSettings
    from blocktrain.errors import ProtocolError
    from blocktrain.presets import get_preset
    from blocktrain.protocol.delta import Compression, pack_delta

    fp = "c" * 64
    c = Coordinator(tmp_path / "run", get_preset("tiny").with_dataset(fp), CoordinatorSettings(), None)
    try:
        for other in ("d" * 64, None, ""):
            with pytest.raises(ProtocolError) as exc:
                c.register("stranger", 0, other)
            assert exc.value.status == 409 and exc.value.reason == "dataset"
            assert fp[:12] in str(exc.value)
        # never registered, so nothing it sends is taken
        with pytest.raises(ProtocolError):
            c.submit("stranger", 0, pack_delta({n: __import__("torch").zeros(s) for n, s in c.shapes.items()},
                                               Compression.INT8, block=0, base_version=0, base_sha=c.weights_sha[0], samples=1))
        assert c.store.meta.counters().get("updates_accepted", 0) == 0
        assert c.register("friend", 0, fp).block == 0
        assert c.status().dataset == fp
    finally:
        c.close()


def test_train_and_eval_on_a_prepared_directory_record_and_check_its_fingerprint(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    """train-block and eval take a prepared directory; the fingerprint lands in run.json and the eval JSON,
    and scoring on other data warns."""
    from blocktrain.checkpoint.run import RunDir

    _text_file(tmp_path / "a.txt", 600)
    _text_file(tmp_path / "b.txt", 500)
    ok = ["--valid-fraction", "0.1", "--test-fraction", "0.1", "--no-progress"]
    assert cli(["prepare", str(tmp_path / "a.txt"), "--out", str(tmp_path / "A"), *ok]) == 0
    assert cli(["prepare", str(tmp_path / "b.txt"), "--out", str(tmp_path / "B"), *ok]) == 0
    fp_a = open_data_dir(tmp_path / "A").fingerprint()
    run = tmp_path / "run"
    assert cli(["train-block", "--preset", "tiny", "--objective", "stack", "--blocks", "1", "--block", "0",
                "--steps", "2", "--out", str(run), "--data", str(tmp_path / "A"), "--no-progress"]) == 0
    assert RunDir(run).load_config().dataset == fp_a
    capsys.readouterr()
    args = ["eval", str(run), "--split", "test", "--max-bytes", "2000", "--json", "--no-progress"]
    assert cli([*args, "--data", str(tmp_path / "A")]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["dataset_fingerprint"] == doc["trained_on_dataset"] == fp_a
    caplog.clear()
    assert cli([*args, "--data", str(tmp_path / "B")]) == 0
    assert "is not comparable" in caplog.text
    # training the same run on other data is refused, with exit 2
    assert cli(["train-block", "--preset", "tiny", "--objective", "stack", "--blocks", "1", "--block", "0",
                "--steps", "3", "--out", str(run), "--data", str(tmp_path / "B"), "--no-progress"]) == 2


def test_a_run_remembers_its_data_and_eval_finds_it_without_data(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """run.json records the data directory; ``eval`` without --data scores on it, and fails at once, naming
    --data, when it is gone or holds other data (no hub download)."""
    import shutil

    from blocktrain.checkpoint.run import RunDir

    monkeypatch.delenv("BLOCKTRAIN_DATA", raising=False)
    monkeypatch.setenv("BLOCKTRAIN_CACHE", str(tmp_path / "no-cache"))
    _text_file(tmp_path / "a.txt", 600)
    ok = ["--valid-fraction", "0.1", "--test-fraction", "0.1", "--no-progress"]
    assert cli(["prepare", str(tmp_path / "a.txt"), "--out", str(tmp_path / "A"), *ok]) == 0
    run = tmp_path / "run"
    assert cli(["train-block", "--preset", "tiny", "--objective", "stack", "--blocks", "1", "--block", "0",
                "--steps", "2", "--out", str(run), "--data", str(tmp_path / "A"), "--no-progress"]) == 0
    fp = open_data_dir(tmp_path / "A").fingerprint()
    assert RunDir(run).recorded_data() == {"dir": str((tmp_path / "A").resolve()), "fingerprint": fp}
    args = ["eval", str(run), "--split", "test", "--max-bytes", "2000", "--json", "--no-progress"]
    capsys.readouterr()
    assert cli(args) == 0
    assert json.loads(capsys.readouterr().out)["dataset_fingerprint"] == fp
    shutil.move(tmp_path / "A", tmp_path / "moved")
    assert cli(args) == 2
    assert "--data" in capsys.readouterr().err
    assert cli([*args, "--data", str(tmp_path / "moved")]) == 0
    # a run from before runs recorded their data, on data other than WikiText-2: no hub download, --data named
    doc = json.loads((run / "run.json").read_text())
    del doc["data"]
    (run / "run.json").write_text(json.dumps(doc))
    capsys.readouterr()
    assert cli(args) == 2
    assert "does not record where it is" in capsys.readouterr().err


def test_a_folder_of_30_files_gets_every_split_with_the_default_fractions(tmp_path: Path) -> None:
    """The README's `prepare ~/my-notes`: 98/1/1 by hash gives these 30 files no test or valid file; the
    small-folder rule moves the lowest-hash train files there, the same ones on every run."""
    src = tmp_path / "notes"
    src.mkdir()
    for i, p in enumerate(_paragraphs(30)):
        (src / f"note{i:02d}.md").write_text(p * 40)
    assert all(split_of(f"note{i:02d}.md", PrepareOptions()) == "train" for i in range(30))  # the hash rule alone
    m = prepare(src, tmp_path / "out", PrepareOptions(progress=False)).manifest
    docs = {s: m["splits"][s]["documents"] for s in SPLITS}
    assert docs["test"] >= 1 and docs["valid"] >= 1 and sum(docs.values()) == 30
    assert all(m["splits"][s]["bytes"] >= PrepareOptions().min_split_bytes for s in SPLITS)
    again = prepare(src, tmp_path / "again", PrepareOptions(progress=False)).manifest
    assert again["fingerprint"] == m["fingerprint"]


def test_a_split_cut_short_after_prepare_is_a_data_error_on_open(tmp_path: Path) -> None:
    """A train.bin cut short (or grown) since prepare wrote it trained silently under the manifest's fingerprint;
    every open compares its size with the manifest's byte count and says to prepare again."""
    _text_file(tmp_path / "a.txt")
    prepare(tmp_path / "a.txt", tmp_path / "out", SMALL)
    with open(tmp_path / "out" / "train.bin", "r+b") as f:
        f.truncate(100)
    dd = open_data_dir(tmp_path / "out")
    with pytest.raises(DataError, match=r"train\.bin holds 100 bytes, but its manifest\.json lists \d+.*prepare.*"
                                        r"fresh --out"):
        dd.open("train")
    assert len(dd.open("valid")) > 0  # the intact splits still open


def test_prepare_again_checks_the_splits_there_and_replaces_a_damaged_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Re-running prepare into an --out holding the same fingerprint called it identical without reading it; a split
    altered since (same size: only its sha256 tells) is replaced by the one just made, and the rerun says so."""
    _text_file(tmp_path / "a.txt")
    prepare(tmp_path / "a.txt", tmp_path / "out", SMALL)
    good = _splits(tmp_path / "out")
    (tmp_path / "out" / "valid.bin").write_bytes(b"x" * len(good["valid"]))
    caplog.set_level("INFO", logger="blocktrain.data.prepare")
    prepare(tmp_path / "a.txt", tmp_path / "out", SMALL)
    assert _splits(tmp_path / "out") == good
    assert "split(s) valid did not match it; replaced" in caplog.text
    assert not list(tmp_path.glob(".*partial*"))
    caplog.clear()
    prepare(tmp_path / "a.txt", tmp_path / "out", SMALL)  # intact: left as it is
    assert "already holds this dataset" in caplog.text and "replaced" not in caplog.text


def test_jsonl_lone_surrogate_escapes_become_replacement_characters(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A lone "\\ud800" escape was written with surrogatepass: ED A0 80, invalid UTF-8 in a split. It becomes U+FFFD
    (a proper pair still decodes to its character), and the count is logged once for the file."""
    src = tmp_path / "d.jsonl"
    lines = [json.dumps({"text": p}) for p in _paragraphs(60)]
    lines[0] = '{"text": "lone \\ud800 and \\udfff, pair \\ud83d\\ude00 ' + "x" * 80 + '"}'
    src.write_text("\n".join(lines) + "\n")
    caplog.set_level("WARNING", logger="blocktrain.data.prepare")
    prepare(src, tmp_path / "out", SMALL)
    joined = b"".join(_splits(tmp_path / "out").values())
    text = joined.decode("utf-8")  # raised UnicodeDecodeError before
    assert "lone \ufffd and \ufffd, pair \U0001f600 " in text
    assert [r.getMessage() for r in caplog.records if "surrogate" in r.getMessage()] == [
        f"{src}: replaced 2 lone surrogate escape(s) (e.g. \\ud800, not valid UTF-8) with U+FFFD"]


def test_a_binary_file_is_left_out_before_the_splits_are_chosen(tmp_path: Path) -> None:
    """A binary file's bytes counted when test/valid files were chosen, then it was skipped: 'test' ended up empty
    and the message said to raise --test-fraction. Binary files are now told apart first."""
    opts = PrepareOptions(include=("*.txt", "*.dat"), progress=False)
    src = tmp_path / "src"
    src.mkdir()
    names = [f"t{i}.txt" for i in range(12)]
    for n in names:
        (src / n).write_text(f"text of {n} " * 40 + "\n")
    low = min(_unit(n) for n in names)  # a binary file of lower hash than every text file: moved to test first
    blob = next(f"blob{i}.dat" for i in range(10000) if _unit(f"blob{i}.dat") < low
                and split_of(f"blob{i}.dat", opts) == "train")
    (src / blob).write_bytes(b"\0" * 4000)
    m = prepare(src, tmp_path / "out", opts).manifest
    assert m["binary_files_skipped"] == 1
    assert all(m["splits"][s]["bytes"] >= opts.min_split_bytes for s in SPLITS)


@pytest.mark.parametrize("umask", [0o022, 0o027], ids=["umask-022", "umask-027"])
def test_a_prepared_dataset_gets_the_modes_the_umask_gives(tmp_path: Path, umask: int) -> None:
    """mkdtemp made the dataset directory 0o700 and the manifest's atomic write 0o600: readable by its owner alone.
    The directory and its files get 0o777 / 0o666 less the umask, like anything else the user makes."""
    _text_file(tmp_path / "a.txt")
    old = os.umask(umask)
    try:
        prepare(tmp_path / "a.txt", tmp_path / "out", SMALL)
    finally:
        os.umask(old)
    out = tmp_path / "out"
    assert stat.S_IMODE(out.stat().st_mode) == 0o777 & ~umask
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()} == {
        name: 0o666 & ~umask for name in (MANIFEST, "train.bin", "valid.bin", "test.bin")}
