"""The gateway's scoring and sampling extras: echo and logprobs equal to local eval, n, stop sequences, token ids,
the tokenizer endpoints, and no request lost for lack of KV cache."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import torch
from pydantic import ValidationError

from blocktrain.checkpoint.run import RunDir
from blocktrain.cli.main import main
from blocktrain.config import Objective
from blocktrain.data.dataset import eval_windows
from blocktrain.evaluate.assembled import AssembledModel, E2EModel
from blocktrain.evaluate.generate import generate
from blocktrain.evaluate.scoring import score_split, target_log_probs
from blocktrain.model.stack import StackBlock
from blocktrain.presets import tiny
from blocktrain.serve.client.pipeline import PipelineClient
from blocktrain.serve.gateway.app import GatewayOptions
from blocktrain.serve.gateway.checks import MAX_STOPS, refusal
from blocktrain.serve.gateway.generation import max_tokens_of
from blocktrain.serve.gateway.logprobs import StopScanner, completion_logprobs, text_offsets, token_str
from blocktrain.serve.gateway.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest, chat_prompt
from blocktrain.serve.runtime.kvcache import CacheOptions
from blocktrain.serve.runtime.loading import load_run_span
from blocktrain.serve.runtime.stack import StackSpan
from tests.conftest import write_data_dir
from tests.serve_utils import e2e_spans, extras, ring, tiny_models
from tests.test_gateway import serve_app

TEXT = (" = Valkyria Chronicles III = \n Senjo no Valkyria 3 : Unrecorded Chronicles is a tactical role playing "
        "video game developed by Sega . añ€ \n")  # > 4 contexts of 32 bytes, with multi-byte characters


def test_stop_scanner_cuts_before_the_first_stop_across_chunks() -> None:
    scan = StopScanner((b"END", b"\n\n"))
    out = b"".join(scan.feed(c) for c in (b"abc E", b"N", b"D more"))
    assert out == b"abc " and scan.stopped and scan.finish() == b""
    scan = StopScanner((b"xyz",))
    held = [scan.feed(c) for c in (b"aax", b"y", b"b")]
    assert held == [b"aa", b"", b"xyb"] and not scan.stopped  # "x", then "xy", held until "b" proves them no stop
    assert scan.feed(b"c") + scan.finish() == b"c"


def test_token_strings_are_unique_and_offsets_count_characters() -> None:
    assert len({token_str(b) for b in range(256)}) == 256 and token_str(0x41) == "A" and token_str(0xE2) == "bytes:\\xe2"
    data = "añ€z".encode()
    assert text_offsets(data) == [0, 1, 1, 2, 2, 2, 3]  # the bytes of one character share its offset
    # a sequence cut short is one U+FFFD, and the byte that cut it starts after it
    assert text_offsets(b"abc\xe2\xff") == [0, 1, 2, 3, 4] and len(b"abc\xe2\xff".decode(errors="replace")) == 5
    assert text_offsets(b"a\xe2\x82b") == [0, 1, 1, 2] and text_offsets(b"\xe2\x82\xe2\x82\xac") == [0, 0, 1, 1, 1]
    assert text_offsets(b"\xef\xbf\xbdz") == [0, 0, 0, 1]  # U+FFFD itself, encoded: one character


def test_offsets_count_the_characters_of_the_text_shown() -> None:
    """A prompt that ends inside a character, without echo: the answer's text is the continuation decoded alone
    ("\ufffd\ufffdB" for the bytes 82 ac 42), so its offsets are [0, 1, 2], not those of prompt and continuation
    decoded together ([0, 0, 1])."""
    data = bytes([0x41, 0xE2, 0x82, 0xAC, 0x42])
    lp = torch.log_softmax(torch.randn(len(data), 256, generator=torch.Generator().manual_seed(0)), dim=-1)
    got = completion_logprobs(data, lp, top=2, skip=2)
    assert len(data[2:].decode(errors="replace")) == 3 and got.text_offset == [0, 1, 2]
    assert got.token_logprobs == [pytest.approx(float(lp[i, data[i]])) for i in range(2, 5)]
    for i, alternatives in zip(range(2, 5), got.top_logprobs, strict=True):
        assert alternatives is not None and list(alternatives)[:2] == [token_str(int(t)) for t in lp[i].topk(2).indices]
        assert alternatives[token_str(data[i])] == pytest.approx(float(lp[i, data[i]]))


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": "a", "logprobs": 21}, "logprobs"),
    ({"prompt": "a", "logprobs": -1}, "logprobs"),
    ({"prompt": "a", "n": 9}, "n"),
    ({"prompt": "a", "n": 0}, "n"),
    ({"prompt": "a", "stop": [chr(97 + i) for i in range(MAX_STOPS + 1)]}, "stop"),
    ({"prompt": "a", "stop": [""]}, "stop"),
    ({"prompt": "a", "stop": "x" * 65}, "stop"),
    ({"prompt": "a", "max_tokens": 0}, "max_tokens"),
    ({"prompt": [97, 256]}, "prompt"),
    ({"prompt": [97, True]}, "prompt"),
    ({"prompt": [[97], [98]]}, "prompt"),
    ({"prompt": [None, 97]}, "prompt"),
    ({"prompt": [[None, 97]]}, "prompt"),
    ({"prompt": "a", "echo": "yes"}, "echo"),
    ({"prompt": "a", "logprobs": 1, "stream": True}, "stream"),
])
def test_scoring_parameters_out_of_range_are_a_400_naming_them(body: dict[str, Any], param: str) -> None:
    from tests.test_gateway import refusal_of

    status, err = refusal_of(body)
    assert status == 400 and err["param"] == param, err


def invalid(body: dict[str, Any], model: type[CompletionRequest | ChatCompletionRequest]) -> tuple[str | None, str]:
    """The param and message the gateway answers a body that fails ``model``'s validation with."""
    with pytest.raises(ValidationError) as info:
        model.model_validate(body)
    err = refusal(info.value.errors())
    assert err.status == 400
    return err.param, str(err)


