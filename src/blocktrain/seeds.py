"""One registry of the roles a seed is derived for, so that no two roles can draw the same numbers.

Every derived seed is ``mix_seed(base, role, len(indices), *indices)`` (:meth:`Seed.derive`): two derivations
hash the same integers only if their roles and indices are equal, since ``mix_seed`` packs each integer in 8
bytes. The one exception is :attr:`Seed.CHAIN`, ``mix_seed(base, c)``
(two integers, every tagged seed has three or more), the form the committed evaluations drew their noise with.
Role values lie above 2**40, far from the training streams' ids; the training streams themselves
(:mod:`blocktrain.data.stream`: ``block_stream``, ``init_seed``, ``TrainStream``) are not derived here.
"""

from __future__ import annotations

import enum

import torch

from blocktrain.data.stream import mix_seed

_TAG = 0x5EED << 40  # role values sit above every stream id and small index


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
