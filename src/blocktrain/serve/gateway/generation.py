"""A request as the pipeline serves it: its defaults filled in, settled against the pipeline.

:class:`Generation` is what the gateway generates for a validated request (a chat's transcript as its prompt):
the bytes per choice (:func:`max_tokens_of`, within the gateway's cap), the sampling (:func:`sampling_of`), the
mode, the pipeline's default when the request names none, checked against the modes the entry stage reports and
the settings the mode's rules take (:func:`mode_of`), and the context (:func:`check_fits`). A request the pipeline
cannot serve so is refused with a :class:`~blocktrain.serve.gateway.checks.RequestError`.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, replace

from blocktrain.config import VOCAB_SIZE
from blocktrain.seeds import Seed
from blocktrain.serve.client.decoding import Sampling, runnable_modes
from blocktrain.serve.client.stage_info import StageInfo
from blocktrain.serve.gateway.checks import RequestError, show
from blocktrain.serve.gateway.logprobs import MAX_LOGPROB_ENTRIES, MAX_SCORED_BYTES
from blocktrain.serve.gateway.protocol import SEED_LIMIT, ChatCompletionRequest, CompletionRequest
from blocktrain.serve.gateway.responses import Usage
from blocktrain.serve.wire.frames import Mode
from blocktrain.serve.wire.modes import MODE_RULES, modes_taking

DEFAULT_MAX_TOKENS = 16  # bytes, OpenAI's default for /v1/completions' max_tokens
MIN_TEMPERATURE = 1e-3  # a temperature below this samples greedily: fp32 logits / T would overflow the softmax


@dataclass(frozen=True)
class Generation:
    """A completion or chat request as the pipeline serves it."""

    chat: bool  # a chat: the answer and its chunks are chat-shaped
    prompt: bytes  # the prompt (a chat's transcript), UTF-8
    max_tokens: int  # bytes to generate per choice
    mode: Mode  # the mode that runs (the pipeline's default when the request named none)
    sampling: Sampling  # choice 0's; choice i > 0 samples with its own seed (:meth:`choice`)
    n: int  # choices
    stop: tuple[bytes, ...]  # each choice ends before the first of these
    echo: bool  # the prompt before the continuation
    logprobs: int | None  # alternatives per byte in the log-probs; None: no log-probs
    stream: bool  # answer as server-sent events
    include_usage: bool  # streaming: a last chunk with the usage counts
    score_seed: int = 0  # the chain's draw for log-probs: the request's seed, else 0 (blocktrain eval's), so the same
    # text scores the same twice (a diffusion chain's scores depend on it; a stack's and an E2E's do not)

    @classmethod
    def of(cls, req: CompletionRequest | ChatCompletionRequest, max_tokens: int, stage: StageInfo) -> Generation:
        """The request, generating ``max_tokens`` bytes per choice (:func:`max_tokens_of`), on the pipeline ``stage``
        describes; RequestError when that pipeline does not serve it (:func:`mode_of`, :func:`check_fits`)."""
        g = cls(chat=isinstance(req, ChatCompletionRequest), prompt=req.prompt, max_tokens=max_tokens,
                mode=mode_of(req, stage), sampling=sampling_of(req), n=req.n, stop=req.stop, echo=req.echo,
                logprobs=req.alternatives, stream=req.stream,
                include_usage=req.stream_options is not None and req.stream_options.include_usage,
                score_seed=0 if req.seed is None else req.seed)
        check_fits(g, stage.context)
        return g

    def choice(self, i: int) -> Generation:
        """Choice ``i``: choice 0 is the request itself, choice i > 0 samples with its own seed."""
        seed = Seed.GATEWAY_CHOICE.derive(self.sampling.seed, i)
        return self if i == 0 else replace(self, sampling=replace(self.sampling, seed=seed))

    def usage(self, n_out: int) -> Usage:
        """The usage of ``n_out`` bytes generated, all choices together."""
        return Usage(prompt_tokens=len(self.prompt), completion_tokens=n_out, total_tokens=len(self.prompt) + n_out)


def max_tokens_of(req: CompletionRequest | ChatCompletionRequest, cap: int) -> int:
    """The bytes to generate per choice: ``max_tokens`` (a chat's ``max_completion_tokens`` wins), else the endpoint's
    default (a completion: OpenAI's 16; a chat: to a stop sequence or ``cap``); RequestError (400) out of range."""
    field, asked, default = "max_tokens", req.max_tokens, min(DEFAULT_MAX_TOKENS, cap)
    if isinstance(req, ChatCompletionRequest):
        default = cap
        if req.max_completion_tokens is not None:
            field, asked = "max_completion_tokens", req.max_completion_tokens
    n = default if asked is None else asked
    if not (0 if req.echo else 1) <= n <= cap:
        raise RequestError(400, f"{field}: counts bytes and must be in [1, {cap}] (0 with echo: score the prompt), got "
                                f"{show(n)}", "invalid_value", field)
    return n


def sampling_of(req: CompletionRequest | ChatCompletionRequest) -> Sampling:
    """How a request samples: greedy below MIN_TEMPERATURE, top_k off at -1 or VOCAB_SIZE and more, a seed drawn
    when none is given, the draft bounds' defaults filled in."""
    lo = req.draft_min or 1
    return Sampling(temperature=req.temperature if req.temperature >= MIN_TEMPERATURE else 0.0,
                    top_k=0 if req.top_k >= VOCAB_SIZE else max(req.top_k, 0), top_p=req.top_p,
                    seed=secrets.randbelow(SEED_LIMIT) if req.seed is None else req.seed, sweeps=req.sweeps,
                    draft_min=lo, draft_max=max(Sampling.draft_max, lo) if req.draft_max is None else req.draft_max)


def mode_of(req: CompletionRequest | ChatCompletionRequest, stage: StageInfo) -> Mode:
    """The mode a request runs on the pipeline ``stage`` describes (its default when the request names none);
    RequestError when the pipeline does not run it or the mode does not take the request's settings."""
    modes = runnable_modes(stage)
    if not modes:
        raise RequestError(502, f"the pipeline's entry stage reports no generation mode (it reports "
                                f"{[m.value for m in stage.modes]!r}); check that it runs this release", "pipeline_error")
    mode = Mode(req.mode) if req.mode else modes[0]
    if mode not in modes:
        raise RequestError(400, f"mode: this pipeline serves a {stage.family} run, which runs mode "
                                f"{' or '.join(m.value for m in modes)}, not {mode.value}; omit mode or use one of those",
                           "unsupported_mode", "mode")
    sent = {"top_p": req.top_p < 1, "sweeps": req.sweeps != 1, "draft_min": req.draft_min is not None,
            "draft_max": req.draft_max is not None}  # the settings a mode's rules may not take
    for field, rule in (("top_p", "top_p"), ("sweeps", "sweeps"), ("draft_min", "draft"), ("draft_max", "draft")):
        if sent[field] and not getattr(MODE_RULES[mode], rule):
            raise RequestError(400, f"{field}: mode {mode.value} does not take it (modes that do: {modes_taking(rule)}); "
                                    f"omit {field} or name one of those modes", "unsupported_parameter", field)
    return mode


def check_fits(g: Generation, context: int) -> None:
    """400 when a request asks for more than the gateway serves: log-probs beyond MAX_SCORED_BYTES or
    MAX_LOGPROB_ENTRIES, or, in a mode whose rules keep prompt and continuation in one window (sweep), more than
    the model's context.

    Every other mode slides its window over any prompt and continuation (scoring lays its windows out as
    ``blocktrain eval`` does), so below the caps the pipeline's default refuses no request for its length.
    """
    p, n = max(len(g.prompt), 1), g.max_tokens  # an empty prompt is sent as b"\n"
    if g.logprobs is not None and len(g.prompt) + n > MAX_SCORED_BYTES:
        raise RequestError(400, f"prompt: log-probs are served for at most {MAX_SCORED_BYTES} bytes of prompt and "
                                f"continuation, got {len(g.prompt)} + {n}; split the text", "context_length_exceeded", "prompt")
    shown = (len(g.prompt) if g.echo and not g.chat else 0) + n  # the bytes whose log-probs an answer lists
    if g.logprobs is not None and g.n * shown * (g.logprobs + 1) > MAX_LOGPROB_ENTRIES:
        raise RequestError(400, f"logprobs: an answer holds at most {MAX_LOGPROB_ENTRIES} log-probs (choices x bytes x "
                                f"(alternatives + 1)), this one would hold {g.n} x {shown} x {g.logprobs + 1}; "
                                "ask for fewer alternatives or choices, or split the text", "invalid_value", "logprobs")
    if MODE_RULES[g.mode].fits(p, n, context):
        return
    slides = ", ".join(m.value for m, r in MODE_RULES.items() if r.slides)
    field = "prompt" if p >= context else "max_tokens"
    raise RequestError(400, f"{field}: mode {g.mode.value} keeps prompt and continuation in one window: prompt ({p}) + "
                            f"max_tokens ({n}) must be at most the context ({context}); shorten them, or use a mode that "
                            f"slides its window ({slides}) or omit mode", "context_length_exceeded", field)
