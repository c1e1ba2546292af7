"""The checks of the gateway's request fields, and the error a refused request is answered with.

A check raises a pydantic error (its code one of :data:`CODES`) whose message says what is wrong with the value
and what to send instead, without naming the field: :func:`refusal` turns the first error of a body into a
:class:`RequestError` whose message begins with the field's path (``prompt[1]: 256 is not a token id: ...``) and
whose ``param`` is the field. Values are shown short (:func:`show`: a huge integer by its size).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Annotated, Any

from pydantic import AfterValidator, PlainValidator, StrictInt, ValidationError, WithJsonSchema
from pydantic_core import InitErrorDetails, PydanticCustomError

from blocktrain.config import VOCAB_SIZE
from blocktrain.errors import ProtocolError
from blocktrain.serve.wire.modes import GENERATION_MODES
from blocktrain.serve.wire.speculative import MAX_DRAFT

MAX_STOPS = 32  # the most stop sequences (OpenAI allows 4; lm-eval and code tasks send more)
MAX_STOP_BYTES = 64  # the longest stop sequence, in bytes
MAX_LOGPROBS = 20  # the most alternatives per position a request may ask for (vLLM's limit)
MAX_TOKEN_IDS = 1 << 20  # the most token ids one prompt, /tokenize answer or /detokenize request may hold
BOS_TOKEN = "\n"  # the byte a text begins after (an empty prompt is sent as it): /tokenizer_info's bos_token
CODES = ("invalid_value", "invalid_type", "unsupported_parameter")  # the error codes these checks raise
MODE_NAMES = tuple(m.value for m in GENERATION_MODES)  # the values of ``mode``


def show(value: Any) -> str:
    """A short, safe rendering of a client's value for an error message (huge integers by their size)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"an integer of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


class RequestError(ProtocolError):
    """A request the gateway refuses (or a pipeline failure), answered with HTTP ``status`` and
    :class:`~blocktrain.serve.gateway.responses.ErrorResponse`."""

    def __init__(self, status: int, message: str, code: str | None, param: str | None = None) -> None:
        super().__init__(status, message, reason=code or "error")
        self.code = code  # machine-readable reason, or None
        self.param = param  # the request field at fault, or None


def refusal(errors: Sequence[Mapping[str, Any]]) -> RequestError:
    """The 400 of a body that failed validation (pydantic's errors, FastAPI's under ``body``): its first error as
    ``<path>: <what is wrong>``, ``param`` the top-level field of the path."""
    first = errors[0]
    loc = tuple(first["loc"])
    loc = loc[1:] if loc[:1] == ("body",) else loc
    kind = str(first["type"])
    msg = str(first["msg"]) if kind in CODES or kind == "missing" else f"{first['msg']}, got {show(first['input'])}"
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    if not loc:
        return RequestError(400, f"the request body must be a JSON object: {msg}", "invalid_json")
    code = kind if kind in CODES else "invalid_type" if kind.endswith(("_type", "_parsing")) or kind == "missing" \
        else "invalid_value"
    path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".")
    return RequestError(400, f"{path}: {msg}{more}", code, str(loc[0]))


def invalid(message: str, code: str = "invalid_value") -> PydanticCustomError:
    """The error a check raises: ``message`` says what is wrong with the value (not naming the field)."""
    return PydanticCustomError(code, message)


def located(loc: tuple[str | int, ...], error: PydanticCustomError, value: Any) -> ValidationError:
    """``error`` located at ``loc`` (a field, an item of a list), to raise from a validator."""
    return ValidationError.from_exception_data("request", [InitErrorDetails(type=error, loc=loc, input=value)])


def rule(ok: Callable[[Any], bool], want: str, fix: str = "", code: str = "invalid_value") -> AfterValidator:
    """A check of one value: the error ``<want>, got <value><fix>`` when ``ok(value)`` is false."""
    def check(value: Any) -> Any:
        if not ok(value):
            raise invalid(f"{want}, got {show(value)}{fix}", code)
        return value

    return AfterValidator(check)


def neutral(*values: Any) -> AfterValidator:
    """The check of an OpenAI field this gateway takes only at its neutral ``values``."""
    return rule(lambda v: v in values, "is not supported by this gateway", "; omit it", "unsupported_parameter")


