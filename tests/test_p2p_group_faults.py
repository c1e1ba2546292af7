"""Faults in a hivemind group all-reduce (:mod:`blocktrain.p2p.groups`): a member that stalls or fails its part,
sends a weight other than 1 or declares itself auxiliary fails the group for every honest member, which returns
None (and uploads alone) within its timeout; a group of honest members still lands on the claim-weighted mean.
Also the bounds ``average`` keeps with hivemind's own waits, and the worker's matchmaking flag.

Runs where the ``hivemind`` extra is installed; skipped otherwise. The misbehaving averagers subclass the real one
under the same class name (hivemind names its RPC handles after the class), and are made for one member only.
"""

from __future__ import annotations

import asyncio
import itertools
import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, AsyncIterator  # noqa: UP035  # hivemind reads typing's AsyncIterator in RPC hints, no other

import pytest
import torch

hivemind = pytest.importorskip("hivemind")

from hivemind.p2p import P2PContext  # noqa: E402
from hivemind.proto import averaging_pb2  # noqa: E402

import blocktrain.p2p.groups as G  # noqa: E402
from blocktrain.errors import ConfigError  # noqa: E402
from blocktrain.p2p.groups import GroupAverager, GroupOutcome, join_dht  # noqa: E402
from blocktrain.p2p.trust import Authority, PeerAuthorizer  # noqa: E402
from blocktrain.worker.options import WorkerOptions  # noqa: E402
from tests.test_hivemind_averaging import KEYS, _averagers  # noqa: E402

TIMEOUT_S = 6.0  # each member's average() timeout in the loopback groups (matchmaking_s is 1 there)
MARGIN_S = 2.0  # what average() may take past its timeout (cancelling the step, the thread's own start)
SIZE = 300_000  # floats per delta: 1.2 MB, about three of hivemind's 512 KiB parts, one per member to reduce
SAMPLES = [8, 1, 1]  # the claims: a wrong mean is far from the claim-weighted reference
_blocks = itertools.count()  # a fresh block (its own group key and averagers) for each group below


@pytest.fixture(scope="module")
def group() -> Iterator[list[GroupAverager]]:
    """Three admitted workers on a loopback DHT (the coordinator's peer bootstraps it); each test's round uses a block
    of its own, so the averagers of a test never meet another test's."""
    authority = Authority(KEYS[0])
    dht0 = join_dht([], PeerAuthorizer(KEYS[0], authority.issue("coordinator", KEYS[0].get_public_key().to_bytes()),
                                       authority.public_key), "127.0.0.1")
    members: list[GroupAverager] = []
    try:
        members = _averagers(3, authority, dht0, KEYS[1:4], "faults")
        yield members
    finally:
        for m in members:
            m.close()
        dht0.shutdown()


@contextmanager
def _third_averager_is(cls: type | None) -> Iterator[None]:
    """Averagers made meanwhile are ``cls`` (a misbehaving subclass), the real class again afterwards."""
    honest = G.BlockAverager
    if cls is not None:
        G.BlockAverager = cls  # type: ignore[misc,assignment]
    try:
        yield
    finally:
        G.BlockAverager = honest  # type: ignore[misc]