def test_token_id_prompts_and_chat_fields() -> None:
    hi = [{"role": "user", "content": "hi"}]

    def completion(**body: Any) -> CompletionRequest:
        return CompletionRequest.model_validate(body)

    def chat(**body: Any) -> ChatCompletionRequest:
        return ChatCompletionRequest.model_validate({"messages": hi, **body})

    assert completion(prompt=[104, 105, 255]).prompt == b"hi\xff"
    assert completion(prompt=[[104, 105]]).prompt == b"hi"
    req = completion(prompt="x", echo=True, max_tokens=0, logprobs=0, n=2, stop="\n")
    assert (req.echo, max_tokens_of(req, 64), req.alternatives, req.n, req.stop) == (True, 0, 0, 2, (b"\n",))
    stops = [f"s{i}" for i in range(MAX_STOPS)]  # lm-eval and code tasks send more than OpenAI's 4
    assert len(completion(prompt="x", stop=stops).stop) == MAX_STOPS >= 16
    req_chat = chat(stop=["User:"], n=2)
    assert req_chat.stop == (b"User:",) and req_chat.n == 2 and req_chat.prompt == b"User: hi\nAssistant:"
    assert max_tokens_of(req_chat, 64) == 64 and req_chat.alternatives is None  # no max_tokens: to a stop or the cap
    assert max_tokens_of(chat(max_tokens=5), 64) == 5
    assert max_tokens_of(chat(max_tokens=5, max_completion_tokens=7), 64) == 7
    assert chat(logprobs=True).alternatives == 0
    assert chat(logprobs=True, top_logprobs=3).alternatives == 3
    for body, param in (({"logprobs": 1}, "logprobs"), ({"top_logprobs": 2}, "top_logprobs"),
                        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
                        ({"logprobs": True, "stream": True}, "stream"), ({"echo": True}, "echo"),
                        ({"messages": [{"role": "user", "content": "a\ud800"}]}, "messages"),
                        ({"messages": [{"role": "wizard", "content": "a"}]}, "messages"),
                        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
                        ({"messages": []}, "messages"), ({"messages": None}, "messages")):
        assert invalid({"messages": hi, **body}, ChatCompletionRequest)[0] == param, body
    assert invalid({"messages": [hi[0], {"role": "user", "content": "a\ud800"}]}, ChatCompletionRequest)[1].startswith(
        "messages[1].content: is not encodable as UTF-8")
    bad, message = invalid({"prompt": [[None, 104]]}, CompletionRequest)
    assert bad == "prompt" and re.match(r"prompt\[0\]\[0\]: null is not a token id.*bos_token '\\n', id 10", message)


