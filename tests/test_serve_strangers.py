"""What a stranger or a neighbour can send a stage, and what the stage does not let it do: stop its compute loop with
one frame, hold its connection slots, fail others' batches, or keep a released request's KV cache alive."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import socket
import struct
import time
from typing import Any, cast

import pytest
import torch

from blocktrain.config import Objective
from blocktrain.errors import ServeError, WireError
from blocktrain.model.stack import StackBlock
from blocktrain.presets import tiny
from blocktrain.sampling import sample_rows
from blocktrain.serve.client.pipeline import PipelineClient
from blocktrain.serve.runtime.kvcache import CacheEntry, KVCache
from blocktrain.serve.runtime.stack import StackSpan
from blocktrain.serve.wire.frames import ErrorCode, Frame, FrameKind, Mode, decode_body, encode, frame_number, frame_param
from tests.serve_sockets import TOKEN, SlowSpan, closed, connect, open_stage, recv_frame, score, wait_until, whole_span
from tests.serve_utils import tiny_models

MODELS = tiny_models(seed=3)


def test_a_silent_stranger_is_closed_after_the_read_timeout() -> None:
    """A connection that never says HELLO held one of the stage's slots for the whole idle timeout (300 s): 256 silent
    sockets every five minutes locked every client out. It gets the read timeout now."""
    with open_stage(whole_span(MODELS), token=TOKEN, idle_timeout_s=60.0, read_timeout_s=0.5) as st:
        with connect(st.address) as s:
            t0 = time.monotonic()
            assert closed(s, timeout_s=10) and time.monotonic() - t0 < 5
        assert asyncio.run(score(st.address, token=TOKEN)).shape == (1, 10, 256)  # a client that says HELLO idles on


def test_a_result_over_the_frame_cap_is_an_error_and_the_stage_serves_on() -> None:
    """A score whose logits exceed the stage's frame cap raised inside the compute loop, which died: every later
    request timed out while the stage still answered PINGs. The client now gets TOO_LARGE, and the next request is
    served."""
    cfg = MODELS[0]
    with open_stage(whole_span(MODELS), max_frame_bytes=1 << 20) as st:
        async def run() -> torch.Tensor:
            async with PipelineClient(st.address, timeout_s=10) as c:
                big = torch.zeros(64, cfg.model.context, dtype=torch.uint8)  # 64 x 32 x 256 fp32 logits: 2 MiB
                with pytest.raises(ServeError, match=r"too_large|exceeds"):
                    await c.score(big)
                return await c.score(torch.arange(10, dtype=torch.uint8).unsqueeze(0))

        assert asyncio.run(run()).shape == (1, 10, 256)


def test_a_long_tag_is_never_echoed() -> None:
    """A frame's ``tag`` was echoed whatever it held: 30,000 characters of é come back escaped three times longer,
    past the frame cap, and the stage's answer raised where nothing caught it. Only an int tag is echoed."""
    with open_stage(whole_span(MODELS)) as st, connect(st.address) as s:
        x = torch.zeros(1, 8, dtype=torch.uint8)
        data = encode(Frame(FrameKind.WORK, "r1", Mode.SCORE, 1, {"tag": 0}, {"x": x}))
        h_len, p_len = struct.unpack(">II", data[4:12])
        header = json.loads(data[12 : 12 + h_len])
        header["params"]["tag"] = "é" * 30000  # 60 KB as UTF-8, under the header cap; 180 KB once escaped
        raw = json.dumps(header, ensure_ascii=False).encode()
        s.sendall(data[:4] + struct.pack(">II", len(raw), p_len) + raw + data[12 + h_len :])
        got = recv_frame(s)
        assert got is not None and got.kind is FrameKind.ERROR and "tag" not in got.params, got  # refused, no echo
        assert asyncio.run(score(st.address)).shape == (1, 10, 256)


def test_headers_and_parameters_out_of_range_are_wire_errors() -> None:
    """A header number of 4,300+ digits (ValueError) or nested 100,000 deep (RecursionError) escaped decode_body; a
    seed of 2**63 failed a whole diffusion batch (struct.error in mix_seed); a tiny temperature sampled NaN."""
    for header in (b'{"v": 1, "kind": "ping", "n": ' + b"9" * 5000 + b"}", b"[" * 100_000):
        with pytest.raises(WireError):
            decode_body(header, b"")
    with pytest.raises(WireError, match="64-bit"):
        frame_param({"seed": 1 << 63}, "seed", int)
    assert frame_param({"seed": -(1 << 63)}, "seed", int) == -(1 << 63)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 256, generator=g)
    assert torch.equal(sample_rows(logits, 1e-300, 0, g), logits.argmax(-1))  # greedy in effect, not NaN
    with pytest.raises(WireError, match="finite"):  # JSON's NaN parses; a diffusion sweep reads it as a number now
        frame_number({"temperature": json.loads("NaN")}, "temperature", 0.0)