def _round(members: list[GroupAverager], misbehaving: type | None) -> tuple[list[Any], float, dict[str, torch.Tensor]]:
    """One round of the three members on a fresh block, the third's averager ``misbehaving`` (None: honest): what each
    ``average`` returned (None, a GroupOutcome, an exception, or 'hung' past its timeout and margin), how long the two
    honest ones took at most, and the claim-weighted mean of the three deltas."""
    k = next(_blocks)
    g = torch.Generator().manual_seed(k)
    deltas = [{"a": torch.randn(SIZE, generator=g)} for _ in members]
    members[0].prepare(k, deltas[0])
    members[1].prepare(k, deltas[1])
    with _third_averager_is(misbehaving):
        members[2].prepare(k, deltas[2])
    out: list[Any] = ["hung"] * 3
    done = [threading.Event() for _ in members]

    def run(i: int) -> None:
        try:
            out[i] = members[i].average(deltas[i], SAMPLES[i], k, 5, TIMEOUT_S, 100)
        except Exception as exc:  # reported to the test, which expects none
            out[i] = exc
        finally:
            done[i].set()

    start = time.monotonic()
    for i in range(3):  # daemon threads: a hung average() (the bug) fails the test instead of hanging it
        threading.Thread(target=run, args=(i,), daemon=True).start()
    for d in done:
        d.wait(max(0.0, start + TIMEOUT_S + MARGIN_S - time.monotonic()))
    took = time.monotonic() - start
    ref = {"a": torch.stack([d["a"] * s for d, s in zip(deltas, SAMPLES, strict=True)]).sum(0) / sum(SAMPLES)}
    return out, took, ref


def _assert_failed_for_the_honest(out: list[Any], took: float, ref: dict[str, torch.Tensor],
                                  caplog: pytest.LogCaptureFixture, why: str) -> None:
    """Both honest members returned None in time, and a member logged ``why`` (a regex): the group failed for the
    fault itself, not for another reason (no group formed, say)."""
    for i in (0, 1):
        o = out[i]
        wrong = (o.mean["a"] - ref["a"]).abs().max().item() if isinstance(o, GroupOutcome) else None
        assert o is None, f"honest member {i} got {o!r} (a group's mean {wrong} off the reference) instead of None"
    assert took <= TIMEOUT_S + MARGIN_S
    failures = [r.getMessage() for r in caplog.records if "group averaging failed" in r.getMessage()
                or "did not finish averaging" in r.getMessage()]
    assert len(failures) >= 2 and any(re.search(why, f) for f in failures), failures  # one saw the fault itself
    assert not any("could not find a group" in f for f in failures), failures


def _stalling() -> type:
    class BlockAverager(G.BlockAverager):  # type: ignore[name-defined,misc]  # hivemind's handles: the class name
        async def rpc_aggregate_part(self, stream: AsyncIterator[averaging_pb2.AveragingData],
                                     context: P2PContext) -> AsyncIterator[averaging_pb2.AveragingData]:
            await asyncio.sleep(10**6)  # takes the others' parts and never answers
            yield averaging_pb2.AveragingData(code=averaging_pb2.INTERNAL_ERROR)

    return BlockAverager


def _failing() -> type:
    class BlockAverager(G.BlockAverager):  # type: ignore[name-defined,misc]
        async def rpc_aggregate_part(self, stream: AsyncIterator[averaging_pb2.AveragingData],
                                     context: P2PContext) -> AsyncIterator[averaging_pb2.AveragingData]:
            yield averaging_pb2.AveragingData(code=averaging_pb2.INTERNAL_ERROR)  # its slice: the others keep their own

    return BlockAverager


def _weighing(weight: float) -> type:
    class BlockAverager(G.BlockAverager):  # type: ignore[name-defined,misc]
        async def _aggregate_with_group(self, group_info: Any, min_vector_size: int, **kwargs: Any) -> Any:
            kwargs["weight"] = weight  # what hivemind sends with each of its parts (step() refuses a negative one)
            return await super()._aggregate_with_group(group_info, min_vector_size, **kwargs)

    return BlockAverager


def _auxiliary() -> type:
    class BlockAverager(G.BlockAverager):  # type: ignore[name-defined,misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, auxiliary=True, **kwargs)

    return BlockAverager


@pytest.mark.timeout(60)
def test_an_honest_group_lands_on_the_claim_weighted_mean(group: list[GroupAverager]) -> None:
    """The checks below leave a group of honest members alone: every member gets the mean, one uploads it."""
    out, took, ref = _round(group, None)
    assert all(isinstance(o, GroupOutcome) for o in out), out
    assert sum(o.uploader for o in out) == 1 and took <= TIMEOUT_S + MARGIN_S
    for o in out:
        torch.testing.assert_close(o.mean["a"], ref["a"], rtol=0, atol=1e-5)