@pytest.fixture(scope="module")
def stack_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny stack checkpoint: 4 blocks, 3 steps each, trained in this process."""
    root = tmp_path_factory.mktemp("stack")
    data = write_data_dir(root / "data")
    for k in range(4):
        assert main(["train-block", "--preset", "tiny", "--objective", "stack", "--block", str(k), "--steps", "3",
                     "--out", str(root / "run"), "--data", str(data), "--no-progress", "--eval-bytes", "0"]) == 0
    return root / "run"


def test_echo_logprobs_equal_local_eval(stack_run: Path) -> None:
    """``echo`` + ``logprobs`` with max_tokens 0 (and 1) score the prompt as ``blocktrain eval`` scores it."""
    run = RunDir(stack_run)
    model = AssembledModel.load(run)
    data = TEXT.encode()
    ctx = model.context
    spans = [load_run_span(run, 0, 1), load_run_span(run, 2, 3)]
    with ring(spans) as stages, serve_app(GatewayOptions(pipeline=f"127.0.0.1:{stages[0].address[1]}")) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
        scored = client.completions.create(model=client.models.list().data[0].id, prompt=TEXT, max_tokens=0,
                                           echo=True, logprobs=3)
        plus_one = client.completions.create(model=client.models.list().data[0].id, prompt=list(data), max_tokens=1,
                                             echo=True, logprobs=0, temperature=0, extra_body={"mode": "ar"})
        greedy = httpx.post(f"{url}/v1/completions", json={"prompt": TEXT[:20], "max_tokens": 5, "temperature": 0,
                                                           "logprobs": 2}, timeout=60).json()
        # an empty prompt: generated after EMPTY_PROMPT, and scored after it (its first byte was null, and every
        # later one scored without it)
        empty = [httpx.post(f"{url}/v1/completions", json={"prompt": "", "max_tokens": 4, "temperature": 0,
                                                           "logprobs": 1, "echo": echo}, timeout=60).json()
                 for echo in (False, True)]
    lp = scored.choices[0].logprobs
    assert lp is not None and scored.choices[0].text == TEXT
    assert lp.tokens is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    assert lp.tokens == [token_str(b) for b in data] and lp.text_offset == text_offsets(data)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    served = np.array(lp.token_logprobs[1:], dtype=np.float64)
    # the local eval over the same bytes: its mean CE equals the served log-probs' mean
    local = score_split(lambda x: model.log_probs(x), np.frombuffer(data, dtype=np.uint8), ctx)
    assert -served.mean() == pytest.approx(local.ce_nats_per_byte, abs=1e-4)
    # and byte by byte, in each eval window, against the local model's own teacher-forced log-probs
    for start, length, first in eval_windows(len(data), ctx):
        x = torch.tensor(list(data[start : start + length + 1]))
        want = model.log_probs(x[None, :-1])[0, 0].gather(-1, x[1:, None].long())[:, 0]  # (length,)
        got = torch.tensor(served[start + first : start + length])  # served[i] is byte i + 1
        torch.testing.assert_close(got, want[first:].double(), atol=1e-4, rtol=0)
    for i, top in enumerate(lp.top_logprobs[1:], start=1):
        assert len(top) in (3, 4) and top[lp.tokens[i]] == pytest.approx(lp.token_logprobs[i], abs=1e-6)
    # max_tokens 1 with echo: every prompt byte's log-prob, then the generated byte's
    lp1 = plus_one.choices[0].logprobs
    assert lp1 is not None and lp1.tokens is not None and lp1.token_logprobs is not None
    assert len(lp1.tokens) == len(data) + 1
    # one more byte moves no earlier byte's score (the windows are laid out from the start)
    assert lp1.token_logprobs[1 : len(data)] == pytest.approx(lp.token_logprobs[1:], abs=1e-6)
    assert all(isinstance(v, float) for v in lp1.token_logprobs[1:])
    # without echo: only the generated bytes; greedy picks each position's most likely byte
    g = greedy["choices"][0]["logprobs"]
    assert len(g["tokens"]) == 5 and g["text_offset"][0] == 0
    for tok, chosen, top in zip(g["tokens"], g["token_logprobs"], g["top_logprobs"], strict=True):
        assert chosen == pytest.approx(max(top.values()), abs=1e-6) and top[tok] == chosen
    for answer in empty:
        e = answer["choices"][0]["logprobs"]
        assert len(e["tokens"]) == 4 and e["text_offset"][0] == 0, e
        for tok, chosen, top in zip(e["tokens"], e["token_logprobs"], e["top_logprobs"], strict=True):
            assert chosen is not None and chosen == pytest.approx(max(top.values()), abs=1e-6) and top[tok] == chosen


def test_n_stop_and_tokenizer_endpoints(stack_run: Path) -> None:
    run = RunDir(stack_run)
    spans = [load_run_span(run, 0, 3)]
    with ring(spans) as stages, serve_app(GatewayOptions(pipeline=f"127.0.0.1:{stages[0].address[1]}")) as url:
        def post(path: str, body: dict[str, Any]) -> dict[str, Any]:
            r = httpx.post(f"{url}{path}", json=body, timeout=60)
            assert r.status_code == 200, r.text
            return dict(r.json())

        base = {"prompt": "Sega", "max_tokens": 12, "temperature": 1.0, "seed": 5, "mode": "ar"}
        one = post("/v1/completions", base)["choices"][0]["text"]
        three = post("/v1/completions", {**base, "n": 3})
        assert [c["index"] for c in three["choices"]] == [0, 1, 2] and three["choices"][0]["text"] == one
        assert len(set(three["blocktrain"]["seeds"])) == 3 and three["blocktrain"]["seeds"][0] == 5
        assert three["usage"]["completion_tokens"] == sum(len(base64.b64decode(c["raw_bytes"])) for c in three["choices"])
        # each choice's log-probs (its prompt's rows scored once, with the first choice) equal its text scored alone
        for c in post("/v1/completions", {**base, "n": 3, "logprobs": 1, "echo": True})["choices"]:
            raw = base64.b64decode(c["raw_bytes"])  # echo: the prompt, then the choice's bytes
            alone = post("/v1/completions", {"prompt": list(raw), "max_tokens": 0, "echo": True, "logprobs": 1})
            want = alone["choices"][0]["logprobs"]["token_logprobs"]
            assert len(want) == len(raw) and c["logprobs"]["token_logprobs"][1:] == pytest.approx(want[1:], abs=1e-5)
        stop = one[3:5]  # a stop sequence the first choice meets
        cut = post("/v1/completions", {**base, "stop": [stop, "\u2603"]})["choices"][0]
        assert cut["text"] == one[: one.index(stop)] and cut["finish_reason"] == "stop"
        streamed = httpx.post(f"{url}/v1/completions", json={**base, "stop": stop, "stream": True, "n": 2}, timeout=60)
        texts: dict[int, str] = {0: "", 1: ""}
        for line in streamed.text.splitlines():
            if line.startswith("data: {"):
                import json

                for c in json.loads(line[6:])["choices"]:
                    texts[c["index"]] += c.get("text", "")
        assert texts[0] == cut["text"]
        tok = post("/tokenize", {"prompt": "añ", "return_token_strs": True})
        assert tok == {"count": 3, "max_model_len": 32, "tokens": [97, 0xC3, 0xB1],
                       "token_strs": ["a", "bytes:\\xc3", "bytes:\\xb1"]}
        assert post("/tokenize", {"messages": [{"role": "user", "content": "hi"}]})["tokens"] == list(b"User: hi\nAssistant:")
        assert post("/detokenize", {"tokens": [97, 0xC3, 0xB1]}) == {"prompt": "añ"}
        info = httpx.get(f"{url}/tokenizer_info", timeout=10).json()
        assert info["vocab_size"] == 256 and info["model_max_length"] == 32
        bad = httpx.post(f"{url}/detokenize", json={"tokens": [300]}, timeout=10)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


@pytest.mark.parametrize("family", ["stack", "e2e"])
def test_no_request_fails_for_lack_of_kv_cache(family: str, caplog: pytest.LogCaptureFixture) -> None:
    """Twelve requests at once through stages that cache one request each: evicted requests prefill again, and
    every continuation equals the local model's."""
    if family == "stack":
        cfg = dataclasses.replace(tiny(), objective=Objective.STACK)
        torch.manual_seed(0)
        blocks = {k: StackBlock(cfg.model, k).eval() for k in range(cfg.model.n_blocks)}
        spans: list[Any] = [StackSpan({k: blocks[k] for k in range(lo, hi + 1)}, cfg, cache=CacheOptions(max_requests=1))
                            for lo, hi in ((0, 1), (2, 3))]
        local: Any = AssembledModel([blocks[k] for k in range(4)], cfg)
    else:
        cfg, _, e2e = tiny_models()
        spans = e2e_spans(e2e, [(0, 1), (2, 3)])
        for s in spans:
            s.cache.opts = dataclasses.replace(s.cache.opts, max_requests=1)
        local = E2EModel(e2e, cfg)
    prompts = [f"p{i} Sega".encode() for i in range(12)]

    async def all_at_once(addr: Any) -> list[bytes]:
        async with PipelineClient(addr, timeout_s=60) as c:
            return list(await asyncio.gather(*(c.generate_ar(p, 10, temperature=0.0, top_k=0, seed=0) for p in prompts)))

    with ring(spans) as stages:
        got = asyncio.run(all_at_once(stages[0].address))
    dropped = [r for r in caplog.records if "dropped the least recently used request" in r.getMessage()]
    again = [r for r in caplog.records if "prefilling its" in r.getMessage()]
    assert dropped and again  # caches were overrun, and requests prefilled again instead of failing
    for p, g in zip(prompts, got, strict=True):
        assert g == generate(local, p, 10, temperature=0.0, top_k=0, seed=0), p