def test_a_release_during_a_step_is_not_undone_by_its_put() -> None:
    """RELEASE pops a request's cache on the event loop while the compute thread holds the entry it checked out; the
    step's put stored it again, and it stayed until the TTL. A put after a release is dropped; a request started
    again after its release is cached as before."""
    cache = KVCache(name="test")
    cache.put("r", CacheEntry(4))
    entry = cache.checkout("r", 4)
    assert cache.release("r")  # the client finished meanwhile
    entry.pos = 5
    cache.put("r", entry)
    assert "r" not in cache
    fresh = cache.checkout("r", 0)  # the same id started again after its release
    fresh.pos = 3
    cache.put("r", fresh)
    assert cache.positions("r") == 3


def test_a_step_still_queued_when_its_request_is_released_keeps_no_cache() -> None:
    """A RELEASE is handled at once, while a step of its request may still wait in a stage's compute queue (or be
    computed upstream): that step, a prefill at pos=0 checked out after the RELEASE, stored a fresh cache, which then
    stayed until the TTL and counted against every live request's room (helper-66). A RELEASE carries the newest step
    the entry had issued, and no step up to it keeps a cache; a step issued after it does."""
    cache = KVCache(name="test")
    assert not cache.release("r", seq=7)  # the client left; its step 7 is still queued here
    queued = cache.checkout("r", 0, seq=7)
    queued.pos = 5
    cache.put("r", queued)
    assert "r" not in cache and cache.nbytes() == 0
    later = cache.checkout("r", 0, seq=8)  # a step the entry issued after the RELEASE
    later.pos = 2
    cache.put("r", later)
    assert cache.positions("r") == 2


def test_a_client_that_stops_reading_holds_only_its_own_answer() -> None:
    """The compute loop sent each answer itself and waited for it to drain: a client that submits a large score and
    reads nothing held every other client's requests for the write timeout (30 s by default). Answers are sent in
    tasks of their own now; the other client is served at once."""
    cfg = MODELS[0]
    with open_stage(whole_span(MODELS), write_timeout_s=20.0) as st:
        slow = socket.socket()
        slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        slow.connect(st.address)
        try:
            x = torch.zeros(64, cfg.model.context, dtype=torch.uint8)  # 2 MiB of logits it never reads
            for i in range(4):
                slow.sendall(encode(Frame(FrameKind.SUBMIT, f"slow-{i}", Mode.SCORE, params={"seed": 0},
                                          tensors={"x": x})))
            time.sleep(0.5)  # its answers are computed and stuck in the socket
            t0 = time.monotonic()
            assert asyncio.run(score(st.address)).shape == (1, 10, 256)
            assert time.monotonic() - t0 < 5.0
        finally:
            slow.close()


def test_the_entry_holds_a_bounded_number_of_requests_per_connection_and_in_all() -> None:
    """Requests pending at the entry (their tensors kept for a retry) and frames queued from a connection were
    unbounded: one client could submit until the host ran out of memory. Past the caps a frame gets OVERLOADED."""
    from tests.serve_sockets import SlowSpan

    x = torch.zeros(1, 8, dtype=torch.uint8)

    def submit(s: socket.socket, rid: str) -> None:
        s.sendall(encode(Frame(FrameKind.SUBMIT, rid, Mode.SCORE, params={"seed": 0}, tensors={"x": x})))

    with open_stage(SlowSpan(whole_span(MODELS), delay_s=1.0), max_pending=2, max_pending_per_conn=1) as st, \
            connect(st.address) as a, connect(st.address) as b, connect(st.address) as c:
        submit(a, "a1")
        submit(a, "a2")  # a second of this connection while its first is pending
        got = recv_frame(a)
        assert got is not None and got.request_id == "a2" and got.code is ErrorCode.OVERLOADED, got
        submit(b, "b1")  # another connection: within the stage's cap
        time.sleep(0.2)
        submit(c, "c1")  # a third request: over the stage's cap of 2
        got = recv_frame(c)
        assert got is not None and got.request_id == "c1" and got.code is ErrorCode.OVERLOADED, got
        for s, rid in ((a, "a1"), (b, "b1")):
            got = recv_frame(s, timeout_s=10)
            assert got is not None and got.request_id == rid and got.kind is FrameKind.RESULT, got
        assert st.server.entry.pending_bytes == 0 and not st.server.entry.pending