def utf8(text: str) -> bytes:
    """``text`` as UTF-8; the error for lone surrogates (JSON can carry them, UTF-8 cannot)."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise invalid(f"is not encodable as UTF-8 ({exc.reason}); remove lone surrogates") from None


def token_ids(ids: list[Any], at: tuple[int, ...], fix: str) -> bytes:
    """A list of token ids (each a byte) as bytes; the error is located at a bad one (under ``at``)."""
    if len(ids) > MAX_TOKEN_IDS:
        raise invalid(f"holds {len(ids)} token ids, at most {MAX_TOKEN_IDS}; split it")
    for i, t in enumerate(ids):
        if t is None:
            raise located((*at, i), invalid(
                f"null is not a token id; each token is a byte, an integer in [0, 255] (a harness sends null where its "
                f"tokenizer has no BOS or EOS token: GET /tokenizer_info reports bos_token {BOS_TOKEN!r}, id "
                f"{ord(BOS_TOKEN)})", "invalid_type"), t)
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < VOCAB_SIZE:
            raise located((*at, i), invalid(f"{show(t)} is not a token id: each token is a byte, an integer in "
                                            f"[0, 255]{fix}"), t)
    return bytes(ids)


def prompt_bytes(value: Any) -> bytes:
    """``prompt``: a string (UTF-8), a list of token ids (one byte each), or a batch of one of them."""
    batch = isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list)
    item = value[0] if batch else value
    if isinstance(item, str):
        return utf8(item)
    if isinstance(item, list):
        return token_ids(item, (0,) if batch else (),
                         "; batches of several prompts are not supported, send one request per prompt")
    raise invalid("must be a string or a list of token ids in [0, 255] (batches of several prompts are not "
                  "supported; send one request per prompt)", "invalid_type")


def token_bytes(value: Any) -> bytes:
    """``tokens`` (/detokenize): a list of token ids -> their bytes."""
    if not isinstance(value, list):
        raise invalid("must be a list of token ids, each a byte in [0, 255]", "invalid_type")
    return token_ids(value, (), "")


def stop_bytes(value: Any) -> tuple[bytes, ...]:
    """``stop``: a string or a list of up to MAX_STOPS non-empty strings -> their UTF-8 bytes."""
    if value == "":
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or len(items) > MAX_STOPS or not all(isinstance(x, str) and x for x in items):
        raise invalid(f"must be a string or a list of at most {MAX_STOPS} non-empty strings", "invalid_type")
    out = tuple(utf8(x) for x in items)
    if out and max(len(x) for x in out) > MAX_STOP_BYTES:
        raise invalid(f"a stop sequence may be at most {MAX_STOP_BYTES} bytes")
    return out


def mode_name(value: Any) -> str:
    """``mode``: the name of a generation mode."""
    if value in MODE_NAMES:
        return str(value)
    raise invalid(f"unknown mode {show(value)}; use one of {', '.join(MODE_NAMES)}, or omit it for the pipeline's default")


def text_or_parts(value: Any, handler: Callable[[Any], Any]) -> Any:
    """A message's ``content`` as pydantic reads it (``handler``), one error instead of one per kind it may be."""
    try:
        return handler(value)
    except ValidationError:
        raise invalid('must be a string or a list of text parts ({"type": "text", "text": "..."}): a byte model '
                      "reads text only", "invalid_type") from None


ModeName = Annotated[str, PlainValidator(mode_name), WithJsonSchema({"enum": list(MODE_NAMES)})]
Int64 = Annotated[StrictInt, rule(lambda v: v.bit_length() <= 64, "is out of range (64 bits at most)")]
Prompt = Annotated[bytes, PlainValidator(prompt_bytes, json_schema_input_type=str | list[int] | list[str] | list[list[int]])]
Stops = Annotated[tuple[bytes, ...], PlainValidator(stop_bytes, json_schema_input_type=str | list[str])]
TokenIds = Annotated[bytes, PlainValidator(token_bytes, json_schema_input_type=list[int])]
Alternatives = Annotated[Int64, rule(lambda k: 0 <= k <= MAX_LOGPROBS, f"must be in [0, {MAX_LOGPROBS}] (alternatives per byte)")]
DraftBound = Annotated[Int64, rule(lambda d: 1 <= d <= MAX_DRAFT, f"must be in [1, {MAX_DRAFT}] bytes")]
