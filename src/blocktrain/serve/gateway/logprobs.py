"""Bytes as tokens for OpenAI-style clients: log-probs (``echo``/``logprobs``), stop sequences, tokenizer endpoints.

Each byte is one token, id 0-255. A token's string is the character for an ASCII byte and ``bytes:\\xNN`` for any
other byte (a byte above 0x7f is not a character on its own), so every token has its own string. Log-probs are the
model's, at temperature 1, whatever the request samples at: the pipeline scores the text teacher-forced, in the
same windows as ``blocktrain eval`` (:func:`blocktrain.data.dataset.eval_windows`: every byte after the first is
scored once, with at least half a context of history, laid out from the start so that no byte's score depends on
the bytes after it), so a served score equals the local one.
"""

from __future__ import annotations

import codecs
import threading
from collections.abc import Awaitable, Callable

import torch

from blocktrain.config import VOCAB_SIZE
from blocktrain.data.dataset import eval_windows
from blocktrain.errors import WireError
from blocktrain.serve.gateway.responses import ChatLogprobs, CompletionLogprobs, TokenLogprob, TopLogprob
from blocktrain.serve.wire.speculative import windows_in_half_frame

MAX_SCORED_BYTES = 1 << 16  # the most bytes (prompt and continuation) one request may have scored
MAX_LOGPROB_ENTRIES = 1 << 20  # the most log-probs one request's answer may hold: choices x bytes x (alternatives + 1)
WINDOWS_PER_CALL = 32  # windows sent to the pipeline in one score call
ScoreFn = Callable[[torch.Tensor], Awaitable[torch.Tensor]]  # bytes (b, t) uint8 -> logits (b, t, 256)


def token_str(byte: int) -> str:
    """The token string of one byte: itself if ASCII, else ``bytes:\\xNN`` (unique per byte)."""
    return chr(byte) if byte < 0x80 else f"bytes:\\x{byte:02x}"


def text_offsets(data: bytes) -> list[int]:
    """For each byte of ``data``, the offset in characters of ``data.decode("utf-8", "replace")`` where it starts:
    the bytes of one character share their character's offset, and so do the bytes one U+FFFD replaces (the spans
    the decoder itself reports, so this agrees with it however the bytes are broken: a lead byte's stricter second
    byte, E0/ED/F0/F4, included)."""
    broken = _broken_spans(data)
    offsets: list[int] = []
    chars = i = 0
    while i < len(data):
        end = broken.get(i) or i + _utf8_length(data[i])  # a valid character: as long as its lead byte says
        offsets += [chars] * (end - i)
        chars += 1
        i = end
    return offsets


_SPANS = threading.local()  # the spans the decoder reported in this thread's text_offsets call


def _record_span(exc: UnicodeError) -> tuple[str, int]:
    assert isinstance(exc, UnicodeDecodeError)
    _SPANS.found[exc.start] = exc.end
    return "\ufffd", exc.end  # what errors="replace" does


codecs.register_error("blocktrain.utf8_spans", _record_span)


def _broken_spans(data: bytes) -> dict[int, int]:
    """start -> end of each byte run ``data.decode("utf-8", "replace")`` turns into one U+FFFD (one linear pass)."""
    _SPANS.found = {}
    try:
        data.decode("utf-8", errors="blocktrain.utf8_spans")
        return dict(_SPANS.found)
    finally:
        _SPANS.found = {}


def _utf8_length(lead: int) -> int:
    """Bytes of the valid UTF-8 character whose first byte is ``lead``."""
    return 1 if lead < 0x80 else 2 if lead < 0xE0 else 3 if lead < 0xF0 else 4


def windows_per_call(context: int, d_model: int, max_frame_bytes: int) -> int:
    """Windows one score call may carry: at most WINDOWS_PER_CALL, and no more than fill half a frame with their
    widest fp32 tensor (the logits, context x 256, or the hidden state a stage hands on, context x d_model)."""
    return max(1, min(WINDOWS_PER_CALL, windows_in_half_frame(context, max(VOCAB_SIZE, d_model), max_frame_bytes)))