class Poisoned:
    """Wraps a span; a batch holding a frame with the ``poison`` parameter raises (a bad frame nothing caught)."""

    def __init__(self, span: object) -> None:
        self.span = span

    def __getattr__(self, name: str) -> object:
        return getattr(self.span, name)

    def run(self, frames: list[Frame]) -> list[Frame]:
        if any("poison" in f.params for f in frames):
            raise RuntimeError("poisoned")
        return self.span.run(frames)  # type: ignore[attr-defined, no-any-return]


def test_one_bad_frame_fails_itself_not_its_batch_and_batches_are_bounded_in_rows() -> None:
    """Frames of different clients run in one batch: an exception in it failed them all. The batch runs again frame by
    frame, so only the bad one fails. And a batch holds at most --max-batch-rows sequences (16 frames of 64 rows ran
    as one batch of 1,024)."""
    x = torch.zeros(2, 8, dtype=torch.uint8)

    def submit(s: socket.socket, rid: str, **params: object) -> None:
        s.sendall(encode(Frame(FrameKind.SUBMIT, rid, Mode.SCORE, params={"seed": 0, **params}, tensors={"x": x})))

    with open_stage(Poisoned(whole_span(MODELS)), batch_window_s=0.5) as st, \
            connect(st.address) as a, connect(st.address) as b:
        submit(a, "bad", poison=1)
        submit(b, "good")
        bad, good = recv_frame(a, timeout_s=10), recv_frame(b, timeout_s=10)
        assert bad is not None and bad.code is ErrorCode.INTERNAL and "poisoned" in bad.error, bad
        assert good is not None and good.kind is FrameKind.RESULT, good
        assert st.server.counters.max_batch == 2  # they did run together first
    with open_stage(whole_span(MODELS), batch_window_s=0.5, max_batch_rows=3) as st, \
            connect(st.address) as a, connect(st.address) as b:
        submit(a, "a")
        submit(b, "b")
        assert all(f is not None and f.kind is FrameKind.RESULT for f in (recv_frame(a), recv_frame(b)))
        assert st.server.counters.max_batch == 1 and st.server.counters.batches == 2  # 2 + 2 rows > 3


def test_a_next_stage_that_hangs_up_on_a_frame_fails_it_after_a_few_resends() -> None:
    """A next stage that refuses a frame and closes (overloaded, its frame cap lower than ours) had the link resend it
    at once, again and again, until the request timed out. A frame is resent at most MAX_RESENDS times, with backoff,
    then failed: the client hears at once."""
    import socketserver
    import threading

    from blocktrain.serve.wire.links import MAX_RESENDS
    from tests.serve_utils import block_spans

    accepted: list[int] = []

    class HangsUp(socketserver.BaseRequestHandler):
        def handle(self) -> None:
            accepted.append(1)
            self.request.recv(65536)  # reads the frame, then closes without an answer

    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), HangsUp)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    cfg, blocks, _ = MODELS
    span = block_spans(cfg, blocks, [(0, 1)])[0]
    try:
        with open_stage(span, next_stages=(server.server_address,), backoff_s=0.05, retries=0,
                        request_timeout_s=30.0) as st:
            t0 = time.monotonic()
            with pytest.raises(ServeError, match="closed the connection"):
                asyncio.run(score(st.address))
            assert time.monotonic() - t0 < 10 and len(accepted) <= MAX_RESENDS + 2
    finally:
        server.shutdown()
        server.server_close()


