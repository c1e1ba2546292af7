"""One registry of the roles a seed is derived for, so that no two roles can draw the same numbers.

Every derived seed is ``mix_seed(base, role, len(indices), *indices)`` (:meth:`Seed.derive`): two derivations
hash the same integers only if their roles and indices are equal, since ``mix_seed`` packs each integer in 8
bytes. The one exception is :attr:`Seed.CHAIN`, ``mix_seed(base, c)``
(two integers, every tagged seed has three or more), the form the committed evaluations drew their noise with.
Role values lie above 2**40, far from the training streams' ids, which are registered here too (their values
fixed, so that committed runs replay bit for bit): :func:`block_stream`, :data:`E2E_STREAM`, :func:`worker_stream`,
:func:`gate_stream`, and the initialisation seeds :func:`init_seed`.
"""

from __future__ import annotations

import enum

import torch

from blocktrain.data.stream import mix_seed

_TAG = 0x5EED << 40  # role values sit above every stream id and small index

E2E_STREAM = 999_999  # stream id of the E2E reference's data (distinct from every block's)
E2E_INIT = 77  # role of the E2E reference in init_seed
GATE_STREAM = 7_777  # base of the loss gate's held-out stream ids (gate_stream)


def block_stream(k: int, sub: int = 0) -> int:
    """Stream id of block k's data; ``sub`` separates several streams of one block (workers, rounds)."""
    return 1000 * k + sub


def worker_stream(worker: int, k: int, v: int) -> int:
    """Stream id the coordinator hands worker ``worker`` (its store id) for round v of block k."""
    return mix_seed(worker, k, v)


def gate_stream(k: int) -> int:
    """Stream id of the loss gate's held-out batch for block k."""
    return mix_seed(GATE_STREAM, k)


def init_seed(seed: int, role: int) -> int:
    """torch.manual_seed value for initialising block ``role`` (or E2E_INIT) of a run seeded ``seed``."""
    return seed * 1009 + role


class Seed(enum.IntEnum):
    """A seed's role, and (in the comment) the indices it is derived with."""

    CHAIN = 0  # (c): z_0 noise of chain c of a scored window (AssembledModel.log_probs, score/ar/spec stages)
    SAMPLER = _TAG + 1  # (): the byte sampler of a generation (local generate, ar, baseline, spec acceptance)
    BYTE = _TAG + 2  # (i): the seed byte i of a generation scores its window with (its chains' base)
    DRAFT = _TAG + 3  # (accepted length): a spec draft's draws at the entry stage
    SWEEP_NOISE = _TAG + 4  # (s): z_0 noise of sweep s
    SWEEP_ESTIMATE = _TAG + 5  # (s, k): the estimate sampled after block k in sweep s
    GATEWAY_CHOICE = _TAG + 6  # (i): choice i > 0 of a gateway request (n > 1)
    REFERENCE = _TAG + 7  # (k): noise of diffusion block k scored alone (single-block reference)
    RANDOM_BLOCK = _TAG + 8  # (k): random weights of block k (serve --random)
    RANDOM_LAYER = _TAG + 9  # (i): random weights of E2E layer i (serve --random --model e2e)
    RANDOM_EMBED = _TAG + 10  # (): random E2E embeddings
    RANDOM_HEAD = _TAG + 11  # (): random E2E head

    def derive(self, base: int, *indices: int) -> int:
        """The seed of this role at ``indices`` under ``base`` (a run's or a request's seed)."""
        if self is Seed.CHAIN:
            return mix_seed(base, *indices)
        return mix_seed(base, self, len(indices), *indices)  # three integers at least

    def generator(self, base: int, *indices: int) -> torch.Generator:
        """A CPU generator seeded with :meth:`derive`."""
        return torch.Generator().manual_seed(self.derive(base, *indices))
