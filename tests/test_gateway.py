"""The OpenAI-style gateway: the openai client against a loopback pipeline, errors, tokens, UTF-8 across chunks."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from typing import Any, cast

import httpx
import openai
import pytest
import torch
import uvicorn
from openai.types.chat import ChatCompletionMessageParam
from starlette.testclient import TestClient

from blocktrain.cli.main import main
from blocktrain.config import Objective
from blocktrain.errors import ServeError
from blocktrain.evaluate.generate import generate
from blocktrain.model.stack import StackBlock
from blocktrain.presets import tiny
from blocktrain.serve.client.decoding import Sampling, decode
from blocktrain.serve.client.pipeline import PipelineClient
from blocktrain.serve.client.stage_info import StageInfo
from blocktrain.serve.gateway import app as gateway_mod
from blocktrain.serve.gateway.app import GatewayOptions, make_app
from blocktrain.serve.gateway.generation import max_tokens_of, sampling_of
from blocktrain.serve.gateway.protocol import CompletionRequest
from blocktrain.serve.gateway.serving import Utf8Stream
from blocktrain.serve.runtime.stack import StackSpan
from blocktrain.serve.wire.frames import Frame, Mode
from blocktrain.serve.wire.modes import MODE_RULES
from tests.serve_utils import SPANS, block_spans, extras, free_ports, local_models, ring, tiny_models

TEXT = "añ€😀 ok"  # 1-, 2-, 3- and 4-byte characters


@contextmanager
def serve_app(opts: GatewayOptions, client: Any = None) -> Iterator[str]:
    """Run the gateway app with uvicorn on loopback in a thread; yields its base URL."""
    port = free_ports(1)[0]
    server = uvicorn.Server(uvicorn.Config(make_app(opts, client), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the gateway did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(20)


class FakeClient:
    """Stands in for PipelineClient: an entry stage's description, and every mode decoding to the same fixed chunks."""

    def __init__(self, chunks: list[bytes], *, context: int = 64, delays_s: tuple[float, ...] = (),
                 family: str = "diffusion", modes: tuple[str, ...] = ("ar", "sweep", "spec")) -> None:
        self.chunks = chunks
        self.family = family
        self.modes = modes  # what the entry stage reports it runs (a diffusion run's by default)
        self.context = context
        self.delays_s = delays_s  # seconds before each chunk (none: no wait)
        self.calls: list[tuple[bytes, int, Sampling]] = []
        self.score_seeds: list[int] = []  # the seed of every score call
        self.max_frame_bytes = 64 << 20  # the frame cap the gateway sizes its score calls by

    connects = 0  # what Gateway.stage reads of a PipelineClient's connects: this one never fails

    def failed_since(self, seen: int) -> None:
        return None

    async def connect(self) -> None:
        self.stage = StageInfo(family=self.family, n=4, d_model=32, context=self.context, cached=False, state="serving",
                               modes=tuple(Mode(m) for m in self.modes))

    async def close(self) -> None:
        pass

    async def score(self, x: torch.Tensor, seed: int = 0) -> torch.Tensor:
        self.score_seeds.append(seed)
        return torch.zeros(*x.shape, 256)  # (b, t, 256): every byte equally likely

    async def decode(self, mode: Mode, prompt: bytes, n_new: int, sampling: Sampling, stats: Any = None
                     ) -> AsyncIterator[bytes]:
        self.calls.append((prompt, n_new, sampling))
        for i, c in enumerate(self.chunks):
            await asyncio.sleep(self.delays_s[i] if i < len(self.delays_s) else 0.0)
            yield c


def opts(**kw: Any) -> GatewayOptions:
    return GatewayOptions(pipeline="127.0.0.1:1", **kw)


# --- UTF-8 across chunks ----------------------------------------------------------------------------------
def test_utf8_stream_keeps_characters_split_across_chunks() -> None:
    data = TEXT.encode()
    for size in range(1, 5):  # every way of cutting the bytes into chunks of `size`
        for start in range(size):
            pieces = [data[:start]] + [data[i : i + size] for i in range(start, len(data), size)]
            dec = Utf8Stream()
            assert "".join(dec.feed(p) for p in pieces) + dec.finish() == TEXT
    dec = Utf8Stream()
    assert dec.feed(b"a\xe2\x82") == "a"  # the euro sign's third byte has not come yet
    assert dec.feed(b"\xac") == "€"


