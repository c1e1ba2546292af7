"""The seed registry: distinct roles and indices never derive the same seed."""

from __future__ import annotations

import itertools

from blocktrain.data.stream import mix_seed
from blocktrain.seeds import E2E_INIT, E2E_STREAM, GATE_STREAM, Seed, block_stream, gate_stream, init_seed, worker_stream

ARITY = {Seed.CHAIN: 1, Seed.SAMPLER: 0, Seed.BYTE: 1, Seed.DRAFT: 1, Seed.SWEEP_NOISE: 1, Seed.SWEEP_ESTIMATE: 2,
         Seed.GATEWAY_CHOICE: 1, Seed.REFERENCE: 1, Seed.RANDOM_BLOCK: 1, Seed.RANDOM_LAYER: 1, Seed.RANDOM_EMBED: 0,
         Seed.RANDOM_HEAD: 0}


def test_every_role_has_an_arity() -> None:
    assert set(ARITY) == set(Seed)


def test_roles_and_indices_never_collide() -> None:
    """Every role at indices 0..N-1 (pairs for two-index roles) under two bases: all seeds distinct."""
    seen: dict[int, tuple[object, ...]] = {}
    for base, role in itertools.product((0, 12345), Seed):
        for idx in itertools.product(range(1001 if ARITY[role] == 1 else 32), repeat=ARITY[role]):
            key = (base, role.name, *idx)
            seed = role.derive(base, *idx)
            assert seed not in seen, f"{key} collides with {seen[seed]}"
            seen[seed] = key


def test_the_old_offsets_collided_and_the_roles_do_not() -> None:
    """Sweep 900's noise once used offset 100 + 900 = 1000, the estimate of sweep 0 after block 0 (1000 + 0 + 0)."""
    assert mix_seed(3, 100 + 900) == mix_seed(3, 1000 + 0 * 1000 + 0)
    assert Seed.SWEEP_NOISE.derive(3, 900) != Seed.SWEEP_ESTIMATE.derive(3, 0, 0)
    assert Seed.CHAIN.derive(3, 7) != Seed.SAMPLER.derive(3)  # chain 7 was the sampler's seed (offset 7)


def test_chain_seeds_keep_the_committed_form() -> None:
    assert Seed.CHAIN.derive(9, 2) == mix_seed(9, 2)


def test_stream_ids_keep_their_committed_values() -> None:
    """The training streams' ids and init seeds are fixed: committed runs replay bit for bit."""
    assert (E2E_STREAM, E2E_INIT, GATE_STREAM) == (999_999, 77, 7_777)
    assert block_stream(3) == 3000 and block_stream(3, 5) == 3005
    assert init_seed(2, 3) == 2 * 1009 + 3
    assert worker_stream(4, 1, 9) == mix_seed(4, 1, 9)
    assert gate_stream(2) == mix_seed(7_777, 2)
