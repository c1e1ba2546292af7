"""What the OpenAI-style gateway asks of a pipeline: a validated completion request, the modes, UTF-8 decoding.

The gateway (``serve/gateway.py``) turns HTTP into a :class:`CompletionRequest` (every field checked here, with an
OpenAI-shaped 4xx on a bad one) and asks a :class:`PipelineBackend` for the continuation as a stream of byte chunks.
The backend is a thin adapter over :class:`blocktrain.serve.client.pipeline.PipelineClient`: it streams with the client's
iterators (``iter_spec``, ``iter_ar``, ``iter_baseline``); mode sweep comes whole, as one chunk.

Bytes cross HTTP twice: as text (bytes that are not valid UTF-8 replaced by U+FFFD, decoded incrementally so that
a character split across two chunks is not replaced) and raw, base64-encoded, in ``raw_bytes``.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import math
import secrets
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, replace
from typing import Any

from blocktrain.errors import ProtocolError, StageUnavailableError
from blocktrain.serve.client.pipeline import PipelineClient
from blocktrain.serve.gateway.logprobs import MAX_LOGPROBS, MAX_SCORED_BYTES, MAX_TOKEN_IDS, StopScanner, byte_log_probs
from blocktrain.serve.wire.frames import Mode
from blocktrain.serve.wire.modes import GENERATION_MODES, MODE_RULES, modes_taking
from blocktrain.serve.wire.speculative import MAX_DRAFT

MODES = tuple(m.value for m in GENERATION_MODES)  # `mode` values (MODE_RULES' keys); spec: speculative decoding
DEFAULT_MAX_TOKENS = 16  # bytes, OpenAI's default for max_tokens
SEED_LIMIT = 1 << 63  # seeds are 63-bit (data.stream.mix_seed)
MAX_SWEEPS = 16  # most sweeps one request may ask for
MIN_TEMPERATURE = 1e-3  # a temperature below this samples greedily: fp32 logits / T would overflow the softmax
VOCAB = 256  # bytes: a top_k of this or more keeps every byte
# fields an OpenAI client may send that this gateway cannot honour unless they hold their neutral value
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "best_of": (None, 1), "suffix": (None, ""), "logit_bias": (None, {}), "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
}
MAX_N = 8  # the most choices one request may ask for
MAX_STOPS = 32  # the most stop sequences (OpenAI allows 4; lm-eval and code tasks send more)
MAX_STOP_BYTES = 64  # the longest stop sequence, in bytes
BOS_TOKEN = "\n"  # the byte a text begins after (an empty prompt is sent as it): /tokenizer_info's bos_token


class RequestError(ProtocolError):
    """A request the gateway refuses, answered as ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, code: str, param: str | None = None) -> None:
        super().__init__(status, message, reason=code)
        self.param = param  # the request field at fault, or None


def bad(message: str, param: str | None, code: str = "invalid_value") -> RequestError:
    return RequestError(400, message, code, param)


@dataclass(frozen=True)
class CompletionRequest:
    """One validated ``POST /v1/completions`` body."""

    prompt: bytes  # the prompt, UTF-8 encoded
    max_tokens: int  # bytes to generate
    mode: Mode | None  # a key of MODE_RULES; None: the pipeline's default (spec on a stack run)
    temperature: float  # softmax temperature; 0 = greedy
    top_p: float  # nucleus mass in (0, 1]; 1 = off (< 1 only where the mode's client method takes it)
    top_k: int  # sample among the k most likely bytes; 0 = off
    seed: int  # sampling seed in [0, 2**63)
    stream: bool  # answer as server-sent events
    include_usage: bool  # streaming: send a last chunk with the usage counts
    sweeps: int  # mode sweep: traversals per continuation
    model: str | None  # the model the client named, checked against the served one
    draft: tuple[int, int] | None = None  # mode spec: (draft_min, draft_max) bytes; None: the client's defaults
    echo: bool = False  # return the prompt before the continuation (with its log-probs when logprobs is set)
    logprobs: int | None = None  # alternatives per position in the answer's log-probs; None: no log-probs
    n: int = 1  # choices, sampled with seeds derived from ``seed`` (choice 0 uses ``seed`` itself)
    stop: tuple[bytes, ...] = ()  # the continuation ends before the first of these (UTF-8) byte sequences


