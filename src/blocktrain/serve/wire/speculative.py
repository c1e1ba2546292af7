"""Speculative sampling: the acceptance rule, the sampling filters it applies, and the adaptive draft length.

Pure maths, no network. The rule is the one of Leviathan, Kalman & Matias
(2023), "Fast Inference from Transformers via Speculative Decoding", Alg. 1,
and Chen et al. (2023), "Accelerating Large Language Model Decoding with
Speculative Sampling", Alg. 2: a draft model M_q proposes bytes
x_1..x_n with x_i ~ q_i(.); the target model M_p scores all of them in one
pass, giving p_1..p_{n+1}. For i = 1..n, keep x_i with probability
min(1, p_i(x_i) / q_i(x_i)); at the first rejection emit one byte from
norm(max(0, p_i - q_i)) and stop; if all n are kept, emit a bonus byte from
p_{n+1}. Every emitted byte is then distributed exactly as a byte sampled from
p (Leviathan et al. 2023, Appendix A.1).

Both p and q are the *filtered* distributions: temperature, top-k and top-p
are applied to the raw logits first (:func:`filtered_probs`), so the output
follows the same filtered target as plain sampling. Temperature 0 makes both
one-hot on their argmax, and the rule becomes "keep x_i iff it is argmax p_i;
otherwise emit argmax p_i" (greedy decoding, byte for byte).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from blocktrain.config import VOCAB_SIZE
from blocktrain.errors import WireError
from blocktrain.sampling import filtered_probs, sample_probs
from blocktrain.seeds import Seed
from blocktrain.serve.wire.frames import frame_number, frame_param

MAX_DRAFT = 64  # bytes: the longest draft a spec frame may ask for
MAX_WINDOWS = 64  # windows (rows) one windowed spec frame carries: n_draft + 1 (stages take 64 rows per frame)
RATE_DECAY = 0.5  # weight of the old acceptance rate in the running estimate (per traversal)
MAX_RATE = 0.95  # cap of the acceptance-rate estimate (keeps r / (1 - r) finite)


@dataclass(frozen=True)
class Verdict:
    """Outcome of one speculative step."""

    accepted: int  # draft bytes kept (0..n)
    next_byte: int  # the byte emitted after them: the correction at the first rejection, or the bonus byte

    def emitted(self, draft: list[int]) -> list[int]:
        """The bytes this step adds to the text: the kept draft prefix, then ``next_byte``."""
        return [*draft[: self.accepted], self.next_byte]


def accept_draft(draft: list[int], p: torch.Tensor, q: torch.Tensor, generator: torch.Generator) -> Verdict:
    """The speculative-sampling rule (Leviathan et al. 2023, Alg. 1; Chen et al. 2023, Alg. 2).

    draft: x_1..x_n; p (n + 1, V): target distributions p_1..p_{n+1} (p_i is the target's
    distribution of x_i, p_{n+1} that of the bonus byte); q (n, V): the draft distributions x_i was drawn from.
    Both filtered already (:func:`filtered_probs`).
    """
    n = len(draft)
    if p.shape[0] != n + 1 or q.shape[0] != n or p.shape[-1] != q.shape[-1]:
        raise ValueError(f"need p (n+1, V) and q (n, V) for a draft of n={n}, got {tuple(p.shape)} and {tuple(q.shape)}")
    for i, x in enumerate(draft):
        p_x, q_x = float(p[i, x]), float(q[i, x])
        u = float(torch.rand((), generator=generator, device=generator.device))
        if q_x <= 0.0 or u * q_x < p_x:  # u < min(1, p/q), without dividing by q
            continue
        residual = torch.clamp(p[i] - q[i], min=0.0)  # norm(max(0, p_i - q_i))
        total = float(residual.sum())
        dist = residual / total if total > 0 else p[i]  # total = 0 only by rounding (p = q): then p itself
        return Verdict(i, int(sample_probs(dist.unsqueeze(0), generator)[0]))
    return Verdict(n, int(sample_probs(p[n].unsqueeze(0), generator)[0]))


def update_rate(rate: float, accepted: int, drafted: int) -> float:
    """Running acceptance rate: RATE_DECAY * old + (1 - RATE_DECAY) * accepted / drafted (no change when nothing was drafted)."""
    if drafted <= 0:
        return rate
    return RATE_DECAY * rate + (1.0 - RATE_DECAY) * accepted / drafted


def next_draft_len(rate: float, draft_min: int, draft_max: int) -> int:
    """Draft length for an acceptance rate r: the expected run of kept bytes r / (1 - r), plus one, within the bounds.

    With independent acceptances at rate r a draft of n keeps E = r (1 - r^n) / (1 - r) bytes
    (Leviathan et al. 2023, Eq. 1); beyond about r / (1 - r) + 1 more drafting buys little.
    """
    r = min(max(rate, 0.0), MAX_RATE)
    return max(draft_min, min(draft_max, math.ceil(r / (1.0 - r) - 1e-9) + 1))  # 1e-9: 0.9 / 0.1 is 9.000000000000002


# --- the spec frame's parameters, as every serving span reads them ----------------------------
@dataclass(frozen=True)
class SpecParams:
    """What a spec frame asks of the entry stage: draft ``n_draft`` bytes under these sampling filters."""

    n_draft: int  # bytes to draft, 0..MAX_DRAFT
    temperature: float  # >= 0; 0 drafts the argmax
    top_k: int  # >= 0; 0 keeps every byte
    top_p: float  # in (0, 1]
    seed: int  # the request seed
    window: bool = False  # the text outgrew the context: x is its last ``context`` bytes, verified in windows

    @classmethod
    def read(cls, params: dict[str, Any]) -> SpecParams:
        """Validate a frame's params (raises WireError with the reason)."""
        n = frame_param(params, "n_draft", int, 0)
        if not 0 <= n <= MAX_DRAFT:
            raise WireError(f"parameter 'n_draft' must be in 0..{MAX_DRAFT}, got {n}")
        temperature = frame_number(params, "temperature", 0.0)
        if temperature < 0:
            raise WireError("parameter 'temperature' must be >= 0")
        top_k = frame_param(params, "top_k", int, 0)
        if top_k < 0:
            raise WireError("parameter 'top_k' must be >= 0")
        top_p = frame_number(params, "top_p", 1.0)
        if not 0 < top_p <= 1:
            raise WireError("parameter 'top_p' must be in (0, 1]")
        window = frame_param(params, "window", bool, False)
        if window and n + 1 > MAX_WINDOWS:
            raise WireError(f"a windowed spec frame carries n_draft + 1 windows, at most {MAX_WINDOWS}; got n_draft={n}")
        return cls(n, temperature, top_k, top_p, frame_param(params, "seed", int, 0), window)

    def draft_generator(self, accepted_len: int) -> torch.Generator:
        """The draft's draws, seeded by the request seed and the length of the accepted text."""
        return Seed.DRAFT.generator(self.seed, accepted_len)

    def draft(
        self, accepted_len: int, logits_for: Callable[[torch.Tensor], torch.Tensor], device: torch.device,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The entry stage's draft, the one loop every span drafts with: byte i is drawn from
        q_i = :func:`filtered_probs` of ``logits_for(draft[:i])``, the draft model's raw logits (256,) for the byte
        after the accepted text and the draft's first i bytes (draft[:i] (i,) int64 on ``device``, a view valid
        during the call), by :func:`sample_probs` (the argmax at temperature 0) on the generator seeded by (seed, ``accepted_len``).

        Nothing comes back to the host: each byte stays on ``device`` and feeds the next step there (the noise
        comes from the host's seeded generator). Returns the draft (n,) int64 and the tensors the frame carries on
        to the client, ``draft`` (1, n) uint8 and ``q`` (n, 256), all on ``device``; no tensors when n = 0.
        """
        g = self.draft_generator(accepted_len)
        draft = torch.zeros(self.n_draft, dtype=torch.int64, device=device)  # (n,) filled byte by byte
        qs: list[torch.Tensor] = []
        for i in range(self.n_draft):
            q = filtered_probs(logits_for(draft[:i]).unsqueeze(0), self.temperature, self.top_k, self.top_p)  # (1, 256)
            draft[i] = (q.argmax(dim=-1) if self.temperature <= 0 else sample_probs(q, g))[0]  # greedy draws nothing
            qs.append(q[0])
        if not qs:
            return draft, {}
        return draft, {"draft": draft.to(torch.uint8).unsqueeze(0), "q": torch.stack(qs)}


def windows_in_half_frame(context: int, width: int, max_frame_bytes: int) -> int:
    """How many windows of ``context`` positions fill at most half a frame with an fp32 tensor ``width`` wide each."""
    return max_frame_bytes // (2 * 4 * max(context, 1) * max(width, 1))


def windowed_draft_cap(context: int, d_model: int, max_frame_bytes: int) -> int:
    """The longest draft of a windowed spec frame: n_draft + 1 windows of ``context`` positions whose fp32 state
    (context x d_model) fills at most half a frame, and at most MAX_WINDOWS windows."""
    return max(0, min(MAX_WINDOWS, windows_in_half_frame(context, d_model, max_frame_bytes)) - 1)


def windows(text: torch.Tensor, draft: torch.Tensor, context: int) -> torch.Tensor:
    """The windowed frame's rows (n + 1, context), on the text's device: row i is the last ``context`` bytes of the
    text and the draft's first i bytes, the window local ``generate`` reads the byte after them from. text
    (context,) is the text's last ``context`` bytes (what a windowed frame carries), draft (n,) its draft."""
    if text.shape != (context,):
        raise ValueError(f"a windowed frame's text is its last {context} bytes, got shape {tuple(text.shape)}")
    return torch.cat([text, draft.to(text.dtype)]).unfold(0, context, 1).contiguous()  # (n + 1, context): row i from byte i


def validate_carried_draft(tensors: dict[str, torch.Tensor], n: int) -> None:
    """Spec frames past the entry stage carry the draft (1, n) and q (n, 256) on to the client."""
    if n == 0:
        return
    draft, q = tensors.get("draft"), tensors.get("q")
    if draft is None or tuple(draft.shape) != (1, n) or q is None or tuple(q.shape) != (n, VOCAB_SIZE):
        raise WireError(f"spec frames past the entry carry 'draft' (1, {n}) and 'q' ({n}, {VOCAB_SIZE})")