def test_utf8_stream_replaces_invalid_bytes() -> None:
    dec = Utf8Stream()
    assert dec.feed(b"x\xff") == "x\ufffd"
    assert dec.feed(b"\xe2\x82") == ""
    assert dec.feed(b"y") == "\ufffdy"  # a broken sequence is replaced once the next byte shows it broken
    assert dec.feed(b"\xf0\x9f") == ""
    assert dec.finish() == "\ufffd"  # an incomplete character at the end


# --- request validation -----------------------------------------------------------------------------------
def refusal_of(body: dict[str, Any], path: str = "/v1/completions", **kw: Any) -> tuple[int, dict[str, Any]]:
    """The status and error a gateway (in process, a FakeClient's pipeline, max_tokens_cap 64) answers ``body`` with."""
    fake = cast(PipelineClient, FakeClient([b"abc"], **kw))  # a stand-in with what the gateway calls
    client = TestClient(make_app(opts(max_tokens_cap=64), fake))
    r = client.post(path, json=body)
    return r.status_code, r.json().get("error", {})


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": "a", "mode": "beam"}, "mode"),
    ({"prompt": "a", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "a", "max_tokens": 65}, "max_tokens"),
    ({"prompt": "a", "max_tokens": 2.5}, "max_tokens"),
    ({"prompt": "a", "temperature": -0.1}, "temperature"),
    ({"prompt": "a", "top_p": 0}, "top_p"),
    ({"prompt": "a", "top_p": 1.5}, "top_p"),
    ({"prompt": [65, 256]}, "prompt"),
    ({"prompt": 7}, "prompt"),
    ({"prompt": "a", "top_k": -2}, "top_k"),
    ({"prompt": "a", "seed": -1}, "seed"),
    ({"prompt": "a", "n": 9}, "n"),
    ({"prompt": "a", "stop": [""]}, "stop"),
    ({"prompt": "a", "stream": "yes"}, "stream"),
    ({"prompt": "a", "sweeps": 2, "mode": "ar"}, "sweeps"),
    ({"prompt": "a", "max_tokens": "5"}, "max_tokens"),  # strict: a string is not a number
    ({"prompt": "a", "stream": 1}, "stream"),  # nor a number a flag
    ({"prompt": "a", "best_of": 2}, "best_of"),  # taken at its neutral value only
    ({"prompt": "a" * 20000, "logprobs": 20, "n": 8, "echo": True, "max_tokens": 1}, "logprobs"),  # 3.4M log-probs
])
def test_bad_parameters_are_a_400_naming_them(body: dict[str, Any], param: str) -> None:
    status, err = refusal_of(body)
    assert (status, err["param"]) == (400, param), err
    assert err["message"].startswith(param) and err["code"] in ("invalid_value", "invalid_type", "unsupported_parameter")


def test_request_defaults() -> None:
    req = CompletionRequest.model_validate({"prompt": ["é"], "seed": 3, "temperature": None})  # null: the default
    s = sampling_of(req)
    assert (req.prompt, max_tokens_of(req, 64), req.mode, s.temperature, s.top_p, s.top_k, s.seed, req.stream) == (
        "é".encode(), 16, None, 0.8, 1.0, 40, 3, False)  # mode None: the pipeline's default
    assert sampling_of(CompletionRequest.model_validate({"prompt": "a", "top_k": -1})).top_k == 0


