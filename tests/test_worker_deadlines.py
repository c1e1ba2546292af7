"""The worker's side of a round's deadline: it counts from the work answer, keeps room for a step and a push, and a
coordinator with no room to audit a push does not end an honest worker."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from blocktrain.data.dataset import DataDir
from blocktrain.errors import ConfigError, ProtocolError
from blocktrain.protocol.codes import Reason
from blocktrain.protocol.group import GroupMember
from blocktrain.protocol.messages import WorkAnswer
from blocktrain.worker.client import CoordinatorClient
from blocktrain.worker.engines import Combined, DirectEngine
from blocktrain.worker.loop import Recent, Worker
from blocktrain.worker.options import WorkerOptions
from tests.distributed_utils import ThreadServer, corpus, make_coordinator, run_worker  # noqa: F401

pytestmark = pytest.mark.timeout(120)

BUSY = {"detail": "64 audits await their uploads", "error": "audits_busy"}


def test_the_recent_window_forgets_an_outlier() -> None:
    """A running maximum kept one slow push (a minutes-long outage) as the margin for good, so every later round was
    cut to one step; the window forgets it after ``n`` more."""
    r = Recent(n=3)
    assert r.recent() == 0.0
    for s in (120.0, 1.0, 2.0):
        r.add(s)
    assert r.recent() == 120.0
    r.add(1.5)
    assert r.recent() == 2.0


def test_a_push_refused_audits_busy_until_give_up_raises_that_and_the_worker_goes_on(corpus: DataDir) -> None:  # noqa: F811
    """503 ``audits_busy`` (a push on probation while the coordinator's audits are all taken) is sent again; past
    ``give_up_s`` it raised "unreachable" and the honest worker left. It raises ``audits_busy`` now, which the worker
    takes as a round to train again."""
    calls: list[float] = []

    def answer(request: httpx.Request) -> httpx.Response:
        calls.append(time.monotonic())
        return httpx.Response(503, json=BUSY)

    client = CoordinatorClient("http://coordinator", "t", base_delay=0.01, max_delay=0.02, give_up_s=0.2,
                               deflate_pushes=False)
    client.http = httpx.Client(base_url="http://coordinator", transport=httpx.MockTransport(answer))
    beats: list[int] = []
    client.waiting = lambda: beats.append(1)  # the worker's heartbeat: its lease is kept while it waits
    with pytest.raises(ProtocolError) as exc:
        client.push(0, b"push")
    assert exc.value.status == 503 and exc.value.reason == Reason.AUDITS_BUSY and len(calls) > 2 and beats
    client.close()

    w = Worker(WorkerOptions(url="http://coordinator", token="t", block=0, progress=False), corpus)
    w.k, w.base_version = 0, 3
    w._refused_push(exc.value)  # no raise: the next work answer trains the round again
    assert w.summary.rounds_stale == 1 and w._refused == (-1, -1)
    with pytest.raises(ProtocolError):
        w._refused_push(ProtocolError(503, "coordinator unreachable", Reason.UNREACHABLE))


def test_a_push_is_timed_by_its_answered_sending() -> None:
    """The margin kept before a deadline is the push's time: the sending that was answered, not its retries."""
    answers = iter(["slow", "ok"])

    def answer(request: httpx.Request) -> httpx.Response:
        if next(answers) == "slow":
            time.sleep(0.5)
            return httpx.Response(503, json={"detail": "restarting", "error": "unavailable"})
        return httpx.Response(202, json={"accepted": True, "block": 0, "version": 0})

    client = CoordinatorClient("http://coordinator", "t", base_delay=0.01, max_delay=0.02, deflate_pushes=False)
    client.http = httpx.Client(base_url="http://coordinator", transport=httpx.MockTransport(answer))
    timed: list[float] = []
    assert client.push(0, b"push", timed=timed.append).accepted
    assert len(timed) == 1 and timed[0] < 0.4
    client.close()


class SlowDownloads(Worker):
    """Its frozen inputs and moments take 2 s to fetch after each work answer (a stack's later block, a slow link)."""

    def _frozen(self, work: WorkAnswer) -> list:  # type: ignore[type-arg]
        time.sleep(2.0)
        return super()._frozen(work)


def test_the_downloads_after_a_work_answer_count_against_its_deadline(tmp_path: Path, corpus: DataDir) -> None:  # noqa: F811
    """The deadline a work answer gives counts from that answer: the worker set it after its downloads, so a worker
    whose downloads took 2 s trained 2 s past the round's deadline and its push came late (409 stale where the round
    closed meanwhile)."""
    c = make_coordinator(tmp_path / "run", corpus, rounds=1, round_seconds=5.0, eval_every=0, local_steps=100_000)
    w = run_worker(c, SlowDownloads, corpus, tmp_path, "slow")
    assert w.summary.rounds_cut == 1 and w.summary.rounds_pushed == 1
    rows = c.store.q("SELECT arrival_s FROM updates WHERE block=0")
    assert len(rows) == 1 and rows[0]["arrival_s"] < 5.0, rows  # before the deadline, downloads and all
    c.close()


class NoMeanLands(DirectEngine):
    """Its delta goes into a group mean that another member was to upload, and never does (the uploader left)."""

    def __init__(self) -> None:
        self.grouped = -1

    def combine(self, delta: dict, samples: int, k: int, v: int, clock: object, each: int) -> None:  # type: ignore[override, type-arg]
        self.grouped = v
        return None

    def waits_for_peers(self, v: int) -> bool:
        return self.grouped == v


def engine_worker(engine: Callable[[], DirectEngine]) -> type[Worker]:
    """A worker that carries its deltas with ``engine()`` (made again at each registration) instead of its own."""

    class EngineWorker(Worker):
        def _register(self) -> None:
            super()._register()
            self.engine = engine()

    return EngineWorker


def test_a_grouped_round_whose_mean_never_lands_is_pushed_alone_before_its_deadline(tmp_path: Path,
                                                                                   corpus: DataDir) -> None:  # noqa: F811
    """A member whose delta went into a group mean that another member was to upload dropped it and waited for the
    next version: an uploader that left, was refused or never sent it cost the round all its members' training (and
    held the round to its deadline). The member keeps its delta and pushes it alone as the deadline nears."""
    c = make_coordinator(tmp_path / "run", corpus, rounds=1, round_seconds=6.0, eval_every=0, local_steps=4)
    w = run_worker(c, engine_worker(NoMeanLands), corpus, tmp_path, "member", timeout=60)
    assert w.summary.rounds_alone == 1 and w.summary.rounds_pushed == 1 and c.version[0] == 1
    rows = c.store.q("SELECT arrival_s, samples FROM updates WHERE block=0")
    assert len(rows) == 1 and rows[0]["arrival_s"] < 6.0 and rows[0]["samples"] > 0, rows
    c.close()


def test_an_answer_garbled_on_the_way_is_asked_again_and_backoff_stays_finite() -> None:
    """A deflate answer that does not inflate (a proxy, a cut) raised httpx.DecodingError, no TransportError, past the
    retries: a heartbeat's ended the worker with a traceback. It is asked again. And the backoff's 2**attempt is
    capped: past 1,024 retries (hours, with a long --give-up-s) it overflowed a float."""
    answers = iter(["garbled", "ok"])

    def answer(request: httpx.Request) -> httpx.Response:
        if next(answers) == "garbled":
            return httpx.Response(200, headers={"Content-Encoding": "deflate"}, content=b"not deflate at all")
        return httpx.Response(202, json={"accepted": True, "block": 0, "version": 0})

    client = CoordinatorClient("http://coordinator", "t", base_delay=0.01, max_delay=0.02, deflate_pushes=False)
    client.http = httpx.Client(base_url="http://coordinator", transport=httpx.MockTransport(answer))
    assert client.push(0, b"push").accepted
    client.close()

    calls: list[int] = []

    def refused(request: httpx.Request) -> httpx.Response:
        calls.append(1)
        if len(calls) > 1100:
            client.stop.set()
        return httpx.Response(503, json={"detail": "restarting", "error": "unavailable"})

    client = CoordinatorClient("http://coordinator", "t", base_delay=1e-300, max_delay=1e-300, give_up_s=3600.0,
                               deflate_pushes=False)
    client.http = httpx.Client(base_url="http://coordinator", transport=httpx.MockTransport(refused))
    with pytest.raises(ProtocolError) as exc:
        client.push(0, b"push")
    assert exc.value.reason in (Reason.STOPPED, Reason.UNREACHABLE) and len(calls) > 1100  # not an OverflowError
    client.close()


def test_a_new_registration_drops_the_grouped_round_of_the_block_held_before(tmp_path: Path, corpus: DataDir) -> None:  # noqa: F811
    """A grouped round's delta waiting for its group's mean (``_unsent``) outlived a registration on another block:
    at the same version it was pushed there, block k1's delta against block k2's weights. On the same block its
    inner state is reset by the registration, so its push would commit to an empty state and fail its audit."""
    c = make_coordinator(tmp_path / "run", corpus, eval_every=0)
    try:
        c.add_token("w")
        w = Worker(WorkerOptions(url="http://coordinator", token="t", block=0, progress=False), corpus)
        w._setup(c.register("w", 0))
        w._unsent = (0, {}, 8)
        w._setup(c.register("w", 1))
        assert w.k == 1 and w._unsent is None
        w._unsent = (0, {}, 8)  # registered again on the same block (a lapsed lease): its round's inner state is gone
        w._setup(c.register("w", 1))
        assert w._unsent is None and w.round_state == {}
    finally:
        c.close()


def test_a_second_signal_cuts_a_long_answer_short() -> None:
    """An answer read chunk after chunk (a slow link, a proxy that trickles) went on to its end after the worker was
    told to leave at once; it stops at the next chunk."""
    client = CoordinatorClient("http://coordinator", "t", base_delay=0.01, max_delay=0.02, deflate_pushes=False)
    sent: list[int] = []

    def chunks() -> Iterator[bytes]:
        for i in range(100):
            sent.append(i)
            if i == 3:
                client.stop.set()  # the second Ctrl-C, while the weights come
            yield b"x" * 1024

    client.http = httpx.Client(base_url="http://coordinator",
                               transport=httpx.MockTransport(lambda r: httpx.Response(200, content=chunks())))
    with pytest.raises(ProtocolError) as exc:
        client.weights(0)
    assert exc.value.reason == Reason.STOPPED and len(sent) < 10
    client.close()


class RefusedMean(DirectEngine):
    """It uploads its group's mean, which the coordinator refuses for a member's sake (here: it hosts no groups)."""

    def combine(self, delta: dict, samples: int, k: int, v: int, clock: object, each: int) -> Combined:  # type: ignore[override, type-arg]
        members = [GroupMember("PeerA", samples, "uploader", b"a"), GroupMember("PeerB", samples, "other", b"b")]
        return Combined({n: 2 * t for n, t in delta.items()}, 2 * samples, members)


def test_an_uploader_whose_mean_is_refused_for_a_member_pushes_its_own_delta_alone(tmp_path: Path,
                                                                                   corpus: DataDir) -> None:  # noqa: F811
    """The member that uploads its group's mean kept no delta of its own: a mean refused for another member's sake (one
    that pushed alone first: 409 duplicate) cost the uploader its round, where every other member keeps its delta to
    push alone. It keeps its own now and pushes it alone before the deadline."""
    c = make_coordinator(tmp_path / "run", corpus, rounds=1, round_seconds=6.0, eval_every=0, local_steps=4)
    w = run_worker(c, engine_worker(RefusedMean), corpus, tmp_path, "uploader", timeout=60)
    assert w.summary.rounds_alone == 1 and w.summary.rounds_pushed == 1 and c.version[0] == 1
    rows = c.store.q("SELECT arrival_s, samples FROM updates WHERE block=0")
    assert len(rows) == 1 and rows[0]["arrival_s"] < 6.0 and rows[0]["samples"] == 4 * c.cfg.train.batch_size, rows
    c.close()


def test_an_uploader_whose_mean_is_refused_for_what_it_holds_pushes_its_own_delta_and_is_not_ended(
        tmp_path: Path, corpus: DataDir) -> None:  # noqa: F811
    """A mean refused for its content (a NaN, a norm, the gate) counted against its uploader, which kept no delta of its
    own: one hostile member poisoning the means an honest uploader sent cost it every such round and ended it at
    --max-rejections (here 1). It cannot tell whose the fault is, so it keeps its own delta to push alone, uncounted.
    The coordinator here hosts no groups, so its answer to a mean holding another member's NaN is stood in for."""

    class PoisonedMeanWorker(engine_worker(RefusedMean)):  # type: ignore[misc]
        def _register(self) -> None:
            super()._register()
            push = self.client.push

            def refuse_means(k: int, payload: bytes, **kw: object) -> object:
                if b'"group"' in payload[:65536]:  # the mean's header names its members
                    raise ProtocolError(422, "tensor 'w' holds NaN or infinite values", Reason.NON_FINITE)
                return push(k, payload, **kw)  # type: ignore[arg-type]

            self.client.push = refuse_means  # type: ignore[method-assign]

    c = make_coordinator(tmp_path / "run", corpus, rounds=1, round_seconds=6.0, eval_every=0, local_steps=4)
    token = c.add_token("uploader")
    with ThreadServer(c) as srv:
        w = PoisonedMeanWorker(WorkerOptions(url=srv.url, token=token, block=0, progress=False, max_rejections=1,
                                             frozen_cache=tmp_path / "frozen"), corpus)
        t = threading.Thread(target=w.run, daemon=True)
        t.start()
        t.join(timeout=60)
        assert not t.is_alive(), "the worker did not stop within 60 s"
    assert w.summary.rounds_alone == 1 and w.summary.rounds_pushed == 1 and c.version[0] == 1 and w._rejections == 0
    c.close()


@pytest.mark.parametrize(("poll_s", "give_up_s"), [(math.inf, 600.0), (math.nan, 600.0), (0.5, math.nan), (0.0, 600.0)])
def test_worker_options_refuse_polls_and_give_ups_that_are_no_numbers(poll_s: float, give_up_s: float) -> None:
    """NaN passed ``<= 0`` for both, and an infinite poll waited for ever between work requests; inf stays a give-up
    time (never)."""
    with pytest.raises(ConfigError, match="poll_s"):
        WorkerOptions(url="http://127.0.0.1:9", token="t", poll_s=poll_s, give_up_s=give_up_s)
    assert WorkerOptions(url="http://127.0.0.1:9", token="t", give_up_s=math.inf).give_up_s == math.inf