@pytest.mark.timeout(60)
def test_a_stalled_member_does_not_hang_the_others_past_their_timeout(group: list[GroupAverager],
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    """A member that takes its slice and never answers: hivemind waited for it unbounded (step's timeout bounds only
    matchmaking), and every member's average() with it hung (seen past 80 s with a 6 s timeout)."""
    out, took, ref = _round(group, _stalling())
    _assert_failed_for_the_honest(out, took, ref, caplog, r"came back unaveraged|did not finish averaging")


@pytest.mark.timeout(60)
def test_a_member_failing_its_slice_fails_the_group(group: list[GroupAverager],
                                                   caplog: pytest.LogCaptureFixture) -> None:
    """hivemind puts each member's own unaveraged values where a reducer failed, and logs only: the 'mean' was each
    member's own delta on that slice (n s_i / sum s times it, after the claim weighting)."""
    out, took, ref = _round(group, _failing())
    _assert_failed_for_the_honest(out, took, ref, caplog, r"came back unaveraged")


@pytest.mark.timeout(60)
def test_a_member_sending_another_weight_fails_the_group(group: list[GroupAverager],
                                                        caplog: pytest.LogCaptureFixture) -> None:
    """Members send s_i x Delta_i at weight 1; a reducer used each sender's own weight unchecked (5 here: its delta
    counted five times; -1 against 1 zeroes the denominator)."""
    out, took, ref = _round(group, _weighing(5.0))
    _assert_failed_for_the_honest(out, took, ref, caplog, r"weight was 5\.0")


@pytest.mark.timeout(60)
def test_a_member_declaring_itself_auxiliary_fails_the_group(group: list[GroupAverager],
                                                            caplog: pytest.LogCaptureFixture) -> None:
    """An auxiliary member helps reduce without a delta of its own: in no group of workers that each bring one."""
    out, took, ref = _round(group, _auxiliary())
    _assert_failed_for_the_honest(out, took, ref, caplog, r"auxiliary")


def test_the_averager_bounds_the_exchange_and_never_retries(group: list[GroupAverager]) -> None:
    """hivemind 1.1.x leaves the all-reduce and its chunks unbounded unless told; a retry after a failed all-reduce
    would average tensors it had already half updated in place with a new group."""
    members = group
    members[0].prepare(next(_blocks), {"a": torch.zeros(3)})
    averager = members[0]._averager
    assert averager is not None
    m = members[0].matchmaking_s
    sender, reducer = averager.allreduce_kwargs["sender_timeout"], averager.allreduce_kwargs["reducer_timeout"]
    assert averager._allreduce_timeout is not None and averager.next_chunk_timeout is not None
    assert m < sender < reducer <= averager._allreduce_timeout <= 10 * m


class _Control:
    """A StepControl whose group never finishes (a member stalls past any timeout hivemind keeps)."""

    def __init__(self) -> None:
        self.cancelled = threading.Event()

    def result(self, timeout: float | None = None) -> Any:
        if self.cancelled.wait(1e6 if timeout is None else timeout):
            raise RuntimeError("cancelled")
        raise TimeoutError

    def cancel(self) -> bool:
        self.cancelled.set()
        return True


class _Hung:
    """An averager whose step never ends; ``held``: its tensors' lock held (by an all-reduce it stopped waiting for)."""

    def __init__(self, held: bool) -> None:
        self.tensors = [torch.zeros(3)]
        self.lock_averaged_tensors = threading.Lock()
        if held:
            self.lock_averaged_tensors.acquire()
        self.control = _Control()
        self.steps: list[dict[str, Any]] = []

    @contextmanager
    def get_tensors(self) -> Iterator[list[torch.Tensor]]:
        with self.lock_averaged_tensors:
            yield self.tensors

    @contextmanager
    def tensors_within(self, timeout: float) -> Iterator[list[torch.Tensor]]:
        if not self.lock_averaged_tensors.acquire(timeout=timeout):
            raise TimeoutError("held")
        try:
            yield self.tensors
        finally:
            self.lock_averaged_tensors.release()

    def step(self, **kwargs: Any) -> Any:
        self.steps.append(kwargs)
        if kwargs.get("wait", True):
            self.control.result()  # never returns, as hivemind's step.result() with a stalled member
        return self.control


def _lone_averager(averager: _Hung) -> GroupAverager:
    groups = GroupAverager.__new__(GroupAverager)  # average()'s own logic only: no DHT
    groups.peer, groups.run, groups.matchmaking_s, groups.key, groups.token = "PeerA", "r1", 1.0, KEYS[1], b""
    groups._averager, groups._block = averager, 0  # type: ignore[assignment]
    return groups


def _timed_average(groups: GroupAverager, timeout: float) -> tuple[Any, float]:
    out: list[Any] = ["hung"]
    done = threading.Event()

    def run() -> None:
        try:
            out[0] = groups.average({"a": torch.ones(3)}, 1, 0, 5, timeout, 100)
        finally:
            done.set()

    start = time.monotonic()
    threading.Thread(target=run, daemon=True).start()
    done.wait(timeout + MARGIN_S)
    return out[0], time.monotonic() - start


@pytest.mark.timeout(30)
def test_average_returns_within_its_timeout_and_cancels_the_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever hivemind's own timeouts, average() gives up at its timeout: the step is cancelled, None returned (the
    worker uploads alone), and it was started without retries."""
    monkeypatch.setattr(G.Card, "make", staticmethod(lambda *a: G.Card(b"t", b"p")))
    averager = _Hung(held=False)
    out, took = _timed_average(_lone_averager(averager), 2.0)
    assert out is None and took < 2.0 + MARGIN_S
    assert averager.control.cancelled.is_set()
    assert [s.get("allow_retries") for s in averager.steps] == [False]


@pytest.mark.timeout(30)
def test_average_gives_up_on_tensors_a_stopped_all_reduce_still_holds(monkeypatch: pytest.MonkeyPatch) -> None:
    """A step average() stopped waiting for goes on in hivemind's process until its all-reduce timeout, holding the
    tensors' lock: the next round's average() waits for it no longer than its own timeout."""
    monkeypatch.setattr(G.Card, "make", staticmethod(lambda *a: G.Card(b"t", b"p")))
    averager = _Hung(held=True)
    out, took = _timed_average(_lone_averager(averager), 2.0)
    assert out is None and took < 2.0 + MARGIN_S and not averager.steps


@pytest.mark.timeout(30)
@pytest.mark.parametrize("poison", [float("nan"), float("inf"), None])
def test_a_mean_a_member_poisoned_with_nan_or_inf_is_not_used(monkeypatch: pytest.MonkeyPatch,
                                                               poison: float | None) -> None:
    """A member's NaN or inf made the group's mean one the coordinator refuses, counted against its honest uploader:
    average() now drops such a mean, and every member uploads alone."""
    from blocktrain.protocol.group import GroupMember

    class Finished(_Control):
        def result(self, timeout: float | None = None) -> Any:
            return {"PeerA": {}, "PeerB": {}}

    class Averaged(_Hung):
        def step(self, **kwargs: Any) -> Any:
            self.steps.append(kwargs)
            if poison is not None:
                self.tensors[0][1] = poison  # what the all-reduce left: another member's values in the mean
            return Finished()

    monkeypatch.setattr(G.Card, "make", staticmethod(lambda *a: G.Card(b"t", b"p")))
    groups = _lone_averager(Averaged(held=False))
    members = [GroupMember("PeerA", 1, "a", b"a"), GroupMember("PeerB", 1, "b", b"b")]
    monkeypatch.setattr(groups, "_members", lambda gathered, scope, each: members)
    out = groups.average({"a": torch.ones(3)}, 1, 0, 5, 5.0, 100)
    if poison is None:
        assert out is not None and torch.equal(out.mean["a"], torch.ones(3))  # (1/n) sum s_i Delta_i x n / sum s_i
    else:
        assert out is None


@pytest.mark.timeout(30)
def test_a_dht_that_never_answers_does_not_hang_the_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker's DHT gets and stores (who offers which version, who is ready) waited on hivemind's futures with no
    timeout: a wedged DHT process hung the worker, its heartbeat included. Each waits DHT_CALL_S now."""
    from concurrent.futures import Future

    class Wedged:
        peer_id = type("PeerID", (), {"to_bytes": lambda self: b"me"})()

        def get(self, *args: Any, **kwargs: Any) -> Future[Any]:
            assert kwargs.get("return_future")
            return Future()  # never resolved

        store = get

    monkeypatch.setattr(G, "DHT_CALL_S", 0.2)
    groups = GroupAverager.__new__(GroupAverager)
    groups.dht, groups.run = Wedged(), "r1"  # type: ignore[assignment]
    start = time.monotonic()
    assert groups.newest_shared(0) == -1.0 and groups.all_ready(0, 3)  # nobody else known: nobody to wait for
    groups.mark_ready(0, 3)
    assert time.monotonic() - start < 3 * 0.2 + MARGIN_S

    # a caller's deadline bounds each call too: a wait that started just before it went up to two calls past it
    monkeypatch.setattr(G, "DHT_CALL_S", 10.0)
    start = time.monotonic()
    deadline = start + 0.2
    assert groups.all_ready(0, 3, deadline) and groups.newest_shared(0, deadline) == -1.0
    groups.mark_ready(0, 3, deadline)
    assert time.monotonic() - start < 0.2 + 3 * 0.05 + MARGIN_S