# --- HTTP: errors, token, streaming with a fake pipeline -------------------------------------------------
def test_http_errors_have_the_openai_shape() -> None:
    fake = FakeClient([b"abc"], context=16)
    with serve_app(opts(max_tokens_cap=8, max_body_bytes=2048), fake) as url, httpx.Client(base_url=url) as http:
        cases = [
            ({"prompt": "a", "mode": "beam"}, 400, "mode"),
            ({"prompt": "a", "max_tokens": 9}, 400, "max_tokens"),
            ({"prompt": "a", "temperature": -1}, 400, "temperature"),
            ({"prompt": "a", "top_p": 1.01}, 400, "top_p"),
            ({"prompt": [1, 999]}, 400, "prompt"),  # token ids are bytes
            ({"prompt": "x" * 17, "mode": "sweep", "max_tokens": 1}, 400, "prompt"),  # longer than the context of 16
            ({"prompt": "x" * 12, "mode": "sweep", "max_tokens": 5}, 400, "max_tokens"),  # 12 + 5 > 16
            ({"prompt": "a", "mode": "ar", "model": "gpt-4"}, 404, "model"),
            ({"prompt": "a", "mode": "baseline"}, 400, "mode"),  # nor run the E2E baseline
            ({"prompt": "a", "draft_min": 2}, 400, "draft_min"),  # the default here is ar: no draft
            ({"prompt": "a", "mode": "spec", "draft_min": 3, "draft_max": 2}, 400, "draft_max"),
            ({"prompt": "a", "mode": "spec", "draft_max": 65}, 400, "draft_max"),
            ({"prompt": "a", "mode": "sweep", "top_p": 0.9}, 400, "top_p"),  # sweep samples without top_p
        ]
        for body, status, param in cases:
            r = http.post("/v1/completions", json=body)
            err = r.json()["error"]
            assert (r.status_code, err["param"]) == (status, param), (body, r.text)
            assert set(err) == {"message", "type", "param", "code"} and err["message"]
            assert err["type"] == ("invalid_request_error" if status < 500 else "server_error")
        r = http.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
        assert (r.status_code, r.json()["error"]["code"]) == (400, "invalid_json")
        r = http.post("/v1/completions", json={"prompt": "x" * 3000})
        assert (r.status_code, r.json()["error"]["code"]) == (413, "request_too_large")
        r = http.get("/v1/nothing")
        assert (r.status_code, r.json()["error"]["code"]) == (404, "not_found")
        r = http.post("/v1/completions", json={"prompt": "a", "model": "diffusion-n4-d32-ctx16"})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "abc"
        assert r.json()["blocktrain"]["mode"] == "ar"  # the default on diffusion blocks
    assert len(fake.calls) == 1  # no refused request reached the pipeline


def test_openapi_schema_declares_every_answer() -> None:
    """Every route declares its answer's model and the error model; the streaming routes also name their chunk
    model; every model a route names is in components/schemas."""
    schema = make_app(opts()).openapi()
    models = schema["components"]["schemas"]
    assert {"ErrorResponse", "CompletionChunk", "ChatCompletionChunk"} <= set(models)

    def model_of(content: dict[str, Any], media: str = "application/json") -> str:
        ref = content[media]["schema"]["$ref"]
        assert ref.startswith("#/components/schemas/") and ref.rsplit("/", 1)[1] in models, ref
        return str(ref.rsplit("/", 1)[1])

    routes = {(method.upper(), path): op for path, ops in schema["paths"].items() for method, op in ops.items()}
    assert set(routes) == {("GET", "/v1/models"), ("GET", "/v1/models/{name}"), ("POST", "/v1/completions"),
                           ("POST", "/v1/chat/completions"), ("POST", "/tokenize"), ("POST", "/detokenize"),
                           ("GET", "/tokenizer_info")}
    for (method, path), op in routes.items():
        assert model_of(op["responses"]["200"]["content"]), (method, path)
        assert {model_of(op["responses"][s]["content"]) for s in ("4XX", "5XX")} == {"ErrorResponse"}
        assert "422" not in op["responses"]  # a bad body is a 400 with the error model
        if method == "POST":
            assert model_of(op["requestBody"]["content"]).endswith("Request")
    assert model_of(routes["POST", "/v1/completions"]["responses"]["200"]["content"], "text/event-stream") == \
        "CompletionChunk"
    assert model_of(routes["POST", "/v1/chat/completions"]["responses"]["200"]["content"], "text/event-stream") == \
        "ChatCompletionChunk"


def test_hostile_numbers_and_nesting_get_a_400_never_a_500() -> None:
    """Numbers of hundreds or thousands of digits, 1e400, deep nesting: all 400 with the OpenAI error shape."""
    fake = FakeClient([b"abc"], context=16)
    with serve_app(opts(max_tokens_cap=8, max_body_bytes=300_000), fake) as url, httpx.Client(base_url=url) as http:
        bodies = [
            b'{"prompt": "a", "temperature": 1' + b"0" * 400 + b"}",  # an int beyond float range
            b'{"prompt": "a", "max_tokens": 1' + b"0" * 400 + b"}",
            b'{"prompt": "a", "seed": 1' + b"0" * 5000 + b"}",  # past Python's int digit limit
            b'{"prompt": "a", "temperature": 1e400}',  # parses to inf
            b'{"prompt": "a", "top_k": ' + b"9" * 300 + b"}",
            b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",  # nested far past the recursion limit
        ]
        for body in bodies:
            r = http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
            assert r.status_code == 400, (body[:60], r.status_code, r.text[:200])
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}
            assert len(r.json()["error"]["message"]) < 500  # the value is not echoed back in full
    assert fake.calls == []


