"""The serving modes' rules, in one table keyed by :class:`~blocktrain.serve.wire.frames.Mode`.

The gateway (which request fields a mode takes, whether prompt and continuation must fit one window) and the
client (``decoding.decode``: whether a mode's loop samples with top_p) both read :data:`MODE_RULES`; nothing else
decides these by the mode's name. Which modes a pipeline runs is what its entry stage reports (``modes`` in the
PONG), not this table.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from blocktrain.errors import ServeError
from blocktrain.serve.wire.frames import Mode


@dataclass(frozen=True)
class ModeRules:
    """What one generation mode takes and how its text relates to the model's context."""

    top_p: bool  # samples with a nucleus (top_p < 1); else top_k alone
    draft: bool  # takes draft_min / draft_max (the bounds of the adaptive draft length)
    sweeps: bool  # takes sweeps (traversals per continuation)
    slides: bool  # prompt and continuation may outgrow the context: the window slides as local ``generate``'s does;
    # else prompt + continuation must fit one window

    def fits(self, prompt_len: int, n_new: int, context: int) -> bool:
        """Whether a prompt of ``prompt_len`` bytes (an empty one counts 1) and ``n_new`` new bytes can run."""
        return self.slides or n_new == 0 or max(prompt_len, 1) + n_new <= context


MODE_RULES: Mapping[Mode, ModeRules] = MappingProxyType({  # the order: how errors list them
    Mode.SPEC: ModeRules(top_p=True, draft=True, sweeps=False, slides=True),
    Mode.AR: ModeRules(top_p=True, draft=False, sweeps=False, slides=True),
    Mode.SWEEP: ModeRules(top_p=False, draft=False, sweeps=True, slides=False),
    Mode.BASELINE: ModeRules(top_p=True, draft=False, sweeps=False, slides=True),
})
GENERATION_MODES: tuple[Mode, ...] = tuple(MODE_RULES)  # the modes a client may ask for (score is not one)


def generation_mode(name: str) -> Mode:
    """A mode's name -> the Mode; ServeError naming the modes when it is not one."""
    for mode in GENERATION_MODES:
        if mode.value == name:
            return mode
    raise ServeError(f"unknown serving mode {name!r}; use one of {', '.join(m.value for m in GENERATION_MODES)}")


def modes_taking(what: str) -> str:
    """The names of the modes whose rules set ``what`` (a ModeRules field), for error messages."""
    return ", ".join(m.value for m, r in MODE_RULES.items() if getattr(r, what))