async def byte_log_probs(data: bytes, context: int, score: ScoreFn, per_call: int = WINDOWS_PER_CALL,
                         known: torch.Tensor | None = None, wanted: int = 0) -> torch.Tensor:
    """Log-probs (n, 256) of the byte at each position of ``data`` given the bytes before it; row 0 is NaN.

    Windows of ``context`` bytes as :func:`eval_windows` lays them out (row i is predicted in the one window
    that scores target i), each sent at the full width (a short last window padded after its end), so a row never
    depends on the bytes after it: appending bytes to ``data`` leaves every earlier row as it was. ``per_call``:
    windows per score call (:func:`windows_per_call`). ``known``: the first rows (m, 256) of ``data``, scored before
    (a request's prompt, for each of its choices); a window whose rows all lie among them is not sent again.
    ``wanted``: the first row the caller reads (a window that holds only rows before it is not sent, and its rows
    are NaN: a prompt's rows where the answer lists only the continuation's). The layout does not depend on either,
    so every row computed is the one a whole scoring gives.
    """
    n = len(data)
    out = torch.full((n, VOCAB_SIZE), float("nan"))
    m = 0
    if known is not None:
        m = min(len(known), n)
        out[:m] = known[:m]
    if n < 2:
        return out
    arr = torch.tensor(list(data), dtype=torch.uint8)
    skip = max(m, wanted)
    windows = [w for w in eval_windows(n, context) if w[0] + w[1] >= skip]  # its rows: start + first + 1 .. start + length
    for i in range(0, len(windows), per_call):
        batch = windows[i : i + per_call]
        x = torch.zeros(len(batch), context, dtype=torch.uint8)  # (w, context): each window's inputs, zero-padded
        for j, (start, length, _) in enumerate(batch):
            x[j, :length] = arr[start : start + length]
        lp = torch.log_softmax((await score(x)).float(), dim=-1)  # (w, context, 256)
        for j, (start, length, first) in enumerate(batch):
            out[start + first + 1 : start + length + 1] = lp[j, first:length]  # position p predicts byte start + p + 1
    if not bool(torch.isfinite(out[max(1, wanted):]).all()):  # JSON would carry null where a client sums numbers (lm-eval)
        raise WireError("the pipeline's logits give log-probs that are not finite (a stage's arithmetic overflowed, "
                        "or a stage is faulty): check each stage's weights and precision")
    return out


def _rows(data: bytes, lp: torch.Tensor, top: int, skip: int) -> tuple[list[float], list[list[int]], list[list[float]]]:
    """For each byte of ``data[skip:]``: its log-prob, and the ids and log-probs of the ``top`` most likely bytes at
    its position, best first; one top-k over every row (a Python loop of top-k per row held the event loop for
    seconds on a long prompt)."""
    rows = lp[skip:]  # (n, 256)
    ids = torch.tensor(list(data[skip:]), dtype=torch.long)
    chosen = rows.gather(1, ids[:, None])[:, 0].tolist() if len(ids) else []
    if top <= 0 or not len(ids):
        return chosen, [[] for _ in chosen], [[] for _ in chosen]
    best = torch.topk(rows, top, dim=-1)
    return chosen, best.indices.tolist(), best.values.tolist()


def completion_logprobs(data: bytes, lp: torch.Tensor, top: int, skip: int = 0) -> CompletionLogprobs:
    """The OpenAI Completions ``logprobs`` of ``data[skip:]``, scored with ``data[:skip]`` as history: ``lp`` from
    :func:`byte_log_probs`, ``top`` alternatives per position (the token itself is always listed)."""
    offsets = text_offsets(data[skip:])  # of the text shown: a character the history ends inside is not part of it
    values, best, best_lp = _rows(data, lp, top, skip)
    chosen: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    for j, b in enumerate(data[skip:]):
        if skip + j == 0:  # the first byte has no history: OpenAI's null
            chosen.append(None)
            tops.append(None)
            continue
        chosen.append(values[j])
        alternatives = {token_str(t): v for t, v in zip(best[j], best_lp[j], strict=True)}
        alternatives[token_str(b)] = values[j]
        tops.append(alternatives)
    return CompletionLogprobs(tokens=[token_str(b) for b in data[skip:]], token_logprobs=chosen, top_logprobs=tops,
                              text_offset=offsets)


def chat_logprobs(data: bytes, lp: torch.Tensor, top: int, skip: int) -> ChatLogprobs:
    """The OpenAI Chat Completions ``logprobs`` of ``data[skip:]`` (the answer, ``skip`` >= 1 bytes of
    transcript before it): per byte its token, log-prob, bytes and the ``top`` most likely alternatives, best first."""
    values, best, best_lp = _rows(data, lp, top, skip)
    return ChatLogprobs(content=[
        TokenLogprob(token=token_str(b), logprob=values[j], bytes=[b],
                     top_logprobs=[TopLogprob(token=token_str(t), logprob=v, bytes=[t])
                                   for t, v in zip(best[j], best_lp[j], strict=True)])
        for j, b in enumerate(data[skip:])])


class StopScanner:
    """Bytes in chunks -> the bytes to emit, cut before the first stop sequence; bytes that could begin a stop
    sequence are held back until they cannot."""

    def __init__(self, stops: tuple[bytes, ...]) -> None:
        self.stops = stops
        self.pending = b""
        self.stopped = False

    def feed(self, chunk: bytes) -> bytes:
        if self.stopped:
            return b""
        self.pending += chunk
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            out, self.pending = self.pending[: min(hits)], b""
            return out
        keep = max((j for s in self.stops for j in range(1, min(len(s), len(self.pending) + 1))
                    if self.pending.endswith(s[:j])), default=0)  # the longest tail that begins a stop sequence
        out, self.pending = self.pending[: len(self.pending) - keep], self.pending[len(self.pending) - keep :]
        return out

    def finish(self) -> bytes:
        out, self.pending = self.pending, b""
        return b"" if self.stopped else out