def test_a_peer_with_too_many_answers_unread_is_dropped() -> None:
    """Answers are sent in tasks of their own, so a client that reads nothing could pin every result it asked for
    (up to the write timeout). Past a cap on the bytes waiting for one connection it is dropped."""
    cfg = MODELS[0]
    with open_stage(whole_span(MODELS), write_timeout_s=30.0, max_frame_bytes=2 << 20, conn_buffer_bytes=2 << 20,
                    buffer_bytes=(2 << 20) + 256 * (64 << 10)) as st:
        slow = socket.socket()
        slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        slow.connect(st.address)
        try:
            x = torch.zeros(32, cfg.model.context, dtype=torch.uint8)  # 1 MiB of logits each
            for i in range(32):  # 32 MiB of answers: over the cap of 18 MiB (the stage's buffer)
                slow.sendall(encode(Frame(FrameKind.SUBMIT, f"slow-{i}", Mode.SCORE, params={"seed": 0},
                                          tensors={"x": x})))
            wait_until(lambda: st.server.counters.writes_timed_out >= 1, timeout_s=20, what="the slow reader dropped")
            assert asyncio.run(score(st.address)).shape == (1, 10, 256)
        finally:
            slow.close()


def _stack_span() -> StackSpan:
    cfg = dataclasses.replace(tiny(), objective=Objective.STACK)
    torch.manual_seed(0)
    return StackSpan({k: StackBlock(cfg.model, k).eval() for k in range(cfg.model.n_blocks)}, cfg)  # random weights


def _ask(sock: socket.socket, frame: Frame) -> Frame:
    sock.sendall(encode(frame))
    got = recv_frame(sock)
    assert got is not None
    return got


def _ar(rid: str, text: bytes, pos: int) -> Frame:
    return Frame(FrameKind.SUBMIT, rid, Mode.AR, params={"pos": pos}, tensors={"x": torch.tensor([list(text)], dtype=torch.uint8)})


def test_a_client_cannot_touch_another_clients_kv_cache_by_sending_its_request_id() -> None:
    """Caches were keyed by the id a client chose: a second client sending the same id extended (and so corrupted)
    the first one's cache, or RELEASEd it. The entry now names each request by its connection too: the second client
    finds no cache of its own, its RELEASE drops nothing of the first's, and the first continues as a fresh prefill of
    its whole text would (fp32, tolerance 1e-5)."""
    with open_stage(_stack_span()) as st, connect(st.address) as a, connect(st.address) as b:
        first = _ask(a, _ar("shared", b"hello", 0))
        assert first.kind is FrameKind.RESULT and first.request_id == "shared"  # the client's own id comes back
        other = _ask(b, _ar("shared", b"!", 5))  # B continues "A's" request at A's position
        assert other.kind is FrameKind.ERROR and other.code is ErrorCode.UNKNOWN_REQUEST and other.request_id == "shared"
        assert "request shared has no KV cache" in other.error  # named by the client's own id, not the entry's
        b.sendall(encode(Frame(FrameKind.RELEASE, "shared", Mode.AR)))
        assert _ask(b, Frame(FrameKind.PING, "p")).kind is FrameKind.PONG  # B's release was handled before this
        went_on = _ask(a, _ar("shared", b"!", 5))
        assert went_on.kind is FrameKind.RESULT, went_on.error
        fresh = _ask(a, _ar("fresh", b"hello!", 0))
        assert (went_on.tensors["logits"] - fresh.tensors["logits"]).abs().max() <= 1e-5
        a.sendall(encode(Frame(FrameKind.RELEASE, "shared", Mode.AR)))
        wait_until(lambda: len(cast(StackSpan, st.server.span).cache) == 1, what="A's own release to drop its cache")  # "fresh" left


def test_a_client_cannot_answer_another_clients_request() -> None:
    """The entry delivered any RESULT frame naming a pending request id, whichever connection sent it: a client could
    answer another's request with logits of its own. Only the entry's own name for the request is taken now, which
    no client can derive; the forger is refused and the victim gets the stage's answer."""
    span = SlowSpan(_stack_span(), delay_s=1.0)  # type: ignore[arg-type]
    with open_stage(span) as st, connect(st.address) as victim, connect(st.address) as forger:
        x = torch.tensor([list(b"hello")], dtype=torch.uint8)
        victim.sendall(encode(Frame(FrameKind.SUBMIT, "v1", Mode.SCORE, params={"seed": 0}, tensors={"x": x})))
        wait_until(lambda: len(st.server.entry.pending) == 1, what="the victim's request to be pending")
        fake = Frame(FrameKind.RESULT, "v1", Mode.SCORE, 0, {}, {"logits": torch.zeros(1, 5, 256)})
        refused = _ask(forger, fake)
        assert refused.kind is FrameKind.ERROR and refused.code is ErrorCode.UNKNOWN_REQUEST
        got = recv_frame(victim)
        assert got is not None and got.kind is FrameKind.RESULT and got.request_id == "v1"
        want = span.span.run([Frame(FrameKind.SUBMIT, "ref", Mode.SCORE, params={"seed": 0}, tensors={"x": x})])[0]
        assert torch.equal(got.tensors["logits"], want.tensors["logits"])  # the stage's answer, not the forger's