def test_tiny_temperatures_sample_greedily_and_huge_top_k_keeps_every_byte() -> None:
    def sampling(**kw: Any) -> Sampling:
        return sampling_of(CompletionRequest.model_validate({"prompt": "a", **kw}))

    assert sampling(temperature=1e-300).temperature == 0.0  # greedy, instead of logits / 1e-300 overflowing to inf and nan
    assert sampling(temperature=0.5).temperature == 0.5
    assert sampling(top_k=10_000).top_k == 0  # >= 256 bytes: off


def test_modes_the_pipeline_does_not_report_are_refused() -> None:
    fake = FakeClient([b"xy"], family="stack", modes=("spec", "ar", "score"))
    with serve_app(opts(), fake) as url, httpx.Client(base_url=url) as http:
        r = http.post("/v1/completions", json={"prompt": "a"})  # spec: the default on a stack run
        assert r.status_code == 200 and r.json()["blocktrain"]["mode"] == "spec"
        r = http.post("/v1/completions", json={"prompt": "a", "mode": "sweep"})
        assert (r.status_code, r.json()["error"]["code"]) == (400, "unsupported_mode")
        assert http.post("/v1/completions", json={"prompt": "a", "mode": "ar"}).json()["choices"][0]["text"] == "xy"
        assert http.get("/v1/models").json()["data"][0]["modes"] == ["spec", "ar"]
    assert len(fake.calls) == 2


class FrameSentError(Exception):
    """A frame reached the pipeline."""


class FirstFrame:
    """A Traversal to a pipeline running every mode: records the mode of the first frame a loop sends, then stops."""

    def __init__(self) -> None:
        self.stage = StageInfo(family="any", n=4, d_model=32, context=32, modes=tuple(MODE_RULES), cached=True,
                               state="serving")
        self.max_frame_bytes = 1 << 20
        self.modes: list[Mode | None] = []

    def new_id(self) -> str:
        return "r"

    async def call(self, frame: Frame) -> Frame:
        self.modes.append(frame.mode)
        raise FrameSentError

    async def release(self, request_id: str, mode: Mode) -> None:
        pass


def test_gateway_and_client_read_one_table_of_mode_rules() -> None:
    """For every mode, the gateway and the client's dispatcher (decode) agree with MODE_RULES on top_p, and the
    gateway refuses a text of three windows exactly in the modes that do not slide."""
    modes = tuple(m.value for m in MODE_RULES)
    for mode, rules in MODE_RULES.items():
        status, err = refusal_of({"prompt": "a", "mode": mode.value, "top_p": 0.5}, modes=modes)
        assert status == 200 or err["param"] == "top_p", err
        t = FirstFrame()
        try:
            asyncio.run(anext(decode(mode, t, b"a", 2, Sampling(top_p=0.5))))  # type: ignore[arg-type]
        except FrameSentError:
            pass
        except ServeError:
            assert not t.modes
        assert (status == 200) == (t.modes == [mode]) == rules.top_p, mode
        status, err = refusal_of({"prompt": "a" * 40, "mode": mode.value, "max_tokens": 56}, modes=modes, context=32)
        assert status == 200 or err["code"] == "context_length_exceeded", err
        assert (status == 200) == rules.slides, mode
    assert [m for m, r in MODE_RULES.items() if not r.slides] == [Mode.SWEEP]  # spec, ar and baseline slide


def test_bearer_token_is_checked_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    compared: list[tuple[bytes, bytes]] = []
    real = gateway_mod.hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr(gateway_mod.hmac, "compare_digest", spy)
    with serve_app(opts(token="s3cret"), FakeClient([b"hi"])) as url, httpx.Client(base_url=url) as http:
        body = {"prompt": "a", "mode": "ar"}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic s3cret"}):
            r = http.post("/v1/completions", json=body, headers=headers)
            assert (r.status_code, r.json()["error"]["type"]) == (401, "authentication_error")
            assert r.headers["www-authenticate"] == "Bearer"
        assert http.get("/v1/models").status_code == 401
        assert http.post("/v1/completions", json=body, headers={"Authorization": "Bearer s3cret"}).status_code == 200
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0, timeout=20)
        with pytest.raises(openai.AuthenticationError):
            client.models.list()
        good = openai.OpenAI(base_url=f"{url}/v1", api_key="s3cret", max_retries=0, timeout=20)
        assert [m.id for m in good.models.list()] == ["diffusion-n4-d32-ctx64"]
    assert (b"wrong", b"s3cret") in compared and (b"s3cret", b"s3cret") in compared