def _number(body: Mapping[str, Any], key: str, default: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    number = math.nan
    if isinstance(value, int | float) and not isinstance(value, bool):
        with contextlib.suppress(OverflowError):  # an integer beyond float range
            number = float(value)
    if not math.isfinite(number):
        raise bad(f"{key} must be a finite number, got {_show(value)}", key, "invalid_type")
    return number


def _flag(body: Mapping[str, Any], key: str) -> bool:
    value = body.get(key, False)
    if value is not None and not isinstance(value, bool):
        raise bad(f"{key} must be true or false", key, "invalid_type")
    return bool(value)


def _show(value: Any) -> str:
    """A short, safe rendering of a client's value for an error message (huge integers by their size)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"an integer of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _integer(body: Mapping[str, Any], key: str, default: int) -> int:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(f"{key} must be an integer, got {_show(value)}", key, "invalid_type")
    if value.bit_length() > 64:
        raise bad(f"{key} is out of range: {_show(value)}", key)
    return value


def parse_completion(body: Any, max_tokens_cap: int) -> CompletionRequest:
    """A JSON body -> CompletionRequest; RequestError (400) names the first bad field and the fix."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object", None, "invalid_json")
    prompt_bytes = _prompt(body.get("prompt", ""))
    for key, neutral in _NEUTRAL.items():
        if key in body and body[key] not in neutral:
            raise bad(f"{key}={body[key]!r} is not supported by this gateway; omit it", key, "unsupported_parameter")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("model must be a string", "model", "invalid_type")
    name = body.get("mode")
    if name is not None and name not in MODES:
        raise bad(f"unknown mode {_show(name)}; use one of {', '.join(MODES)}, or omit it for the pipeline's default",
                  "mode")
    mode = None if name is None else Mode(name)
    echo = _flag(body, "echo")
    logprobs = None if body.get("logprobs") is None else _integer(body, "logprobs", 0)
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        raise bad(f"logprobs must be in [0, {MAX_LOGPROBS}] (alternatives per byte), got {logprobs}", "logprobs")
    n = _integer(body, "n", 1)
    if not 1 <= n <= MAX_N:
        raise bad(f"n must be in [1, {MAX_N}], got {n}; send more requests for more choices", "n")
    max_tokens = _integer(body, "max_tokens", min(DEFAULT_MAX_TOKENS, max_tokens_cap))
    if not (0 if echo else 1) <= max_tokens <= max_tokens_cap:
        raise bad(f"max_tokens counts bytes and must be in [1, {max_tokens_cap}] (0 with echo: score the prompt), "
                  f"got {max_tokens}", "max_tokens")
    temperature = _number(body, "temperature", 0.8)
    if temperature < 0:
        raise bad(f"temperature must be >= 0 (0 = greedy), got {temperature}", "temperature")
    if temperature < MIN_TEMPERATURE:
        temperature = 0.0  # greedy: what any temperature this small samples anyway, without overflow
    top_p = _number(body, "top_p", 1.0)
    if not 0 < top_p <= 1:
        raise bad(f"top_p must be in (0, 1], got {top_p}", "top_p")
    top_k = _integer(body, "top_k", 40)
    if top_k < -1:
        raise bad(f"top_k must be >= 0 (0 or -1 = off), got {top_k}", "top_k")
    seed = _integer(body, "seed", -1)
    if "seed" in body and body["seed"] is not None and not 0 <= seed < SEED_LIMIT:
        raise bad(f"seed must be in [0, 2**63), got {seed}", "seed")
    sweeps = _integer(body, "sweeps", 1)
    if not 1 <= sweeps <= MAX_SWEEPS or (sweeps != 1 and not (mode is not None and MODE_RULES[mode].sweeps)):
        raise bad(f"sweeps must be in [1, {MAX_SWEEPS}] and is only for mode {modes_taking('sweeps')}, got {sweeps}",
                  "sweeps")
    draft = _draft_bounds(body, mode)
    stream = _flag(body, "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
        raise bad('stream_options must be {"include_usage": true|false}', "stream_options", "invalid_type")
    if stream and (echo or logprobs is not None):
        raise bad("echo and logprobs are answered whole: send them without stream", "stream", "unsupported_parameter")
    return CompletionRequest(
        prompt=prompt_bytes, max_tokens=max_tokens, mode=mode, temperature=temperature, top_p=top_p,
        top_k=0 if top_k >= VOCAB else max(top_k, 0), seed=seed if seed >= 0 else secrets.randbelow(SEED_LIMIT), stream=stream,
        include_usage=bool(options.get("include_usage", False)), sweeps=sweeps, model=model, draft=draft,
        echo=echo, logprobs=logprobs, n=n, stop=_stops(body.get("stop")),
    )


def _prompt(prompt: Any) -> bytes:
    """``prompt`` as bytes: a string (UTF-8), a list of token ids 0-255 (one byte each), or a batch of one of them."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one prompt
    if isinstance(prompt, list):
        if len(prompt) > MAX_TOKEN_IDS:
            raise bad(f"a prompt of token ids must hold at most {MAX_TOKEN_IDS} ids, got {len(prompt)}; split it", "prompt")
        for i, t in enumerate(prompt):
            if t is None:
                raise bad(f"prompt[{i}] is null, not a token id; each token is a byte, an integer in [0, 255] (a harness "
                          f"sends null where its tokenizer has no BOS or EOS token: GET /tokenizer_info reports "
                          f"bos_token {BOS_TOKEN!r}, id {ord(BOS_TOKEN)})", "prompt", "invalid_type")
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < VOCAB:
                raise bad(f"prompt[{i}] is {_show(t)}, not a token id: a prompt of token ids holds integers in [0, 255] "
                          "(each byte is a token); batches of several prompts are not supported, send one request per "
                          "prompt", "prompt")
        return bytes(prompt)
    if not isinstance(prompt, str):
        raise bad("prompt must be a string or a list of token ids in [0, 255] (batches of several prompts are not "
                  "supported; send one request per prompt)", "prompt", "invalid_type")
    try:
        return prompt.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise bad(f"prompt is not encodable as UTF-8 ({exc.reason}); remove lone surrogates", "prompt") from exc


def _stops(stop: Any) -> tuple[bytes, ...]:
    """``stop``: None, a string or a list of up to MAX_STOPS non-empty strings -> their UTF-8 bytes."""
    if stop is None or stop == "":
        return ()
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, list) or len(items) > MAX_STOPS or not all(isinstance(x, str) and x for x in items):
        raise bad(f"stop must be a string or a list of at most {MAX_STOPS} non-empty strings", "stop", "invalid_type")
    try:
        out = tuple(x.encode("utf-8") for x in items)
    except UnicodeEncodeError as exc:
        raise bad(f"stop is not encodable as UTF-8 ({exc.reason})", "stop") from exc
    if max(len(x) for x in out) > MAX_STOP_BYTES:
        raise bad(f"a stop sequence may be at most {MAX_STOP_BYTES} bytes", "stop")
    return out


MAX_MESSAGES = 256  # most messages one chat request may carry
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


CHAT_TEMPLATE = ("one line 'Role: content' per message (the role capitalised: System, User, Assistant, ...), "
                 "joined by newlines, then a last line 'Assistant:' that the model continues")


def chat_prompt(messages: list[dict[str, str]]) -> str:
    """The prompt a byte-level LM continues for a chat: one ``Role: content`` line per message, then
    ``Assistant:``. The model was not tuned on chats; this plain transcript is what it has seen most like one."""
    lines = [f"{m['role'].capitalize()}: {m['content']}" for m in messages]
    return "\n".join(lines) + "\nAssistant:"


def parse_chat(body: Any, max_tokens_cap: int) -> CompletionRequest:
    """A ``/v1/chat/completions`` body -> the CompletionRequest of its transcript (:func:`chat_prompt`).

    Without ``max_tokens`` (or ``max_completion_tokens``) the answer runs to a stop sequence or the gateway's cap, as
    chat clients expect; ``logprobs`` (true) with ``top_logprobs`` (0-20) asks for each generated byte's log-prob."""
    clean = chat_messages(body)
    if body.get("echo") not in (None, False):
        raise bad("echo is a /v1/completions parameter; omit it here", "echo", "unsupported_parameter")
    fields = {k: v for k, v in body.items() if k not in ("messages", "max_completion_tokens", "logprobs", "top_logprobs")}
    if body.get("max_completion_tokens") is not None:
        fields["max_tokens"] = body["max_completion_tokens"]
    if fields.get("max_tokens") is None:
        fields["max_tokens"] = max_tokens_cap
    fields["logprobs"] = _chat_logprobs(body)
    return parse_completion({**fields, "prompt": chat_prompt(clean)}, max_tokens_cap)


def _chat_logprobs(body: Mapping[str, Any]) -> int | None:
    """Chat's ``logprobs`` (bool) and ``top_logprobs`` (alternatives per byte) -> the completion's ``logprobs``."""
    wanted = body.get("logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise bad("logprobs must be true or false on /v1/chat/completions (top_logprobs sets the alternatives)",
                  "logprobs", "invalid_type")
    top = None if body.get("top_logprobs") is None else _integer(body, "top_logprobs", 0)
    if top is not None and not 0 <= top <= MAX_LOGPROBS:
        raise bad(f"top_logprobs must be in [0, {MAX_LOGPROBS}] (alternatives per byte), got {top}", "top_logprobs")
    if top is not None and not wanted:
        raise bad("top_logprobs needs logprobs: true", "top_logprobs")
    return (top or 0) if wanted else None


def chat_messages(body: Any) -> list[dict[str, str]]:
    """The ``messages`` of a chat body, checked: roles known, contents text (text parts joined)."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object", None, "invalid_json")
    messages = body.get("messages")
    if not isinstance(messages, list) or not 1 <= len(messages) <= MAX_MESSAGES:
        raise bad(f"messages must be a list of 1 to {MAX_MESSAGES} messages", "messages", "invalid_type")
    clean = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in CHAT_ROLES:
            raise bad(f"messages[{i}] must be an object with a role in {', '.join(CHAT_ROLES)}", "messages")
        content = m.get("content")
        if isinstance(content, list):  # content parts: only text parts are readable by a byte model
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise bad(f"messages[{i}].content: only text parts are supported", "messages", "invalid_type")
            content = "".join(p["text"] for p in content)
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise bad(f"messages[{i}].content must be a string or a list of text parts", "messages", "invalid_type")
        try:
            content.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise bad(f"messages[{i}].content is not encodable as UTF-8 ({exc.reason}); remove lone surrogates",
                      "messages") from exc
        clean.append({"role": str(m["role"]), "content": content})
    return clean


def tokenize_body(body: Any) -> bytes:
    """``POST /tokenize`` (vLLM's shape): ``{"prompt": str | [ids]}`` or ``{"messages": [...]}`` -> the bytes."""
    if isinstance(body, dict) and "messages" in body:
        return chat_prompt(chat_messages(body)).encode("utf-8", errors="replace")
    if not isinstance(body, dict) or "prompt" not in body:
        raise bad('send {"prompt": "text"} or {"messages": [...]}', "prompt", "invalid_type")
    return _prompt(body["prompt"])


def detokenize_body(body: Any) -> bytes:
    """``POST /detokenize`` (vLLM's shape): ``{"tokens": [ids 0-255]}`` -> the bytes."""
    tokens = body.get("tokens") if isinstance(body, dict) else None
    if not isinstance(tokens, list):
        raise bad('send {"tokens": [ids]}, each id a byte in [0, 255]', "tokens", "invalid_type")
    try:
        return _prompt(tokens) if tokens else b""
    except RequestError:
        raise bad(f"tokens must be at most {MAX_TOKEN_IDS} integers in [0, 255] (each byte is a token)",
                  "tokens") from None


def _draft_bounds(body: Mapping[str, Any], mode: Mode | None) -> tuple[int, int] | None:
    """``draft_min`` / ``draft_max`` (mode spec only): the bounds of the adaptive draft length, in bytes."""
    if body.get("draft_min") is None and body.get("draft_max") is None:
        return None
    if mode is not None and not MODE_RULES[mode].draft:
        raise bad(f"draft_min and draft_max are only for mode {modes_taking('draft')}, not {mode.value}", "draft_min",
                  "unsupported_parameter")
    lo = _integer(body, "draft_min", 1)
    hi = _integer(body, "draft_max", max(16, lo))
    if not 1 <= lo <= MAX_DRAFT:
        raise bad(f"draft_min must be in [1, {MAX_DRAFT}], got {lo}", "draft_min")
    if not lo <= hi <= MAX_DRAFT:
        raise bad(f"draft_max must be in [draft_min = {lo}, {MAX_DRAFT}], got {hi}", "draft_max")
    return lo, hi


def check_fits(req: CompletionRequest, context: int) -> None:
    """400 when a request asks for more than the gateway serves: log-probs beyond MAX_SCORED_BYTES, or, in a mode
    whose rules keep prompt and continuation in one window (sweep), more than the model's context.

    Every other mode slides its window over any prompt and continuation (scoring lays its windows out as
    ``blocktrain eval`` does), so below the caps the pipeline's default refuses no request for its length.
    """
    p, n = max(len(req.prompt), 1), req.max_tokens  # an empty prompt is sent as b"\n"
    if req.logprobs is not None and len(req.prompt) + n > MAX_SCORED_BYTES:
        raise bad(f"log-probs are served for at most {MAX_SCORED_BYTES} bytes of prompt and continuation, got "
                  f"{len(req.prompt)} + {n}; split the text", "prompt", "context_length_exceeded")
    if req.mode is None or MODE_RULES[req.mode].fits(p, n, context):
        return
    slides = ", ".join(m.value for m, r in MODE_RULES.items() if r.slides)
    raise bad(f"mode {req.mode.value} keeps prompt and continuation in one window: prompt ({p}) + max_tokens ({n}) "
              f"must be at most the context ({context}); shorten them, or use a mode that slides its window "
              f"({slides}) or omit mode", "prompt" if p >= context else "max_tokens", "context_length_exceeded")


class Utf8Stream:
    """Bytes in chunks -> text: invalid bytes become U+FFFD, a character split across chunks is kept whole."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, chunk: bytes) -> str:
        return str(self._decoder.decode(chunk, final=False))

    def finish(self) -> str:
        """The text of bytes still held back (an incomplete character at the end becomes U+FFFD)."""
        return str(self._decoder.decode(b"", final=True))


class PipelineBackend:
    """The pipeline behind the gateway: one PipelineClient, connected on first use and reopened by the client."""

    def __init__(self, client: PipelineClient) -> None:
        self.client = client
        self._connected = False
        self._lock = asyncio.Lock()

    async def entry(self) -> dict[str, Any]:
        """The entry stage's description (family, n, context, ...), connecting first if needed."""
        if not self._connected:
            async with self._lock:
                if not self._connected:
                    await self.client.connect()
                    self._connected = True
        return self.client.entry

    async def close(self) -> None:
        if self._connected:
            await self.client.close()
            self._connected = False

    def modes(self, entry: Mapping[str, Any]) -> tuple[Mode, ...]:
        """Modes the pipeline described by ``entry`` runs (as its entry stage reports them), its default first."""
        modes = tuple(Mode(m) for m in entry.get("modes", MODES) if m in MODES)
        return (*modes, Mode.AR) if modes == (Mode.BASELINE,) else modes  # iter_ar runs the baseline

    def resolve(self, req: CompletionRequest, entry: Mapping[str, Any]) -> CompletionRequest:
        """The request with its mode settled, checked against the pipeline (modes, context)."""
        modes = self.modes(entry)
        if not modes:
            raise RequestError(502, f"the pipeline's entry stage reports no generation mode (it reports "
                                    f"{entry.get('modes')!r}); check that it runs this release", "pipeline_error")
        mode = req.mode or modes[0]
        rules = MODE_RULES[mode]
        if mode not in modes:
            raise bad(f"this pipeline serves a {entry.get('family')} run, which runs mode "
                      f"{' or '.join(m.value for m in modes)}, not {mode.value}; omit mode or use one of those", "mode",
                      "unsupported_mode")
        if req.top_p < 1 and not rules.top_p:
            raise bad(f"top_p < 1 is not supported by mode {mode.value} (only by {modes_taking('top_p')}); omit top_p",
                      "top_p", "unsupported_parameter")
        if req.draft is not None and not rules.draft:
            raise bad(f"draft_min and draft_max are only for mode {modes_taking('draft')}; this request runs mode "
                      f"{mode.value}", "draft_min", "unsupported_parameter")
        req = replace(req, mode=mode)
        check_fits(req, int(entry.get("context", 0)))
        return req

    async def complete(self, req: CompletionRequest) -> tuple[bytes, dict[str, int], str]:
        """One choice: (the continuation, cut before a stop sequence; the mode's counters; the finish reason)."""
        if req.max_tokens == 0:
            return b"", {}, "length"
        if not req.stop:
            data, stats = await self.generate(req)
            return data, stats, "length" if len(data) >= req.max_tokens else "stop"
        out, scan = bytearray(), StopScanner(req.stop)
        async for piece in self.pieces(req, scan):
            out += piece
        return bytes(out), {}, "stop" if scan.stopped else "length"

    async def pieces(self, req: CompletionRequest, scan: StopScanner) -> AsyncIterator[bytes]:
        """The continuation's chunks with stop sequences cut (``scan.stopped`` tells whether one was met)."""
        chunks = self.stream(req)
        try:
            async for chunk in chunks:
                piece = scan.feed(chunk)
                if piece:
                    yield piece
                if scan.stopped:
                    return
            tail = scan.finish()
            if tail:
                yield tail
        finally:
            await chunks.aclose()  # type: ignore[attr-defined]

    async def log_probs(self, data: bytes, context: int, seed: int) -> Any:
        """Log-probs (len(data), 256) of each byte of ``data`` given the bytes before it (row 0: NaN)."""
        return await byte_log_probs(data, context, lambda x: self.client.score(x, seed=seed))

    async def generate(self, req: CompletionRequest) -> tuple[bytes, dict[str, int]]:
        """The whole continuation, plus the mode's counters (spec: traversals, drafted, accepted)."""
        if req.mode is Mode.SPEC:
            res = await self.client.generate_spec(req.prompt, req.max_tokens, **self._sampling(req))
            return bytes(res.data), {k: int(getattr(res, k)) for k in ("traversals", "drafted", "accepted")}
        out = bytearray()
        async for chunk in self.stream(req):
            out += chunk
        return bytes(out), {}

    def stream(self, req: CompletionRequest) -> AsyncIterator[bytes]:
        """The continuation (of a resolved request) as chunks of new bytes, as the pipeline produces them."""
        c, kw = self.client, self._sampling(req)
        iters = {Mode.SPEC: c.iter_spec, Mode.AR: c.iter_ar, Mode.BASELINE: c.iter_baseline, Mode.SWEEP: self._sweep}
        if req.mode is None:
            raise bad("the request's mode is not resolved; call resolve() first", "mode")
        return iters[req.mode](req.prompt, req.max_tokens, **kw)

    async def _sweep(self, prompt: bytes, n_new: int, **kw: Any) -> AsyncIterator[bytes]:
        data = await self.client.sweep(prompt, n_new, **kw)
        if data:
            yield data

    def _sampling(self, req: CompletionRequest) -> dict[str, Any]:
        kw: dict[str, Any] = {"temperature": req.temperature, "top_k": req.top_k, "seed": req.seed}
        rules = MODE_RULES[req.mode] if req.mode is not None else None
        if req.top_p < 1:  # resolve() let it through: the mode samples with top_p
            kw["top_p"] = req.top_p
        if rules is not None and rules.sweeps:
            kw["sweeps"] = req.sweeps
        if rules is not None and rules.draft and req.draft is not None:
            kw["draft_min"], kw["draft_max"] = req.draft
        return kw


def unavailable(exc: Exception) -> RequestError:
    """A pipeline failure as the 5xx the HTTP client sees."""
    if isinstance(exc, StageUnavailableError):
        return RequestError(503, f"the pipeline is unavailable: {exc}", "pipeline_unavailable")
    return RequestError(502, f"the pipeline failed this request: {exc}", "pipeline_error")
