"""What a worker keeps from one round to the next when a round does not count (helper-67's review): a round whose
training diverged pushes nothing and leaves no NaN in its error feedback; a rate-limited push ends no honest worker;
an undone round takes back the version it had counted as kept."""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from blocktrain.data.dataset import DataDir
from blocktrain.errors import ProtocolError
from blocktrain.protocol.codes import Reason
from blocktrain.protocol.delta import Compression, ErrorFeedback
from blocktrain.worker import loop
from blocktrain.worker.loop import Worker
from blocktrain.worker.options import WorkerOptions
from tests.distributed_utils import ThreadServer, corpus, make_coordinator  # noqa: F401

pytestmark = pytest.mark.timeout(120)


class DivergesAtV0(Worker):
    """Its round at version 0 ends with a NaN in the block's weights (an overflow in a bf16 step)."""

    def _delta(self) -> tuple[dict[str, torch.Tensor], int]:
        delta, samples = super()._delta()
        if self.base_version == 0:
            first = next(iter(delta))
            delta[first] = delta[first].clone()
            delta[first].view(-1)[0] = float("nan")
        return delta, samples


def test_a_round_that_diverged_pushes_nothing_and_keeps_no_nan(tmp_path: Path, corpus: DataDir) -> None:  # noqa: F811
    """int8 (the default encoding) sent a NaN as 0 at scale 1, so the coordinator took the push, and the worker's error
    feedback kept the NaN: every later push of that tensor was about zero, and its next audit failed. A round whose
    delta is not finite is now pushed nowhere, undone, and counted toward --max-rejections (here 1)."""
    c = make_coordinator(tmp_path / "run", corpus, rounds=2, round_seconds=30.0, eval_every=0, local_steps=2)
    token = c.add_token("w")
    raised: list[BaseException] = []
    with ThreadServer(c) as srv:
        w = DivergesAtV0(WorkerOptions(url=srv.url, token=token, block=0, progress=False, max_rejections=1,
                                       compression=Compression.INT8, frozen_cache=tmp_path / "frozen"), corpus)

        def run() -> None:
            try:
                w.run()
            except ProtocolError as exc:
                raised.append(exc)

        t = threading.Thread(target=run, daemon=True)
        t.start()
        t.join(timeout=60)
        assert not t.is_alive(), "the worker did not stop within 60 s"
    assert len(raised) == 1 and isinstance(raised[0], ProtocolError) and raised[0].reason == Reason.NON_FINITE
    assert "--precision fp32" in str(raised[0])
    assert c.store.q("SELECT worker FROM updates") == []  # nothing reached the coordinator
    assert all(bool(torch.isfinite(e).all()) for e in w.feedback.residual.values())
    assert w.summary.rounds_pushed == 0 and w._kept_version == -1
    c.close()


def test_int8_refuses_to_encode_a_nan_rather_than_send_it_as_zero() -> None:
    feedback = ErrorFeedback(Compression.INT8)
    with pytest.raises(ValueError, match="NaN or infinite"):
        feedback.encode({"w": torch.tensor([1.0, float("nan")])})
    with pytest.raises(ValueError, match="NaN or infinite"):
        feedback.encode({"w": torch.tensor([1.0, float("inf")])})
    assert feedback.residual == {}  # nothing kept from a push that was never encoded


def test_a_rate_limited_push_ends_no_honest_worker(corpus: DataDir, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """429 ``rate_limited`` answers a worker whose requests the coordinator refused often of late (stale pushes of a
    slow worker in short rounds count there too): it judged nothing, so the worker neither counts it toward
    --max-rejections nor skips the round; it waits a while and goes on."""
    monkeypatch.setattr(loop, "RATE_LIMIT_WAIT_S", 0.01)
    w = Worker(WorkerOptions(url="http://coordinator", token="t", block=0, progress=False, max_rejections=1), corpus)
    w.k, w.base_version, w._rejections = 0, 3, 0
    for _ in range(3):
        w._refused_push(ProtocolError(429, "too many refused requests of late", Reason.RATE_LIMITED))
    assert w._rejections == 0 and w._refused == (-1, -1) and w.summary.rounds_stale == 3
    with pytest.raises(ProtocolError):  # a refusal of what the push holds still counts
        w._refused_push(ProtocolError(422, "norm out of bounds", Reason.NORM))


def test_an_undone_round_takes_back_the_version_it_had_counted_as_kept() -> None:
    """A member whose group's mean was to count moved its kept version on; when its own delta, pushed alone, was then
    refused, the inner state and loaded moments went back to the round's start but the kept version stayed, so the
    moments published within its window were never loaded (:meth:`Worker._published_moments`)."""
    restored: list[object] = []
    w = Worker.__new__(Worker)
    w.inner = SimpleNamespace(restore=restored.append)  # type: ignore[assignment]
    w._undo = ({"state": {}}, 3, 2)  # the round began with moments of v3 loaded and v2 its newest kept
    w._moments_version, w._kept_version = 6, 6  # it loaded v6's moments, and its group's mean was to count
    w._undo_round()
    assert (w._moments_version, w._kept_version) == (3, 2) and len(restored) == 1