def test_logprobs_score_with_the_requests_seed_else_evals() -> None:
    """A diffusion chain's scores depend on its draw: log-probs are scored at the request's seed, or at 0 (``blocktrain
    eval``'s) when it names none, so the same text scores the same twice (a random seed was drawn per request)."""
    fake = FakeClient([b"ok"])
    with serve_app(opts(), fake) as url, httpx.Client(base_url=url, timeout=20) as http:
        for seed in (None, None, 5):
            body = {"prompt": "hello", "max_tokens": 2, "logprobs": 1, "echo": True, "mode": "ar",
                    **({} if seed is None else {"seed": seed})}
            assert http.post("/v1/completions", json=body).status_code == 200
    assert fake.score_seeds and set(fake.score_seeds[:-1]) == {0} and fake.score_seeds[-1] == 5
    assert fake.calls[0][2].seed != fake.calls[1][2].seed  # the samplings still draw their own


def test_stream_keeps_characters_split_across_chunks() -> None:
    data = TEXT.encode() + b"\xff!"
    chunks = [data[:2], data[2:4], data[4:7], data[7:9], data[9:]]  # ñ, € and 😀 each cut in two
    fake = FakeClient(chunks)
    with serve_app(opts(), fake) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=20)
        events = list(client.completions.create(model="diffusion-n4-d32-ctx64", prompt="p", max_tokens=len(data),
                                                stream=True, seed=5, extra_body={"mode": "ar", "top_k": 7},
                                                stream_options={"include_usage": True}))
    texts = [e.choices[0].text for e in events if e.choices]
    assert "".join(texts) == TEXT + "\ufffd!"  # only the invalid byte is replaced
    assert texts == ["a", "ñ", "€", "", "😀 ok\ufffd!", ""]  # a character is sent once all its bytes came
    raw = b"".join(base64.b64decode(extras(e.choices[0])["raw_bytes"]) for e in events if e.choices)
    assert raw == data
    assert [e.choices[0].finish_reason for e in events if e.choices][-1] == "length"
    assert extras(events[-2])["blocktrain"] == {"mode": "ar", "seed": 5}
    assert events[-1].usage is not None and events[-1].choices == []
    assert (events[-1].usage.prompt_tokens, events[-1].usage.completion_tokens) == (1, len(data))
    assert fake.calls == [(b"p", len(data), Sampling(temperature=0.8, top_k=7, seed=5))]


def test_chat_completions_with_the_openai_client() -> None:
    """``/v1/chat/completions``: the transcript prompt, a chat-shaped answer, and chat chunks when streaming."""
    data = TEXT.encode()
    fake = FakeClient([data[:3], data[3:]])
    messages: list[ChatCompletionMessageParam] = [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    with serve_app(opts(), fake) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=20)
        done = client.chat.completions.create(model="diffusion-n4-d32-ctx64", messages=messages,
                                              max_tokens=len(data), seed=2, extra_body={"mode": "ar"})
        assert done.object == "chat.completion" and done.id.startswith("chatcmpl-")
        assert done.choices[0].message.role == "assistant" and done.choices[0].message.content == TEXT
        assert done.choices[0].finish_reason == "length" and done.usage is not None
        events = list(client.chat.completions.create(model="diffusion-n4-d32-ctx64", messages=messages,
                                                     max_completion_tokens=len(data), seed=2, stream=True,
                                                     extra_body={"mode": "ar"}))
        assert all(e.object == "chat.completion.chunk" for e in events)
        assert events[0].choices[0].delta.role == "assistant"
        assert "".join(e.choices[0].delta.content or "" for e in events if e.choices) == TEXT
        assert events[-1].choices[0].finish_reason == "length"
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model="diffusion-n4-d32-ctx64", messages=[])
        with pytest.raises(openai.BadRequestError):  # "wizard" is no role: a request the types refuse, on purpose
            client.chat.completions.create(model="diffusion-n4-d32-ctx64",
                                           messages=[{"role": "wizard", "content": "x"}])  # type: ignore[list-item, misc]
    prompt = b"System: Be brief.\nUser: Hi\nAssistant:"
    assert [c[0] for c in fake.calls] == [prompt, prompt]


