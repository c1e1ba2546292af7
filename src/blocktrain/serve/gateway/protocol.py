"""The gateway's HTTP contract as pydantic models: the request bodies (the answers: :mod:`.responses`).

The shapes are OpenAI's (vLLM's for ``/tokenize``, ``/detokenize`` and ``/tokenizer_info``), a token being a byte,
with BlockTrain's extensions: ``mode``, ``top_k``, ``sweeps`` and ``draft_min``/``draft_max`` in a request,
``raw_bytes`` (the exact bytes, base64) in every choice and ``blocktrain`` ({mode, seed, ...}) in an answer.

A request model checks what holds whichever pipeline serves it: types (strict: ``"5"`` is not 5, ``true`` is not 1),
bounds, fields taken only at their neutral value, combinations (``stream`` with ``echo``); a field sent as null
takes its default, and unknown fields are ignored. What depends on the pipeline (its modes and context) or on the
gateway's options (the ``max_tokens`` cap) is checked when the request is served
(:mod:`~blocktrain.serve.gateway.serving`). Either way a refused request is answered as :class:`.responses.ErrorResponse`,
``param`` naming the field at fault and the message saying where in it and what to send instead
(:mod:`~blocktrain.serve.gateway.checks`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Literal, Self

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictStr,
    WrapValidator,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError, PydanticUseDefault

from blocktrain.serve.gateway.checks import (
    Alternatives,
    DraftBound,
    Int64,
    ModeName,
    Prompt,
    Stops,
    TokenIds,
    invalid,
    located,
    neutral,
    rule,
    text_or_parts,
    utf8,
)
from blocktrain.serve.wire.limits import MAX_SWEEPS
from blocktrain.serve.wire.speculative import MAX_DRAFT

MAX_N = 8  # the most choices one request may ask for
MAX_MESSAGES = 256  # most messages one chat request may carry
SEED_LIMIT = 1 << 63  # seeds are 63-bit (data.stream.mix_seed)
CHAT_TEMPLATE = ("one line 'Role: content' per message (the role capitalised: System, User, Assistant, ...), "
                 "joined by newlines, then a last line 'Assistant:' that the model continues")


# --- requests -----------------------------------------------------------------------------------------------
class _Request(BaseModel):
    """A request body: unknown fields are ignored, a null field takes its default, numbers are finite."""

    model_config = ConfigDict(frozen=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _null_is_default(cls, value: Any) -> Any:
        if value is None:
            raise PydanticUseDefault()
        return value


class StreamOptions(_Request):
    """``stream_options``."""

    include_usage: StrictBool = False  # a last chunk with the usage counts, its choices empty


class TextPart(_Request):
    """One part of a message's content; a byte model reads text parts only."""

    type: Literal["text"]  # the part's kind
    text: StrictStr  # the part's text


class ChatMessage(_Request):
    """One message of a chat."""

    role: Literal["system", "developer", "user", "assistant", "tool"]  # who says it (its line's prefix)
    content: Annotated[StrictStr | list[TextPart] | None, WrapValidator(text_or_parts)] = None  # its text (parts joined)

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or ())

    @model_validator(mode="after")
    def _encodable(self) -> Self:
        try:
            utf8(self.text)
        except PydanticCustomError as exc:
            raise located(("content",), exc, self.content) from None
        return self


Messages = Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]


def chat_prompt(messages: Sequence[ChatMessage]) -> str:
    """The prompt a byte-level LM continues for a chat (:data:`CHAT_TEMPLATE`). The model was not tuned on chats;
    this plain transcript is what it has seen most like one."""
    return "\n".join(f"{m.role.capitalize()}: {m.text}" for m in messages) + "\nAssistant:"