def test_a_release_is_passed_on_bare() -> None:
    """A middle stage passed a RELEASE on whole, tensors included, into its link's unbounded queue once the frame
    had left the byte budget: RELEASEs of 4 MiB each piled up while the budget read 0. Only its id, its mode and the
    entry's newest step number go on."""
    from blocktrain.serve.stage.custody import Router
    from blocktrain.serve.stage.entry import Entry
    from blocktrain.serve.stage.options import StageOptions

    class Middle:  # holds block 1 of 4: neither the entry nor the last stage
        is_last = False

        def __init__(self) -> None:
            self.released: list[tuple[str, int | None]] = []

        def holds(self, k: int) -> bool:
            return k == 1

        def release(self, rid: str, seq: int | None = None) -> bool:
            self.released.append((rid, seq))
            return False

    class Link:
        def __init__(self) -> None:
            self.sent: list[Frame] = []

        def send(self, frame: Frame, custody: bool = True) -> int:
            self.sent.append(frame)
            return 0

    span, link = Middle(), Link()
    entry = Entry(span, StageOptions(), "mid", lambda item: None, lambda coro: None)  # type: ignore[arg-type]
    router = Router(span, entry, "mid", lambda item: None, lambda coro: None, dict)  # type: ignore[arg-type]
    router.link = link  # type: ignore[assignment]
    big = Frame(FrameKind.RELEASE, "abc", Mode.AR, params={"pad": "x" * 1000, "seq": 7},
                tensors={"t": torch.zeros(1 << 20)})
    asyncio.run(router.on_frame(big, None))  # type: ignore[arg-type]
    (sent,) = link.sent
    assert (sent.kind, sent.request_id, sent.mode, sent.params, sent.tensors) == (
        FrameKind.RELEASE, "abc", Mode.AR, {"seq": 7}, {})
    assert span.released == [("abc", 7)]  # a middle stage releases the id it was given (the entry's name)

    class First(Middle):  # the entry: holds block 0
        def holds(self, k: int) -> bool:
            return k == 0

    class Client:  # a connection (the entry names its requests per connection)
        pass

    span, link, conn = First(), Link(), Client()
    entry = Entry(span, StageOptions(), "entry", lambda item: None, lambda coro: None)  # type: ignore[arg-type]
    router = Router(span, entry, "entry", lambda item: None, lambda coro: None, dict)  # type: ignore[arg-type]
    router.link = link  # type: ignore[assignment]
    entry.last_seq = 12  # steps issued so far; a client's own "seq" is not the entry's
    asyncio.run(router.on_frame(Frame(FrameKind.RELEASE, "mine", Mode.AR, params={"seq": 10**9}), conn))  # type: ignore[arg-type]
    (sent,) = link.sent
    assert sent.request_id == entry.inner(conn, "mine") and sent.params == {"seq": 12}  # type: ignore[arg-type]
    assert span.released == [(entry.inner(conn, "mine"), 12)]  # type: ignore[arg-type]