def test_unreachable_pipeline_is_a_503() -> None:
    dead = f"127.0.0.1:{free_ports(1)[0]}"  # nothing listens there
    with serve_app(GatewayOptions(pipeline=dead)) as url, httpx.Client(base_url=url, timeout=30) as http:
        for r in (http.get("/v1/models"), http.post("/v1/completions", json={"prompt": "a"})):
            err = r.json()["error"]
            assert (r.status_code, err["type"], err["code"]) == (503, "server_error", "pipeline_unavailable")
            assert dead in err["message"]


def test_request_time_is_bounded() -> None:
    fake = FakeClient([b"a", b"b"], delays_s=(0.0, 30.0))  # the second chunk would come after 30 s
    with serve_app(opts(request_timeout_s=1.5), fake) as url, httpx.Client(base_url=url, timeout=20) as http:
        r = http.post("/v1/completions", json={"prompt": "a", "mode": "ar"})
        assert (r.status_code, r.json()["error"]["code"]) == (504, "timeout")
        r = http.post("/v1/completions", json={"prompt": "a", "mode": "ar", "stream": True})
    lines = [ln for ln in r.text.splitlines() if ln.startswith("data: ")]
    assert r.status_code == 200 and len(lines) == 2  # the stream had begun: the first chunk, then the error
    assert '"raw_bytes": "YQ=="' in lines[0] and '"code": "timeout"' in lines[1]


def test_a_whole_answer_whose_client_leaves_stops_generating() -> None:
    """A client that asks for a whole (not streamed) answer and hangs up: its generation went on to its end or to the
    request's time limit, holding its pipeline slot and KV caches (Starlette watches only a stream's client). It is
    cancelled within about a second of the client leaving, its decoding closed (which sends its RELEASE)."""
    import json
    import socket

    ended = threading.Event()

    class Endless(FakeClient):
        async def decode(self, mode: Mode, prompt: bytes, n_new: int, sampling: Sampling, stats: Any = None
                         ) -> AsyncIterator[bytes]:
            try:
                async for c in super().decode(mode, prompt, n_new, sampling, stats):
                    yield c
            finally:
                ended.set()

    fake = Endless([b"a"] * 60, delays_s=(0.5,) * 60)  # 30 s of generation
    with serve_app(opts(request_timeout_s=60), fake) as url:
        host, port = url.removeprefix("http://").split(":")
        body = json.dumps({"prompt": "a", "max_tokens": 60, "mode": "ar"}).encode()
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n" % len(body) + body)
            time.sleep(1.0)  # generating
            assert not ended.is_set()
        assert ended.wait(5), "the generation went on after its client left"