ERROR_CASES: list[tuple[str, str]] = [  # (path, raw body): each must get a 4xx with the OpenAI error shape
    ("/v1/completions", '{"prompt": "a", "max_tokens": ' + "9" * 5000 + "}"),
    ("/v1/completions", '{"prompt": "a", "temperature": 1e999}'),
    ("/v1/completions", '{"prompt": ' + "[" * 50_000 + "]" * 50_000 + "}"),
    ("/v1/completions", '{"prompt": "a", "logprobs": 1000, "echo": true, "max_tokens": 0}'),
    ("/v1/completions", '{"prompt": "a", "n": 1000}'),
    ("/v1/completions", '{"prompt": [97, 256]}'),
    ("/v1/completions", '{"prompt": "a", "max_tokens": 0}'),
    ("/v1/completions", '{"prompt": "a", "logprobs": 1, "stream": true}'),
    ("/v1/completions", json.dumps({"prompt": "a", "stop": [f"s{i}" for i in range(MAX_STOPS + 1)]})),
    ("/v1/chat/completions", '{"messages": []}'),
    ("/v1/chat/completions", '{"messages": [{"role": "wizard", "content": "hi"}]}'),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "logprobs": 1}'),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 3}'),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "a\\ud800"}]}'),
    ("/v1/completions", '{"prompt": [[null, 97]], "echo": true, "max_tokens": 1, "logprobs": 1}'),
    ("/tokenize", '{"prompt": 7}'),
    ("/detokenize", '{"tokens": [-1]}'),
    ("/detokenize", '{"tokens": "abc"}'),
]