def test_start_quietly_waits_for_the_process_a_bounded_time() -> None:
    class Process:
        def __init__(self) -> None:
            self.waited: list[float | None] = []

        def start(self) -> None:
            pass

        def wait_until_ready(self, timeout: float | None = None) -> None:
            self.waited.append(timeout)

    process = Process()
    G.start_quietly(process)
    assert len(process.waited) == 1 and process.waited[0] is not None and process.waited[0] > 0


@pytest.mark.parametrize("matchmaking_s", [float("inf"), float("nan"), 0.0, -1.0])
def test_worker_options_refuse_a_matchmaking_time_that_is_no_positive_finite_number(matchmaking_s: float) -> None:
    """inf passed ``not x > 0``: a group would wait for peers forever, and the exchange's timeouts derive from it."""
    with pytest.raises(ConfigError, match="matchmaking_s"):
        WorkerOptions(url="http://127.0.0.1:9", token="t", matchmaking_s=matchmaking_s)


def test_a_peers_state_stream_counts_every_byte_it_sends() -> None:
    """The state download counted only the metadata and the tensor buffers against its budget: parts with empty
    buffers and long shape lists cost nothing, and were all kept until the deadline. Every byte counts now."""
    from hivemind.proto import runtime_pb2

    from blocktrain.p2p.averager import BlockAverager, StateTooLargeError

    part = averaging_pb2.DownloadData(tensor_part=runtime_pb2.Tensor(size=[7] * 1000))  # no buffer, ~1 KB of shape
    sent = 0

    async def stream() -> AsyncIterator[averaging_pb2.DownloadData]:
        nonlocal sent
        for _ in range(10_000):
            sent += 1
            yield part

    class Stub:
        async def rpc_download_state(self, request: Any) -> AsyncIterator[averaging_pb2.DownloadData]:
            return stream()

    class Peer:  # what _read_state uses of its averager
        _p2p, prefix, serializer = None, "p", None

        def get_stub(self, *args: Any, **kwargs: Any) -> Stub:
            return Stub()

    with pytest.raises(StateTooLargeError):
        asyncio.run(BlockAverager._read_state(Peer(), "peer", 64 * 1024))  # type: ignore[arg-type]
    assert sent < 100  # refused within its budget, not at the stream's end