# --- the real openai client against a loopback pipeline --------------------------------------------------
def test_openai_client_against_a_pipeline() -> None:
    cfg, blocks, e2e = tiny_models(seed=0)
    assembled, _ = local_models(cfg, blocks, e2e)
    prompt, n = "The game", 12
    ref = generate(assembled, prompt.encode(), n, temperature=0.8, top_k=40, seed=4)
    with ring(block_spans(cfg, blocks, SPANS)) as stages:
        pipeline = f"127.0.0.1:{stages[0].address[1]}"
        with serve_app(GatewayOptions(pipeline=pipeline, request_timeout_s=60)) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
            (model,) = client.models.list().data
            assert model.id == "diffusion-n4-d32-ctx32"
            done = client.completions.create(model=model.id, prompt=prompt, max_tokens=n, temperature=0.8, seed=4)
            stream = list(client.completions.create(model=model.id, prompt=prompt, max_tokens=n, temperature=0.8,
                                                    seed=4, stream=True, extra_body={"mode": "ar"}))
            with pytest.raises(openai.BadRequestError) as info:  # 9 + 24 > 32: sweep cannot slide its window
                client.completions.create(model=model.id, prompt=prompt + "!", max_tokens=24, extra_body={"mode": "sweep"})
            assert info.value.status_code == 400 and "context" in info.value.message
            specd = client.completions.create(model=model.id, prompt=prompt, max_tokens=n, temperature=0.0,
                                              extra_body={"mode": "spec", "draft_max": 4})  # block 0 alone drafts
            swept = client.completions.create(model=model.id, prompt=prompt, max_tokens=8, seed=2,
                                              extra_body={"mode": "sweep", "sweeps": 2})
            chat = client.chat.completions.create(model=model.id, max_tokens=16, seed=1, messages=[  # 35 + 16 > 32
                {"role": "user", "content": "Hello! Which game is this?"}])
            assert chat.usage is not None and chat.usage.completion_tokens == 16  # the default (ar) slides its window
            assert extras(chat)["blocktrain"]["mode"] == "ar"

        async def direct_sweep(addr):  # type: ignore[no-untyped-def]
            async with PipelineClient(addr, timeout_s=30) as c:
                return await c.sweep(prompt.encode(), 8, sweeps=2, temperature=0.8, top_k=40, seed=2)

        swept_ref = asyncio.run(direct_sweep(stages[0].address))

        async def direct_spec(addr, seed):  # type: ignore[no-untyped-def]
            async with PipelineClient(addr, timeout_s=30) as c:
                return await c.generate_spec(prompt.encode(), n, temperature=0.0, top_k=40, seed=seed, draft_max=4)

        spec_ref = asyncio.run(direct_spec(stages[0].address, extras(specd)["blocktrain"]["seed"]))
    assert base64.b64decode(extras(swept.choices[0])["raw_bytes"]) == swept_ref and len(swept_ref) == 8
    spec_info = extras(specd)["blocktrain"]
    assert spec_info["mode"] == "spec" and base64.b64decode(extras(specd.choices[0])["raw_bytes"]) == spec_ref.data
    assert len(spec_ref.data) == n and spec_info["traversals"] == spec_ref.traversals
    assert spec_info["traversals"] + spec_info["accepted"] == n and spec_info["drafted"] <= 4 * spec_info["traversals"]
    choice = done.choices[0]
    assert extras(done)["blocktrain"] == {"mode": "ar", "seed": 4}  # ar: the default on diffusion blocks
    assert base64.b64decode(extras(choice)["raw_bytes"]) == ref
    assert choice.text == ref.decode("utf-8", errors="replace") and choice.finish_reason == "length"
    assert done.usage is not None and (done.usage.prompt_tokens, done.usage.completion_tokens, done.usage.total_tokens) == (
        8, n, 8 + n)
    assert b"".join(base64.b64decode(extras(e.choices[0])["raw_bytes"]) for e in stream) == ref
    assert "".join(e.choices[0].text for e in stream) == choice.text
    assert stream[-1].choices[0].finish_reason == "length"


def test_openai_client_spec_on_a_stack_pipeline() -> None:
    cfg = dataclasses.replace(tiny(), objective=Objective.STACK)
    torch.manual_seed(0)
    blocks = {k: StackBlock(cfg.model, k).eval() for k in range(cfg.model.n_blocks)}  # random weights
    spans = [StackSpan({k: blocks[k] for k in range(lo, hi + 1)}, cfg) for lo, hi in ((0, 1), (2, 3))]
    prompt, n = "Sega", 20
    sampling = {"temperature": 0.8, "top_k": 40, "top_p": 0.9, "seed": 3}

    async def direct(addr, **draft):  # type: ignore[no-untyped-def]
        async with PipelineClient(addr, timeout_s=30) as c:
            return await c.generate_spec(prompt.encode(), n, **sampling, **draft)

    with ring(spans) as stages:
        ref = asyncio.run(direct(stages[0].address))
        ref2 = asyncio.run(direct(stages[0].address, draft_min=2, draft_max=2))
        with serve_app(GatewayOptions(pipeline=f"127.0.0.1:{stages[0].address[1]}", request_timeout_s=60)) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
            model = client.models.list().data[0]
            assert extras(model)["modes"] == ["spec", "ar"]
            done = client.completions.create(model=model.id, prompt=prompt, max_tokens=n, temperature=0.8, top_p=0.9,
                                             seed=3, extra_body={"top_k": 40})  # mode spec: the default here
            stream = list(client.completions.create(model=model.id, prompt=prompt, max_tokens=n, temperature=0.8,
                                                    top_p=0.9, seed=3, stream=True, extra_body={"top_k": 40}))
            fixed = client.completions.create(model=model.id, prompt=prompt, max_tokens=n, temperature=0.8, top_p=0.9,
                                              seed=3, extra_body={"top_k": 40, "draft_min": 2, "draft_max": 2})
            slid = client.completions.create(model=model.id, prompt=prompt, max_tokens=29)  # 4 + 29 > 32: it slides
            assert slid.usage is not None and slid.usage.completion_tokens == 29
            assert len(base64.b64decode(extras(slid.choices[0])["raw_bytes"])) == 29
    assert len(ref.data) == n and base64.b64decode(extras(done.choices[0])["raw_bytes"]) == ref.data
    assert extras(done)["blocktrain"] == {"mode": "spec", "seed": 3, "traversals": ref.traversals,
                                              "drafted": ref.drafted, "accepted": ref.accepted}
    assert extras(fixed)["blocktrain"]["drafted"] == ref2.drafted <= 2 * ref2.traversals  # drafts of at most 2 bytes
    assert base64.b64decode(extras(fixed.choices[0])["raw_bytes"]) == ref2.data
    pieces = [base64.b64decode(extras(e.choices[0])["raw_bytes"]) for e in stream]
    assert b"".join(pieces) == ref.data and len([p for p in pieces if p]) == ref.traversals  # a chunk per traversal
    assert "".join(e.choices[0].text for e in stream) == ref.data.decode("utf-8", errors="replace")