def test_error_cases_are_4xx_without_a_traceback(caplog: pytest.LogCaptureFixture) -> None:
    """Every hostile or bad request: a 4xx with the OpenAI error shape; no 5xx, and no traceback logged."""
    from tests.test_gateway import FakeClient

    fake = FakeClient([b"abc"], context=16)
    with serve_app(GatewayOptions(pipeline="127.0.0.1:1", max_tokens_cap=8, max_body_bytes=300_000), fake) as url, \
            httpx.Client(base_url=url, timeout=30) as http:
        statuses = []
        for path, body in ERROR_CASES:
            r = http.post(path, content=body.encode(), headers={"content-type": "application/json"})
            statuses.append(r.status_code)
            assert 400 <= r.status_code < 500 and set(r.json()["error"]) == {"message", "type", "param", "code"}, (path,
                                                                                                              body[:60])
    assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"
    assert fake.calls == [] and len(statuses) == len(ERROR_CASES)


def test_a_stage_naming_the_old_family_is_read_as_diffusion(monkeypatch: pytest.MonkeyPatch) -> None:
    """Diffusion stages once called their family "blocktrain"; a client reads such a stage as "diffusion"."""
    from blocktrain.serve.runtime.diffusion import BlockSpan
    from tests.serve_utils import block_spans

    cfg, blocks, _ = tiny_models()
    monkeypatch.setattr(BlockSpan, "family", "blocktrain")

    async def family(addr: Any) -> str:
        async with PipelineClient(addr, timeout_s=30) as c:
            return c.stage.family

    with ring(block_spans(cfg, blocks, [(0, 3)])) as stages:
        assert asyncio.run(family(stages[0].address)) == "diffusion"