def test_an_upstream_peer_that_reads_nothing_holds_up_no_other_frame_coming_back() -> None:
    """The link's reader sent each ACK, ERROR or RESULT upstream itself: one upstream peer that stopped reading held
    every frame coming back through the link for the write timeout (30 s), an honest peer's ACK among them. Those
    sends go in tasks of their own now."""
    from blocktrain.serve.stage.custody import Router
    from blocktrain.serve.stage.entry import Entry
    from blocktrain.serve.stage.options import StageOptions

    class Origin:  # an upstream connection
        def __init__(self, stuck: bool) -> None:
            self.stuck = stuck
            self.got: list[Frame] = []

        async def send(self, frame: Frame) -> bool:
            if self.stuck:
                await asyncio.Event().wait()  # never read: the write waits
            self.got.append(frame)
            return True

    class Link:
        def release(self, tag: int) -> Frame:
            return Frame(FrameKind.WORK, "x", Mode.SCORE)

    class Middle:
        is_last = False

        def holds(self, k: int) -> bool:
            return k == 1

    async def run() -> list[Frame]:
        tasks: list[asyncio.Task[None]] = []
        span = Middle()
        entry = Entry(span, StageOptions(), "mid", lambda item: None, lambda coro: None)  # type: ignore[arg-type]
        router = Router(span, entry, "mid", lambda item: None, lambda c: tasks.append(asyncio.ensure_future(c)),  # type: ignore[arg-type, func-returns-value]
                        dict)
        router.link = Link()  # type: ignore[assignment]
        slow, honest = Origin(stuck=True), Origin(stuck=False)
        router.upstream = {1: (slow, 11, 0.0), 2: (honest, 22, 0.0)}  # type: ignore[dict-item]
        await asyncio.wait_for(router.from_downstream(Frame(FrameKind.ACK, "a", params={"tag": 1})), 1.0)
        await asyncio.wait_for(router.from_downstream(Frame(FrameKind.ACK, "b", params={"tag": 2})), 1.0)
        await asyncio.sleep(0.05)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return honest.got

    got = asyncio.run(run())
    assert [(f.kind, f.request_id, f.params) for f in got] == [(FrameKind.ACK, "b", {"tag": 22})]


def test_a_later_stages_error_names_the_clients_own_id() -> None:
    """The stages after the entry know a request by the entry's name for it, and their error messages say that name;
    the client gets the error under its own id, and the message names that id too."""
    from blocktrain.serve.stage.entry import Entry
    from blocktrain.serve.stage.options import StageOptions

    class Whole:  # the entry: holds index 0, takes any frame
        def holds(self, k: int) -> bool:
            return True

        def validate(self, frame: Frame) -> None:
            pass

    class Client:
        def __init__(self) -> None:
            self.got: list[Frame] = []

        async def send(self, frame: Frame) -> bool:
            self.got.append(frame)
            return True

    async def run() -> list[Frame]:
        answers: list[Any] = []
        entry = Entry(Whole(), StageOptions(retries=0), "entry", lambda item: None, answers.append)  # type: ignore[arg-type]
        client = Client()
        await entry.submit(Frame(FrameKind.SUBMIT, "mine", Mode.SCORE, tensors={"x": torch.zeros(1, 4, dtype=torch.uint8)}),
                           client)  # type: ignore[arg-type]
        (name,) = entry.pending
        err = Frame(FrameKind.ERROR, name, Mode.SCORE, code=ErrorCode.UNKNOWN_REQUEST,
                    error=f"request {name} has no KV cache at stack[2-3]")
        await entry.fail_or_retry(name, err, entry.pending[name].seq)  # an error of the pending attempt
        entry.stop()
        for coro in answers:
            await coro
        return client.got

    (got,) = asyncio.run(run())
    assert got.request_id == "mine" and got.error == "request mine has no KV cache at stack[2-3]"


def test_calls_are_sized_by_the_smaller_frame_cap_of_client_and_entry_stage() -> None:
    """A gateway sized its score calls (and windowed spec's drafts) by its own 64 MiB frame cap: behind stages run with
    --max-frame-mib 16 a call of several windows made a frame the link could not send, and every log-probs request
    was a 503 where one window a call would have fit (helper-66). The entry stage reports its cap in its PONG, and
    calls are sized by the smaller of the two."""
    from blocktrain.serve.client.stage_info import StageInfo
    from blocktrain.serve.gateway.logprobs import windows_per_call

    with open_stage(whole_span(MODELS), max_frame_bytes=3 << 20) as st:
        async def described() -> StageInfo:
            async with PipelineClient(st.address, timeout_s=10) as c:
                return c.stage

        stage = asyncio.run(described())
    assert stage.max_frame_bytes == 3 << 20
    assert stage.frame_cap(64 << 20) == 3 << 20 and stage.frame_cap(1 << 20) == 1 << 20
    assert dataclasses.replace(stage, max_frame_bytes=0).frame_cap(64 << 20) == 64 << 20  # an older stage: own cap
    context, d = 1024, 2048  # a window's rows: 1024 x 2048 float32 = 8 MiB in a half frame of 32 MiB (4 windows)
    assert windows_per_call(context, d, stage.frame_cap(64 << 20)) < windows_per_call(context, d, 64 << 20)
    with pytest.raises(WireError):  # a stage's report is checked like any of its fields
        StageInfo.from_pong({"max_frame_bytes": "big"})