def test_cli_gateway_flags(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    seen: list[tuple[GatewayOptions, str, int]] = []
    monkeypatch.setattr(gateway_mod, "run_gateway", lambda o, host, port: seen.append((o, host, port)))
    monkeypatch.setenv(gateway_mod.TOKEN_ENV, "from-env")
    assert main(["gateway", "--pipeline", "10.0.0.1:7000", "--listen", "0.0.0.0:8100", "--max-tokens-cap", "64"]) == 0
    assert seen == [(GatewayOptions(pipeline="10.0.0.1:7000", token="from-env", max_tokens_cap=64), "0.0.0.0", 8100)]
    assert main(["gateway", "--pipeline", "nowhere"]) == 2
    assert "HOST:PORT" in capsys.readouterr().err
    assert main(["gateway", "--pipeline", "h:1", "--max-tokens-cap", "0"]) == 2
    assert "--max-tokens-cap" in capsys.readouterr().err


def test_the_log_prob_cap_counts_the_bytes_an_answer_lists() -> None:
    """The cap on an answer's log-probs counts the bytes it lists: a long prompt without echo (or a chat's
    transcript) is scored as history but listed only for the continuation, so it is served; with echo it is listed."""
    from types import SimpleNamespace

    from blocktrain.serve.gateway.checks import RequestError
    from blocktrain.serve.gateway.generation import Generation, check_fits

    def fits(**kw: Any) -> None:
        g = SimpleNamespace(prompt=b"a" * 60000, max_tokens=16, logprobs=20, n=1, echo=False, chat=False, mode=Mode.AR)
        for k, v in kw.items():
            setattr(g, k, v)
        check_fits(cast(Generation, g), context=64)

    fits()  # 16 x 21 log-probs
    fits(chat=True, n=8)  # a chat's answer lists its own bytes only
    with pytest.raises(RequestError) as info:
        fits(echo=True)  # 60016 x 21 > 2^20
    assert info.value.param == "logprobs"


@pytest.mark.parametrize("max_scoring", [1, 3])
def test_scored_requests_wait_for_room_beyond_max_scoring(max_scoring: int) -> None:
    """Each scored request holds its text's (bytes, 256) float32 rows, 1 KiB a byte: up to 128 MiB for the longest
    one may ask, where 256 connections at once could hold 16 GiB and more (helper-66). At most ``--max-scoring`` are
    scored at once now; the others wait for room, within their timeout, and every one is answered."""
    from blocktrain.serve.gateway.serving import Gateway

    class Counting(FakeClient):
        now = most = 0

        async def score(self, x: torch.Tensor, seed: int = 0) -> torch.Tensor:
            Counting.now += 1
            Counting.most = max(Counting.most, Counting.now)
            await asyncio.sleep(0.2)  # long enough that requests not held back overlap
            Counting.now -= 1
            return torch.zeros(*x.shape, 256)

    gw = Gateway(opts(max_scoring=max_scoring), cast(PipelineClient, Counting([b"abc"], context=16)))
    req = CompletionRequest(prompt="a prompt of some bytes", echo=True, max_tokens=0, logprobs=1)  # type: ignore[arg-type]

    async def three() -> list[Any]:
        return await asyncio.gather(*(gw.complete(req) for _ in range(3)))

    answers = asyncio.run(three())
    assert len(answers) == 3 and all(a.choices[0].logprobs is not None for a in answers)
    assert Counting.most == 1 if max_scoring == 1 else Counting.most > 1  # without the limit, they overlap