def test_the_averagers_rpc_handles_keep_their_released_names() -> None:
    """hivemind names a peer's RPC handles after the averager's class: renaming the class (to BlockAverager) renamed
    every handle, and peers of the two releases met in the DHT but never formed a group. The names are kept."""
    from blocktrain.p2p.averager import BlockAverager

    assert BlockAverager._get_handle_name("run.b0", "rpc_join_group") == "run.b0::_BlockAverager.rpc_join_group"
    assert BlockAverager._get_handle_name(None, "rpc_aggregate_part") == "_BlockAverager.rpc_aggregate_part"


def test_a_peers_copy_with_another_schema_under_the_same_old_digest_is_not_pulled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The version 1 digest had nothing to mark where a tensor's bytes end: an all-zero tensor folded into the next
    tensor's name gave a dict of other names with the block's sha256. A hostile peer served it, pull() took it, and
    loading it into the block raised a KeyError that ended the worker. The digest is one-to-one now, and pull() also
    checks the block's names and shapes before the digest."""
    from blocktrain import presets
    from blocktrain.checkpoint.safetensors_io import legacy_tensors_sha256, tensors_sha256
    from blocktrain.objectives import get_objective
    from blocktrain.protocol.weights import trainable_state

    honest = trainable_state(get_objective(presets.tiny()).build_block(0))
    names = sorted(honest)
    i = next(j for j, n in enumerate(names) if not honest[n].any() and j + 1 < len(names))
    a, b = names[i], names[i + 1]
    t = honest[a]
    merged = a + "\0" + str(t.dtype) + str(list(t.shape)).replace(",", ", ") + "\0" * (4 * t.numel()) + b
    forged = {n: w for n, w in honest.items() if n not in (a, b)} | {merged: honest[b]}
    assert legacy_tensors_sha256(forged) == legacy_tensors_sha256(honest)  # the old digest's collision
    assert tensors_sha256(forged) != tensors_sha256(honest)

    class Serving:  # what a peer streams through rpc_download_state
        def __init__(self, copy: dict[str, torch.Tensor], sha: str) -> None:
            self.copy, self.sha = copy, sha

        def pull_state(self, version: int, max_bytes: int, timeout: float) -> Any:
            ns = sorted(self.copy)
            return {"block": 0, "version": 0, "sha": self.sha, "names": ns}, [self.copy[n] for n in ns]

    groups = GroupAverager.__new__(GroupAverager)  # pull()'s own checks only: no DHT
    groups._block, groups._state_bytes, groups._schema = 0, 1 << 30, {n: tuple(w.shape) for n, w in honest.items()}
    groups.newest_shared = lambda k, deadline=None: 0.0  # type: ignore[method-assign]
    for sha in (tensors_sha256(honest), legacy_tensors_sha256(honest)):
        groups._averager = Serving(forged, sha)  # type: ignore[assignment]
        assert groups.pull(0, 0, sha, timeout=1.0) is None
    monkeypatch.setattr(G, "tensors_sha256", legacy_tensors_sha256)  # a digest that collides: the schema check alone
    groups._averager = Serving(forged, legacy_tensors_sha256(honest))  # type: ignore[assignment]
    assert groups.pull(0, 0, legacy_tensors_sha256(honest), timeout=1.0) is None
    monkeypatch.undo()
    groups._averager = Serving(honest, tensors_sha256(honest))  # type: ignore[assignment]
    got = groups.pull(0, 0, tensors_sha256(honest), timeout=1.0)
    assert got is not None and all(torch.equal(got[n], honest[n]) for n in honest)
