"""Named presets: plain functions returning a :class:`RunConfig`.

``tiny`` runs in seconds for tests, ``cpu_mini`` in minutes for iteration, ``cpu_quick`` is the main job's default,
``cpu_small`` is the committed CPU benchmark, ``cpu_small_long`` its 4x budget,
``paper`` is GPU scale. Every preset but ``tiny`` trains the ``stack`` objective,
which beat ``diffusion`` on cpu-small (benchmarks/results/quality-cpu-small.md);
``tiny`` keeps ``diffusion`` because most of the test suite exercises the paper's
method through it (pass ``--objective stack`` for a tiny stack).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from blocktrain.config import DiffusionConfig, ModelConfig, Objective, RunConfig, StackConfig, StackInit, TrainConfig
from blocktrain.errors import ConfigError


def recipe() -> DiffusionConfig:
    """The default noise recipe of every preset: sigma in [5, 50], equal-probability slices.

    The method's textbook range [1, 10] lets low-sigma blocks learn to read the
    target off z, so at inference they trust the chain's own soft guess and the
    chain ends up worse than its first block alone (cpu-mini: 2.604 against
    2.347 nats/byte). At [5, 50] every block stays a full language model and
    the chain scores 2.346, within 0.02 of its best block alone. See
    benchmarks/results/ablation.md for every recipe measured.
    """
    return DiffusionConfig(sigma_min=5.0, sigma_max=50.0)


def stack_recipe() -> StackConfig:
    """The stack recipe of every stack preset: block k starts as a copy of block k-1 (layers and head), and the
    step budget leans towards the cheap early blocks (step_ratio 0.7 at the same training FLOPs).

    The winner of issue 18's ablation on validation (benchmarks/results/depth-ablation.md, depth-proxy preset,
    test figures): composed CE 1.701 -> 1.533, gain over the first prefix +0.088 -> +0.118, gap to the E2E at
    matched FLOPs +0.075 -> -0.092 at the shared lr 2e-3 (+0.036 against the E2E at the best lr found, 8e-3).
    Copy alone: 1.605 (gain +0.184); the step split alone: 1.604 (gain +0.048).
    The dataclass defaults stay ``fresh`` and 1.0, which is what runs written before it used.
    """
    return StackConfig(init=StackInit.COPY, step_ratio=0.7)


def _stack(name: str, model: ModelConfig, train: TrainConfig) -> RunConfig:
    """A preset training the stack objective with the shared noise and stack recipes."""
    return RunConfig(name=name, objective=Objective.STACK, model=model, diffusion=recipe(), stack=stack_recipe(), train=train)


def tiny() -> RunConfig:
    """Seconds on one CPU core; used by the test suite.

    Its benchmarks score the first 64 KiB of the test split (``test_bytes``), not all 1.26 MB: a 32-wide model
    trained for 20 steps tells nothing more on the rest, and scoring it all took four of the bench's five minutes.
    """
    return RunConfig(
        name="tiny",
        model=ModelConfig(d_model=32, n_heads=2, n_layers=4, n_blocks=4, context=32, mlp_ratio=2),
        diffusion=recipe(),
        train=TrainConfig(
            steps=20, batch_size=4, lr=3e-3, warmup_steps=2, checkpoint_every=10, log_every=5, eval_bytes=2048,
            test_bytes=65536,
        ),
    )


def cpu_mini() -> RunConfig:
    """A few minutes per side on 2 CPU cores; for iterating on recipes."""
    return _stack(
        "cpu-mini",
        ModelConfig(d_model=128, n_heads=4, n_layers=8, n_blocks=4, context=128),
        TrainConfig(steps=400, batch_size=16, lr=2e-3, warmup_steps=30, checkpoint_every=100),
    )


def cpu_quick() -> RunConfig:
    """The default of ``scripts/main.sh``: the whole job (lr sweeps, E2E, stack, diffusion) within 15 minutes on 2
    CPU cores, installation included.

    cpu-mini's width and depth at half its context and 200 steps per arm. Its benchmark scores the first 96 KiB
    of the test split (``test_bytes``): the whole split, scored by every arm, would take longer than the training.
    lr 3e-3 centres the sweep (x0.5, x1, x2) on what two measurements found: at 250 steps and lr 2e-3 both E2E
    and stack block 0 chose the sweep's top (4e-3); at 200 steps and lr 4e-3 both chose its bottom (2e-3).
    ``cpu-small`` is the committed benchmark and scores the whole split.
    """
    base = cpu_mini()
    train = replace(base.train, steps=200, lr=3e-3, warmup_steps=20, eval_bytes=32768, test_bytes=98304)
    return replace(base, name="cpu-quick", model=replace(base.model, context=64), train=train)


def cpu_small() -> RunConfig:
    """The committed CPU benchmark shape (d=256, 4 heads, L=8, B=4, T=256)."""
    return _stack(
        "cpu-small",
        ModelConfig(d_model=256, n_heads=4, n_layers=8, n_blocks=4, context=256),
        TrainConfig(steps=600, batch_size=16, lr=1e-3, warmup_steps=50, checkpoint_every=100),
    )


def cpu_small_long() -> RunConfig:
    """The cpu-small shape at 4x the steps (2,400 per side): the budget at which depth starts to matter.

    lr 2e-3 is what the cpu-small sweep chose for both the E2E and stack block 0
    (benchmarks/results/quality-cpu-small.md); the 4x warm-up is the one E2E
    recipe change that helped on cpu-mini (benchmarks/results/e2e-recipe-cpu-mini.json),
    applied to every arm.
    """
    base = cpu_small()
    train = replace(base.train, steps=2400, lr=2e-3, warmup_steps=4 * base.train.warmup_steps, checkpoint_every=200)
    return replace(base, name="cpu-small-long", train=train)


def depth_proxy() -> RunConfig:
    """A cheap stand-in for cpu-small-long's depth problem (issue 18): a narrow, short-context model trained long.

    d=64, T=64 and 2,000 steps per block saturate the 2-layer first prefix the
    way 2,400 steps saturate cpu-small's, at about a twentieth of the cost. The
    proof that it shows the long-budget pattern (gain < 0.05, gap at matched
    FLOPs > 0.05) is its baseline row in benchmarks/results/depth-ablation.md.
    """
    return _stack(
        "depth-proxy",
        ModelConfig(d_model=64, n_heads=2, n_layers=8, n_blocks=4, context=64),
        TrainConfig(steps=2000, batch_size=16, lr=2e-3, warmup_steps=100, checkpoint_every=500, eval_bytes=32768),
    )


def paper() -> RunConfig:
    """GPU scale, as in the paper's byte-level WikiText runs."""
    return _stack(
        "paper",
        ModelConfig(d_model=768, n_heads=12, n_layers=16, n_blocks=4, context=512),
        TrainConfig(steps=20000, batch_size=64, lr=6e-4, warmup_steps=500, checkpoint_every=1000, eval_every=1000),
    )


PRESETS: dict[str, Callable[[], RunConfig]] = {
    "tiny": tiny,
    "cpu-mini": cpu_mini,
    "cpu-quick": cpu_quick,
    "cpu-small": cpu_small,
    "cpu-small-long": cpu_small_long,
    "depth-proxy": depth_proxy,
    "paper": paper,
}


def get_preset(name: str) -> RunConfig:
    """Return the preset called ``name`` or raise a ConfigError listing the choices."""
    try:
        return PRESETS[name]()
    except KeyError:
        raise ConfigError(f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}") from None