class _Generate(_Request):
    """What ``/v1/completions`` and ``/v1/chat/completions`` share: the model, the mode, sampling, the answer's form."""

    model: StrictStr | None = None  # the served model's id (GET /v1/models); None: whichever it is
    mode: ModeName | None = None  # spec, ar, sweep or baseline; None: the pipeline's default
    max_tokens: Int64 | None = None  # bytes per choice, at most the gateway's cap; None: the endpoint's default
    temperature: Annotated[StrictFloat, rule(lambda t: t >= 0, "must be >= 0 (0 = greedy)")] = 0.8  # below 1e-3: greedy
    top_p: Annotated[StrictFloat, rule(lambda p: 0 < p <= 1, "must be in (0, 1]")] = 1.0  # nucleus mass; 1 = off
    top_k: Annotated[Int64, rule(lambda k: k >= -1, "must be >= 0 (0 or -1 = off)")] = 40  # 256 or more: every byte
    seed: Annotated[Int64, rule(lambda s: 0 <= s < SEED_LIMIT, "must be in [0, 2**63)")] | None = None  # None: drawn
    n: Annotated[Int64, rule(lambda n: 1 <= n <= MAX_N, f"must be in [1, {MAX_N}]", "; send more requests for more choices")] = 1
    stop: Stops = ()  # each choice ends before the first of these (UTF-8) byte sequences
    stream: StrictBool = False  # answer as server-sent events ending with ``data: [DONE]``
    stream_options: StreamOptions | None = None  # what a stream adds
    sweeps: Annotated[Int64, rule(lambda s: 1 <= s <= MAX_SWEEPS, f"must be in [1, {MAX_SWEEPS}]")] = 1  # mode sweep
    draft_min: DraftBound | None = None  # mode spec: bytes, the shortest draft; None: 1
    draft_max: DraftBound | None = None  # mode spec: bytes, the longest draft; None: max(16, draft_min)
    best_of: Annotated[int, neutral(1)] | None = None  # OpenAI's; only its neutral value
    suffix: Annotated[str, neutral("")] | None = None  # OpenAI's; only its neutral value
    logit_bias: Annotated[dict[str, float], neutral({})] | None = None  # OpenAI's; only its neutral value
    presence_penalty: Annotated[float, neutral(0)] | None = None  # OpenAI's; only its neutral value
    frequency_penalty: Annotated[float, neutral(0)] | None = None  # OpenAI's; only its neutral value

    @model_validator(mode="after")
    def _draft_bounds(self) -> Self:
        lo = self.draft_min or 1
        if self.draft_max is not None and self.draft_max < lo:
            raise located(("draft_max",), invalid(f"must be in [draft_min = {lo}, {MAX_DRAFT}], got {self.draft_max}"),
                          self.draft_max)
        return self

    def _whole(self, scored: bool) -> None:
        """Refuse ``stream`` where the answer is scored (echo, logprobs): that is answered whole."""
        if self.stream and scored:
            raise located(("stream",), invalid("echo and logprobs are answered whole: send them without stream",
                                               "unsupported_parameter"), True)


class CompletionRequest(_Generate):
    """``POST /v1/completions``: a continuation of ``prompt``; with ``echo`` and ``logprobs``, the scores of its bytes."""

    prompt: Prompt = b""  # a string, a list of token ids (bytes), or a batch of one of them; sent: its bytes
    echo: StrictBool = False  # the prompt before the continuation (with its log-probs when logprobs is set)
    logprobs: Alternatives | None = None  # alternatives per byte in the answer's log-probs; None: no log-probs

    @model_validator(mode="after")
    def _answered_whole(self) -> Self:
        self._whole(self.echo or self.logprobs is not None)
        return self

    @property
    def alternatives(self) -> int | None:
        """Alternatives per byte in the answer's log-probs; None: no log-probs."""
        return self.logprobs


class ChatCompletionRequest(_Generate):
    """``POST /v1/chat/completions``: the continuation of the chat's transcript (:func:`chat_prompt`)."""

    messages: Messages  # the chat so far
    max_completion_tokens: Int64 | None = None  # read as max_tokens (and wins over it); None: the gateway's cap
    logprobs: StrictBool = False  # each generated byte's log-prob
    top_logprobs: Alternatives | None = None  # with logprobs: alternatives per byte, best first
    echo: Annotated[StrictBool, rule(lambda e: not e, "is a /v1/completions parameter", "; omit it here",
                                     "unsupported_parameter")] = False  # refused

    @model_validator(mode="after")
    def _logprobs_asked(self) -> Self:
        if self.top_logprobs is not None and not self.logprobs:
            raise located(("top_logprobs",), invalid("needs logprobs: true"), self.top_logprobs)
        self._whole(self.logprobs)
        return self

    @property
    def prompt(self) -> bytes:
        """What the model continues: the chat's transcript, UTF-8."""
        return chat_prompt(self.messages).encode()

    @property
    def alternatives(self) -> int | None:
        """Alternatives per byte in the answer's log-probs; None: no log-probs."""
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(_Request):
    """``POST /tokenize`` (vLLM's shape): a prompt, or a chat (its transcript), as tokens."""

    prompt: Prompt | None = None  # as /v1/completions takes it
    messages: Messages | None = None  # a chat, tokenized as its transcript (wins over prompt)
    return_token_strs: StrictBool = False  # also each token's string

    @model_validator(mode="after")
    def _text_sent(self) -> Self:
        if self.prompt is None and self.messages is None:
            raise located(("prompt",), invalid('send {"prompt": "text"} or {"messages": [...]}', "invalid_type"), None)
        return self

    @property
    def data(self) -> bytes:
        return chat_prompt(self.messages).encode() if self.messages is not None else self.prompt or b""


class DetokenizeRequest(_Request):
    """``POST /detokenize`` (vLLM's shape): token ids as text."""

    tokens: TokenIds  # token ids, each a byte


