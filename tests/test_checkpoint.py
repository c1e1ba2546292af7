from __future__ import annotations

import hashlib
import json
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

from blocktrain.checkpoint.safetensors_io import legacy_tensors_sha256, load_file, pack, save_file, tensors_sha256, unpack
from blocktrain.errors import CheckpointError


def test_exact_bytes_of_wire_format() -> None:
    payload = pack({"a": torch.tensor([1.0, 2.0])}, {"kind": "x"})
    n = int.from_bytes(payload[:8], "little")
    header = json.loads(payload[8 : 8 + n])
    digest = tensors_sha256({"a": torch.tensor([1.0, 2.0])})
    meta_digest = hashlib.sha256(b'{"kind":"x"}').hexdigest()  # canonical JSON of the free-form fields
    assert header["__metadata__"] == {"kind": "x", "format": "blocktrain", "format_version": "2", "sha256": digest,
                                      "meta_sha256": meta_digest}
    assert header["a"] == {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
    assert payload[8 + n :] == b"\x00\x00\x80\x3f\x00\x00\x00\x40"  # 1.0f, 2.0f little-endian
    assert digest == tensors_sha256({"a": torch.tensor([1.0, 2.0])})


def test_round_trip(tmp_path: Path) -> None:
    t = {"w": torch.randn(3, 4), "b": torch.arange(5, dtype=torch.int64)}
    save_file(tmp_path / "c.safetensors", t, {"step": "7"})
    got, meta = load_file(tmp_path / "c.safetensors")
    assert meta["step"] == "7" and all(torch.equal(got[k], t[k]) for k in t)


def test_tampered_tensor_detected(tmp_path: Path) -> None:
    payload = bytearray(pack({"w": torch.zeros(16)}))
    payload[-1] ^= 0x01
    with pytest.raises(CheckpointError, match="sha256 mismatch"):
        unpack(bytes(payload))


def test_tampered_metadata_detected(tmp_path: Path) -> None:
    """A damaged free-form field (here the block index, one digit changed in place) is refused like a damaged
    tensor: before version 2 it loaded, naming another block."""
    payload = pack({"w": torch.zeros(4)}, {"block": "1", "config": "{}"})
    damaged = payload.replace(b'"block":"1"', b'"block":"3"')
    assert len(damaged) == len(payload) and damaged != payload
    with pytest.raises(CheckpointError, match="meta_sha256"):
        unpack(damaged)
    save_file(tmp_path / "c.safetensors", {"w": torch.zeros(4)}, {"block": "1"})
    raw = (tmp_path / "c.safetensors").read_bytes()
    (tmp_path / "c.safetensors").write_bytes(raw.replace(b'"block":"1"', b'"block":"2"'))
    with pytest.raises(CheckpointError, match="meta_sha256"):
        load_file(tmp_path / "c.safetensors")


def test_version_1_files_still_load() -> None:
    """A file written before meta_sha256 existed (version 1: tensors' sha256 only) still loads."""
    from safetensors.torch import save

    t = {"w": torch.arange(3.0)}
    v1_sha = "478390cfa933f0455b83a8fe677e171de3f3ebb3619c67c7bf0ee02b176226ec"  # what BlockTrain before 2 wrote for t
    old = save(t, metadata={"block": "0", "format": "blocktrain", "format_version": "1", "sha256": v1_sha})
    got, meta = unpack(old)
    assert torch.equal(got["w"], t["w"]) and meta["block"] == "0"
    with pytest.raises(CheckpointError, match="format version '3' is not supported"):
        unpack(save(t, metadata={"format": "blocktrain", "format_version": "3", "sha256": tensors_sha256(t)}))


@pytest.mark.parametrize(
    "payload",
    [b"", b"1234", pickle.dumps({"w": [1, 2, 3]}), b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}......"],
)
def test_garbage_rejected(payload: bytes) -> None:
    with pytest.raises(CheckpointError):
        unpack(payload)


def test_truncated_rejected() -> None:
    payload = pack({"w": torch.randn(100)})
    with pytest.raises(CheckpointError):
        unpack(payload[:-10])


def test_foreign_safetensors_rejected() -> None:
    from safetensors.torch import save

    with pytest.raises(CheckpointError, match="not a BlockTrain file"):
        unpack(save({"w": torch.zeros(2)}))


def test_reserved_metadata() -> None:
    with pytest.raises(ValueError, match="reserved"):
        pack({"w": torch.zeros(1)}, {"sha256": "x"})


@pytest.mark.parametrize("header", [b"[1, 2, 3]", b'{"__metadata__": [1]}', b'"text"'])
def test_non_object_headers_rejected(header: bytes) -> None:
    payload = len(header).to_bytes(8, "little") + header
    with pytest.raises(CheckpointError):
        unpack(payload)


def test_a_header_nested_too_deep_is_refused_as_not_json() -> None:
    """A header nested 200,000 deep made json raise RecursionError, which escaped every caller's refusal path."""
    header = b"[" * 200_000 + b"]" * 200_000
    with pytest.raises(CheckpointError, match="not JSON"):
        unpack(len(header).to_bytes(8, "little") + header)


def test_more_tensors_than_a_blocktrain_file_holds_are_refused_before_any_is_built() -> None:
    """17,000 empty tensors: refused from the header's count, in well under the seconds building them took."""
    from safetensors.torch import save

    from blocktrain.checkpoint.safetensors_io import MAX_TENSORS

    many = {f"t{i}": torch.zeros(0) for i in range(MAX_TENSORS + 1)}
    payload = save(many, metadata={"format": "blocktrain", "format_version": "1", "sha256": legacy_tensors_sha256(many)})
    with pytest.raises(CheckpointError, match=f"{MAX_TENSORS + 1} tensors"):
        unpack(payload)
    fewer = dict(list(many.items())[:MAX_TENSORS])
    ok = save(fewer, metadata={"format": "blocktrain", "format_version": "1", "sha256": legacy_tensors_sha256(fewer)})
    assert len(unpack(ok)[0]) == MAX_TENSORS


def test_streamed_file_is_standard_safetensors(tmp_path: Path) -> None:
    """save_file writes the layout itself; safetensors and unpack must both read it back exactly."""
    from safetensors.torch import load_file as st_load_file

    t = {
        "w": torch.randn(5, 3),
        "h": torch.randn(4, dtype=torch.float64).to(torch.bfloat16),
        "step": torch.tensor(7.0),
        "ids": torch.arange(6, dtype=torch.int64).view(2, 3),
        "mask": torch.tensor([True, False]),
        "empty": torch.zeros(0, 3),
    }
    digest = save_file(tmp_path / "s.safetensors", t, {"step": "3"})
    raw = (tmp_path / "s.safetensors").read_bytes()
    assert int.from_bytes(raw[:8], "little") % 8 == 0
    theirs = st_load_file(str(tmp_path / "s.safetensors"))
    ours, meta = load_file(tmp_path / "s.safetensors")
    assert meta["sha256"] == digest == tensors_sha256(t) and meta["step"] == "3"
    for k in t:
        assert torch.equal(theirs[k], t[k]) and torch.equal(ours[k], t[k]), k
    # same tensors and metadata as the in-memory wire form
    wire_tensors, wire_meta = unpack(pack(t, {"step": "3"}))
    assert wire_meta == meta and all(torch.equal(wire_tensors[k], ours[k]) for k in t)


def test_failed_write_leaves_nothing_behind(tmp_path: Path) -> None:
    from blocktrain.checkpoint.safetensors_io import atomic_open

    target = tmp_path / "x.safetensors"
    with pytest.raises(RuntimeError), atomic_open(target) as f:
        f.write(b"partial")
        raise RuntimeError("killed mid-write")
    assert list(tmp_path.iterdir()) == []
    save_file(target, {"w": torch.ones(2)})
    before = target.read_bytes()
    with pytest.raises(ValueError, match="safetensors cannot store"):
        save_file(target, {"w": torch.ones(2, dtype=torch.complex64)})
    assert target.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["x.safetensors"]


def _with_header(payload: bytes, edit: object) -> bytes:
    """``payload`` with its JSON header replaced by ``edit(header)`` (a dict, or header text), data unchanged."""
    n = int.from_bytes(payload[:8], "little")
    header = edit(json.loads(payload[8 : 8 + n]))  # type: ignore[operator]
    raw = header.encode() if isinstance(header, str) else json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw + payload[8 + n :]


def test_a_dtype_torch_cannot_read_is_a_checkpoint_error() -> None:
    """safetensors parses dtypes torch has no mapping for (F8_E8M0, F4): loading one raised a raw KeyError (a push's
    500, and an audit upload's 'coordinator fault' that quarantined no one). It is a CheckpointError naming the dtype."""
    payload = pack({"a": torch.zeros(4)})

    def f8(h: dict[str, Any]) -> dict[str, Any]:
        h["a"].update(dtype="F8_E8M0", shape=[16])
        return h

    with pytest.raises(CheckpointError, match="F8_E8M0"):
        unpack(_with_header(payload, f8))

    def listed(h: dict[str, Any]) -> dict[str, Any]:
        h["a"]["dtype"] = ["F32"]  # unhashable: a TypeError in the dtype check itself
        return h

    with pytest.raises(CheckpointError, match="dtype"):
        unpack(_with_header(payload, listed))


def test_a_header_naming_a_tensor_twice_is_refused() -> None:
    payload = pack({"a": torch.zeros(4)})

    def twice(h: dict[str, Any]) -> str:
        entry = json.dumps(h["a"])
        return json.dumps(h).replace('"a": ', f'"a": {entry}, "a": ', 1)

    with pytest.raises(CheckpointError, match="'a' twice"):
        unpack(_with_header(payload, twice))


def test_a_header_larger_than_a_blocktrain_file_s_is_refused_before_it_is_parsed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A header of ten million empty lists deflates to 29 kB and took 718 MB and 3.4 s to parse: one past the cap is
    refused from its length."""
    from blocktrain.checkpoint import safetensors_io

    payload = pack({"a": torch.zeros(4)})
    n = int.from_bytes(payload[:8], "little")
    monkeypatch.setattr(safetensors_io, "MAX_HEADER_BYTES", n - 1)
    loads = []
    monkeypatch.setattr(safetensors_io.json, "loads", lambda *a, **k: loads.append(1))
    with pytest.raises(CheckpointError, match="header of"):
        unpack(payload)
    assert not loads


def test_a_committed_blob_s_name_is_made_durable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A blob renamed into place and then named by a committed row: its directory is fsynced after the rename (a power
    loss could keep the row and lose the name), and after an atomic write's rename likewise."""
    from blocktrain.checkpoint import safetensors_io
    from blocktrain.coordinator import blobs

    safetensors_io.fsync_dir(tmp_path)  # the real one: a directory opens and fsyncs here
    synced: list[Path] = []
    monkeypatch.setattr(blobs, "fsync_dir", lambda d: synced.append(Path(d)))
    monkeypatch.setattr(safetensors_io, "fsync_dir", lambda d: synced.append(Path(d)))
    store = blobs.BlobStore(tmp_path / "blobs")
    one, two = store.stage_blob(b"payload"), store.stage_blob(b"sketch")
    store.commit_blob(one, two)
    assert store.get_blob(one.digest) == b"payload" and store.get_blob(two.digest) == b"sketch"
    assert synced == [tmp_path / "blobs"]  # once for both
    safetensors_io.atomic_write_bytes(tmp_path / "d" / "f.bin", b"x")
    assert synced[-1] == tmp_path / "d"


def test_a_crash_s_temp_files_in_the_blob_store_are_swept_once_stale(tmp_path: Path) -> None:
    """A crash while pushes were staged left their bodies (up to the body cap each) as temp files nothing ever
    removed. Opening the store deletes those older than STALE_TMP_S; a fresh one (a live writer's) stays, and so do
    named blobs."""
    import os
    import time

    from blocktrain.coordinator.blobs import STALE_TMP_S, BlobStore

    store = BlobStore(tmp_path / "blobs", fsync=False)
    named = store.put_blob(b"kept")
    old = store.stage_blob(b"a body whose push never finished")
    fresh = store.stage_blob(b"a body being checked now")
    assert old.tmp is not None and fresh.tmp is not None
    then = time.time() - STALE_TMP_S - 60
    os.utime(old.tmp, (then, then))
    BlobStore(tmp_path / "blobs", fsync=False)  # a restart
    assert not old.tmp.exists() and fresh.tmp.exists() and store.get_blob(named) == b"kept"


def test_an_audit_commitment_made_under_the_old_digest_still_matches_its_state() -> None:
    """A push committed to its state's sha256 before the upgrade to format version 2; its audit upload, judged after
    the coordinator's upgrade, was compared with the new digest only and failed: the honest worker was quarantined
    (helper-61). The commitment may be either digest of the (schema-checked) state; nothing else."""
    from blocktrain.protocol.inner_state import commits_to

    state = {"adam.m.w": torch.ones(2, 3), "adam.v.w": torch.full((2, 3), 0.5)}
    assert commits_to(state, tensors_sha256(state)) and commits_to(state, legacy_tensors_sha256(state))
    other = {**state, "adam.v.w": torch.full((2, 3), 0.25)}
    assert not commits_to(state, tensors_sha256(other)) and not commits_to(state, legacy_tensors_sha256(other))


@pytest.mark.parametrize("mask", [0o022, 0o077])
def test_an_atomic_write_gets_the_mode_the_umask_gives(tmp_path: Path, mask: int) -> None:
    """mkstemp makes its file 0o600, and the rename kept it: run.json, every checkpoint and the WikiText cache were
    readable by their owner alone (a serve or eval run as another user failed on them). They now get 0o666 less the
    umask, as a plain open gives."""
    import os
    import stat

    from blocktrain.checkpoint.safetensors_io import atomic_write_bytes

    old = os.umask(mask)
    try:
        atomic_write_bytes(tmp_path / "run.json", b"{}")
        save_file(tmp_path / "block.safetensors", {"w": torch.zeros(2)})
    finally:
        os.umask(old)
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in tmp_path.iterdir()} == {
        "run.json": 0o666 & ~mask, "block.safetensors": 0o666 & ~mask}