CHATS: list[list[dict[str, str]]] = [  # one message, then a two-turn chat (both transcripts exceed a context of 32)
    [{"role": "user", "content": "Hello! Which game is this?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a Sega game."},
     {"role": "assistant", "content": "Valkyria Chronicles III."}, {"role": "user", "content": "When was it released?"}],
]


def smallest_text_of(windows: int, context: int) -> int:
    """The fewest bytes that ``blocktrain eval`` scores in ``windows`` windows of ``context``."""
    return next(n for n in range(2, 64 * context) if len(eval_windows(n, context)) == windows)


def test_chat_logprobs_and_defaults_as_the_openai_client_reads_them(stack_run: Path) -> None:
    """Chat with ``logprobs=True, top_logprobs=3``: per generated byte, the log-prob the completions endpoint gives
    the same bytes (and local eval); no ``max_tokens`` runs past OpenAI's 16 to the gateway's cap; ``text_offset``
    is right after invalid bytes."""
    run = RunDir(stack_run)
    model = AssembledModel.load(run)
    spans = [load_run_span(run, 0, 1), load_run_span(run, 2, 3)]
    cap = 40
    with ring(spans) as stages, serve_app(GatewayOptions(pipeline=f"127.0.0.1:{stages[0].address[1]}",
                                                         max_tokens_cap=cap)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
        mid = client.models.list().data[0].id
        chat = client.chat.completions.create(model=mid, messages=CHATS[1], temperature=0, logprobs=True,  # type: ignore[arg-type]
                                              top_logprobs=3)
        raw = base64.b64decode(extras(chat.choices[0])["raw_bytes"])
        transcript = chat_prompt([ChatMessage.model_validate(m) for m in CHATS[1]]).encode()
        comp = client.completions.create(model=mid, prompt=list(transcript + raw), max_tokens=0, echo=True, logprobs=3)
        invalid = client.completions.create(model=mid, prompt=[97, 0xE2, 0xFF, 98], max_tokens=0, echo=True, logprobs=0)
    assert chat.usage is not None and chat.usage.completion_tokens == cap == len(raw)
    assert chat.choices[0].finish_reason == "length" and raw == generate(model, transcript, cap, temperature=0)
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and [c.bytes for c in content] == [[b] for b in raw]
    assert [c.token for c in content] == [token_str(b) for b in raw]
    comp_lp = comp.choices[0].logprobs
    assert comp_lp is not None and comp_lp.token_logprobs is not None and comp_lp.top_logprobs is not None
    want = comp_lp.token_logprobs[len(transcript):]
    assert [c.logprob for c in content] == pytest.approx(want, abs=1e-6)
    local = target_log_probs(lambda x: model.log_probs(x), transcript + raw, model.context)[len(transcript) - 1 :]
    assert [c.logprob for c in content] == pytest.approx(local.tolist(), abs=1e-4)
    for c, top in zip(content, comp_lp.top_logprobs[len(transcript):], strict=True):
        alts = [t.logprob for t in c.top_logprobs]
        assert len(alts) == 3 and alts == sorted(alts, reverse=True) and top is not None
        assert all(top[t.token] == pytest.approx(t.logprob, abs=1e-6) for t in c.top_logprobs)
    assert invalid.choices[0].logprobs.text_offset == [0, 1, 2, 3]  # type: ignore[union-attr]


def test_default_mode_refuses_no_chat_or_scoring_request_for_its_length(stack_run: Path) -> None:
    """Through the openai client on a stack pipeline of context 32: chats past the context in the default mode
    (spec) and in ar, and echo + logprobs scoring (token-id prompts of 1, 2 and 10 eval windows, max_tokens 0 and
    1, in every mode): none is a 400; each is scored in eval's windows, and the one generated byte is local greedy's."""
    run = RunDir(stack_run)
    model = AssembledModel.load(run)
    ctx = model.context
    corpus = (TEXT * 4).encode()
    spans = [load_run_span(run, 0, 1), load_run_span(run, 2, 3)]
    with ring(spans) as stages, serve_app(GatewayOptions(pipeline=f"127.0.0.1:{stages[0].address[1]}")) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
        mid = client.models.list().data[0].id
        one = httpx.post(f"{url}/v1/chat/completions", json={"messages": CHATS[0], "max_tokens": 16}, timeout=60)
        assert one.status_code == 200, one.text
        assert one.json()["blocktrain"]["mode"] == "spec" and one.json()["usage"]["completion_tokens"] == 16
        for messages in CHATS:
            for extra in ({}, {"mode": "ar"}):
                done = client.chat.completions.create(model=mid, messages=messages, max_tokens=40, temperature=0,  # type: ignore[arg-type]
                                                      extra_body=extra)
                assert done.usage is not None and done.usage.prompt_tokens > ctx and done.usage.completion_tokens == 40
                raw = base64.b64decode(extras(done.choices[0])["raw_bytes"])
                prompt = done.usage.prompt_tokens
                transcript = "\n".join(f"{m['role'].capitalize()}: {m['content']}" for m in messages) + "\nAssistant:"
                assert prompt == len(transcript.encode()) and raw == generate(model, transcript.encode(), 40, temperature=0)
        for k in (1, 2, 10):
            data = corpus[: smallest_text_of(k, ctx)]
            assert len(eval_windows(len(data), ctx)) == k
            for mode in (None, "spec", "ar"):
                for max_tokens in (0, 1):
                    got = client.completions.create(model=mid, prompt=list(data), max_tokens=max_tokens, echo=True,
                                                    logprobs=1, temperature=0, extra_body={"mode": mode} if mode else None)
                    shown = base64.b64decode(extras(got.choices[0])["raw_bytes"])
                    assert shown == data + generate(model, data, max_tokens, temperature=0), (k, mode, max_tokens)
                    lp = got.choices[0].logprobs
                    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
                    assert len(lp.tokens) == len(shown) and lp.token_logprobs[0] is None
                    served = -np.array(lp.token_logprobs[1:], dtype=np.float64).mean()
                    local = score_split(lambda x: model.log_probs(x), np.frombuffer(shown, dtype=np.uint8), ctx)
                    assert served == pytest.approx(local.ce_nats_per_byte, abs=1e-4), (k, mode, max_tokens)


def test_scoring_on_the_e2e_baseline_equals_local_eval() -> None:
    """An evaluation harness's requests (echo, logprobs, max_tokens 0 and 1) work on an E2E pipeline too, in windows."""
    torch.manual_seed(0)
    from blocktrain.model.e2e import E2ETransformer

    cfg = tiny().model
    e2e = E2ETransformer(cfg).eval()
    model = E2EModel(e2e, tiny())
    data = TEXT.encode()
    ctx = model.context
    with ring(e2e_spans(e2e, [(0, 1), (2, 3)])) as stages, \
            serve_app(GatewayOptions(pipeline=f"127.0.0.1:{stages[0].address[1]}")) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
        name = client.models.list().data[0].id
        scored = client.completions.create(model=name, prompt=TEXT, max_tokens=0, echo=True, logprobs=1)
        plus_one = client.completions.create(model=name, prompt=list(data), max_tokens=1, echo=True, logprobs=1,
                                             temperature=0)
    lp = scored.choices[0].logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.token_logprobs[0] is None
    served = np.array(lp.token_logprobs[1:], dtype=np.float64)
    local = score_split(lambda x: model.log_probs(x), np.frombuffer(data, dtype=np.uint8), ctx)
    assert -served.mean() == pytest.approx(local.ce_nats_per_byte, abs=1e-4)
    lp1 = plus_one.choices[0].logprobs
    assert lp1 is not None and lp1.tokens is not None and lp1.token_logprobs is not None
    assert len(lp1.tokens) == len(data) + 1
    assert lp1.token_logprobs[1 : len(data) - ctx] == pytest.approx(lp.token_logprobs[1 : len(data) - ctx], abs=1e-6)


def test_offsets_agree_with_the_decoder_on_any_bytes() -> None:
    """The incremental decoder holds ED A9 as the start of a character (it checks only that A9 may continue some
    sequence, not ED's stricter range), so ED A9 AC got offsets [0, 0, 1] where the text is three U+FFFD. Offsets now
    follow the decoder's own error spans: checked against the text, character by character, on random bytes."""
    assert text_offsets(b"\xed\xa9\xac") == [0, 1, 2] and text_offsets(b"\xed\xa0\x82\x9f") == [0, 1, 2, 3]
    g = torch.Generator().manual_seed(0)
    alphabet = torch.tensor([0x41, 0x7F, 0x80, 0x9F, 0xA0, 0xBF, 0xC2, 0xDF, 0xE0, 0xED, 0xEF, 0xF0, 0xF4, 0xF5, 0xFF])
    for _ in range(3000):
        n = int(torch.randint(1, 12, (), generator=g))
        data = bytes(alphabet[torch.randint(0, len(alphabet), (n,), generator=g)].tolist())
        text = data.decode("utf-8", errors="replace")
        offsets = text_offsets(data)
        assert len(offsets) == len(data) and offsets == sorted(offsets) and offsets[0] == 0
        assert offsets[-1] == len(text) - 1, data  # the last byte starts (or is in) the last character
        for c in range(len(text)):  # each character is exactly the bytes sharing its offset
            piece = bytes(b for b, o in zip(data, offsets, strict=True) if o == c)
            assert piece.decode("utf-8", errors="replace") == text[c], (data, c)


def test_log_probs_that_are_not_finite_are_a_pipeline_error() -> None:
    """Logits of +-3e38 (a faulty stage: finite, so the client took them) overflow log_softmax to -inf, which the
    answer served as null, where OpenAI allows null only for the first token and lm-eval sums the values. The scoring
    raises a WireError now, which the gateway answers as a 502."""
    from blocktrain.errors import WireError
    from blocktrain.serve.gateway.logprobs import byte_log_probs

    async def faulty(x: torch.Tensor) -> torch.Tensor:
        logits = torch.zeros(*x.shape, 256)
        logits[..., 0], logits[..., 1] = 3e38, -3e38
        return logits

    async def fine(x: torch.Tensor) -> torch.Tensor:
        return torch.zeros(*x.shape, 256)

    with pytest.raises(WireError, match="not finite"):
        asyncio.run(byte_log_probs(b"hello world", 8, faulty))
    assert torch.isfinite(asyncio.run(byte_log_probs(b"hello world", 8, fine))[1:]).all()


def test_rows_before_the_wanted_one_are_not_scored_and_the_rest_are_unchanged() -> None:
    """A request for the continuation's log-probs without echo had every window of its prompt scored, up to 64 KB of
    it for one listed byte. Only the windows holding a wanted row are sent now, and each row computed is the whole
    scoring's, bit for bit (the layout does not depend on which windows are sent)."""
    from blocktrain.serve.gateway.logprobs import byte_log_probs

    g = torch.Generator().manual_seed(0)
    table = torch.randn(256, 256, generator=g)
    sent: list[int] = []

    async def score(x: torch.Tensor) -> torch.Tensor:  # a bigram "model": logits depend on the byte read
        sent.append(len(x))
        return table[x.long()] + 0.01 * torch.arange(x.shape[1])[None, :, None]  # and on the position in the window

    data = bytes(torch.randint(0, 256, (300,), generator=g).tolist())
    whole = asyncio.run(byte_log_probs(data, 16, score, per_call=1))
    calls = len(sent)
    sent.clear()
    tail = asyncio.run(byte_log_probs(data, 16, score, per_call=1, wanted=290))
    assert torch.equal(tail[290:], whole[290:]) and tail[1:270].isnan().all()  # a sent window's other rows come too
    assert len(sent) <= 2 < calls  # the windows holding rows 290..299, of about 40
