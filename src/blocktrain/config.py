"""Typed, frozen configuration.

Four dataclasses describe a run: :class:`ModelConfig` (shapes),
:class:`DiffusionConfig` (noise range, partition, sampler; the ``diffusion``
objective), :class:`StackConfig` (the ``stack`` objective's local heads) and
:class:`TrainConfig` (optimisation, precision, schedule). :class:`RunConfig`
bundles them with the block ``objective``. Every
``__post_init__`` rejects bad values with a :class:`~blocktrain.errors.ConfigError`
that names the field. Presets live in :mod:`blocktrain.presets`.
"""

from __future__ import annotations

import enum
import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from blocktrain.errors import ConfigError

VOCAB_SIZE = 256  # byte-level: one symbol per byte value
# train.seed < SEED_LIMIT: seeds.init_seed (seed * 1009 + role) must fit torch.manual_seed's 64 bits, and
# data.stream.mix_seed packs the seed as a signed 64-bit integer: every seed a stored run could have trained with
# (a larger one failed in those two), about 1.8e16
SEED_LIMIT = (2**64 - 1009) // 1009 + 1


class Slicing(enum.Enum):
    """How the noise range [sigma_min, sigma_max] is cut into B slices."""

    EQUAL_PROB = "equal_prob"  # equal mass under the truncated log-normal
    LOG_UNIFORM = "log_uniform"  # equal width in ln(sigma)


class Readout(enum.Enum):
    """Where p(next byte) is read off the chain."""

    LAST_STEP = "last_step"  # logits of the last block's final Euler evaluation
    SIGMA_MIN = "sigma_min"  # one extra evaluation of the last block at sigma_min


class LossWeighting(enum.Enum):
    """Per-sample weight lambda(sigma) applied to the cross-entropy."""

    EDM = "edm"  # lambda = (sigma^2 + sigma_data^2) / (sigma * sigma_data)^2, mean-normalised
    UNIFORM = "uniform"  # lambda = 1


class Objective(enum.StrEnum):
    """The built-in block objectives: what each block is trained to do, and how blocks compose.

    :mod:`blocktrain.objectives` maps a run's objective name to its implementation; more can be registered there
    (:func:`blocktrain.objectives.register_objective`), so a run config holds the name as a string.
    """

    DIFFUSION = "diffusion"  # EDM denoiser of the next byte's embedding; blocks pass z along an Euler chain
    STACK = "stack"  # residual-stream stack; block k reads block k-1's h and has its own next-byte head


# Names a run config may choose: the built-ins, and plug-ins that blocktrain.objectives.register_objective adds.
OBJECTIVE_NAMES: set[str] = {o.value for o in Objective}


class Precision(enum.Enum):
    """Arithmetic of the forward/backward pass. Master weights and AdamW state are always fp32."""

    BF16 = "bf16"  # bf16 autocast for matmuls and attention; log-softmax / CE in fp32
    FP32 = "fp32"  # everything in fp32


class CompileMode(enum.Enum):
    """torch.compile of the modules a training step runs: the trained module and the frozen blocks it reads."""

    OFF = "off"  # eager
    DEFAULT = "default"  # inductor: fused elementwise and normalisation kernels
    REDUCE_OVERHEAD = "reduce-overhead"  # inductor plus CUDA graphs: a step's kernels launched as a few graphs (CUDA)
    MAX_AUTOTUNE = "max-autotune"  # inductor, matmul kernels tuned per shape (minutes of compilation)


class FrozenStorage(enum.Enum):
    """How a worker stores its frozen copies of the earlier blocks it reads (their matmul weights)."""

    AUTO = "auto"  # bf16 when the worker computes in bf16, else fp32
    FP32 = "fp32"  # as trained
    BF16 = "bf16"  # half the memory; computed in the worker's arithmetic
    INT8 = "int8"  # a quarter: per-output-row absmax scale, dequantised layer by layer in the forward


class Schedule(enum.Enum):
    """When block k of a ``stack`` run may train, relative to blocks 0..k-1."""

    PROGRESSIVE = "progressive"  # block k opens when block k-1 has finished its step budget
    CONCURRENT = "concurrent"  # every block trains at once; frozen copies refreshed every R rounds


class StackHead(enum.Enum):
    """How block k > 0 of a ``stack`` turns its residual stream into logits (issue 18, lever 1)."""

    PRIVATE = "private"  # its own head, trained from scratch
    SHARED = "shared"  # a frozen copy of block 0's head: one logit space, fixed once block 0 has finished
    RESIDUAL = "residual"  # block k-1's head, frozen, plus a zero-initialised head of its own (boosting in one logit space)


class StackDense(enum.Enum):
    """What block k > 0 of a ``stack`` reads (issue 18, lever 3; a depth-weighted average as in DenseFormer)."""

    OFF = "off"  # h_k, the output of block k-1
    EMBED = "embed"  # a learned mix of the embeddings h_0 and h_k
    ALL = "all"  # a learned mix of h_0 and every earlier block's output h_1..h_k


class StackInit(enum.Enum):
    """How block k > 0 of a ``stack`` is initialised (issue 18, lever 4)."""

    FRESH = "fresh"  # random, like block 0
    COPY = "copy"  # block k-1's layers and head (progressive stacking, Gong et al. 2019)
    IDENTITY = "identity"  # residual branches zeroed and block k-1's head: prefix k starts equal to prefix k-1


class Solver(enum.Enum):
    """ODE solver used along the chain."""

    EULER = "euler"  # first order, one evaluation per step (Karras et al. 2022, Alg. 1 w/o 2nd order)
    HEUN = "heun"  # second order, two evaluations per step except the last


def _check(cond: bool, name: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{name}: {msg}")


def _check_all(cfg: Any, test: Callable[[Any], bool], rule: str, *names: str) -> None:
    """Every named field of ``cfg`` passes ``test``, else a ConfigError: the field ``must be {rule}``."""
    for name in names:
        value = getattr(cfg, name)
        _check(test(value), name, f"must be {rule}, got {value}")


def _enum_fields(cls: Any) -> dict[str, type[enum.Enum]]:
    """The fields of a config dataclass that hold an enum, and its type."""
    return {f.name: type(f.default) for f in fields(cls) if isinstance(f.default, enum.Enum)}


def _check_enums(cfg: Any) -> None:
    for name, expected in _enum_fields(cfg).items():
        value = getattr(cfg, name)
        _check(isinstance(value, expected), name, f"must be a {expected.__name__}, got {value!r}")


@dataclass(frozen=True)
class ModelConfig:
    """Shapes of the byte-level Transformer that is cut into blocks."""

    d_model: int = 256  # width of every layer, in features
    n_heads: int = 4  # attention heads per layer
    n_layers: int = 8  # total depth L of the whole model, in layers
    n_blocks: int = 4  # number of blocks B; each block holds L/B layers
    context: int = 256  # context length T, in bytes
    mlp_ratio: int = 4  # MLP hidden width as a multiple of d_model
    embed_seed: int = 1234  # seed of the frozen target embedding E (shared by all blocks)

    def __post_init__(self) -> None:
        _check_all(self, lambda v: v > 0, "positive", "d_model", "n_heads", "n_layers", "n_blocks", "mlp_ratio")
        _check(
            self.d_model % self.n_heads == 0,
            "d_model",
            f"{self.d_model} is not divisible by n_heads={self.n_heads}",
        )
        _check(
            self.n_layers % self.n_blocks == 0,
            "n_blocks",
            f"B={self.n_blocks} does not divide L={self.n_layers}; choose B among the divisors of L",
        )
        _check(self.context >= 2, "context", f"must be at least 2 bytes, got {self.context}")

    @property
    def layers_per_block(self) -> int:
        return self.n_layers // self.n_blocks


@dataclass(frozen=True)
class DiffusionConfig:
    """Noise range, its partition into slices, the loss and the sampler."""

    sigma_min: float = 1.0  # lowest noise level, in units of ||E[y]|| (=1)
    sigma_max: float = 10.0  # highest noise level, same unit
    p_mean: float = -1.2  # mean of ln(sigma) of the log-normal (EDM P_mean)
    p_std: float = 1.2  # std of ln(sigma) of the log-normal (EDM P_std)
    sigma_data: float = 0.5  # data std used by the EDM preconditioning
    overlap: float = 0.1  # gamma: slice widening, as a fraction of the slice's probability mass
    slicing: Slicing = Slicing.EQUAL_PROB  # how slices are cut
    steps_per_block: int = 1  # solver steps each block takes at inference
    solver: Solver = Solver.EULER  # Euler or Heun steps along the chain
    readout: Readout = Readout.LAST_STEP  # where p(next byte) is read
    loss_weighting: LossWeighting = LossWeighting.EDM  # lambda(sigma) in the weighted CE

    def __post_init__(self) -> None:
        _check(self.sigma_min > 0, "sigma_min", f"must be > 0, got {self.sigma_min}")
        _check(
            self.sigma_min < self.sigma_max,
            "sigma_min",
            f"sigma_min={self.sigma_min} must be smaller than sigma_max={self.sigma_max}",
        )
        _check(self.p_std > 0, "p_std", f"must be > 0, got {self.p_std}")
        _check(self.sigma_data > 0, "sigma_data", f"must be > 0, got {self.sigma_data}")
        _check(0.0 <= self.overlap < 1.0, "overlap", f"must be in [0, 1), got {self.overlap}")
        _check(self.steps_per_block >= 1, "steps_per_block", f"must be >= 1, got {self.steps_per_block}")
        _check_enums(self)
        # inf passed the comparisons above: NaN slice edges
        _check_all(self, math.isfinite, "finite", "p_mean", "sigma_max", "sigma_data", "p_std")


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation of one block or of the E2E reference."""

    steps: int = 600  # optimiser steps per block (and for the E2E run)
    batch_size: int = 16  # sequences per step
    lr: float = 1e-3  # peak AdamW learning rate
    min_lr_ratio: float = 0.1  # final LR as a fraction of the peak (cosine decay)
    warmup_steps: int = 50  # linear warm-up, in steps
    weight_decay: float = 0.1  # AdamW decoupled weight decay
    grad_clip: float = 1.0  # global gradient-norm clip; 0 disables
    seed: int = 0  # seed of data order, noise and init
    checkpoint_every: int = 200  # steps between checkpoints
    log_every: int = 10  # steps between JSONL metric lines
    eval_bytes: int = 65536  # validation bytes scored at each periodic eval (0 = off)
    eval_every: int = 0  # steps between periodic validation evals (0 = only at the end)
    test_bytes: int = 0  # test bytes the benchmarks score, from the split's start (0 = the whole split)
    precision: Precision = Precision.BF16  # forward/backward arithmetic (falls back to fp32 where bf16 is unsupported)
    device: str = "auto"  # "auto" (cuda if available, else cpu), "cpu", "cuda" or "cuda:N"
    schedule: Schedule = Schedule.PROGRESSIVE  # stack objective: when block k may train
    frozen_storage: FrozenStorage = FrozenStorage.AUTO  # stack objective: storage of the frozen earlier blocks' weights
    recompute: bool = False  # activation checkpointing: layers keep only their input, recompute in the backward
    compile: CompileMode = CompileMode.OFF  # torch.compile of the step's modules (bench speed --compile measures it)
    profile_steps: int = 0  # steps profiled by torch.profiler at the end of the run (0 = none): metrics/NAME.profile.*
    round_steps: int = 10  # concurrent schedule: optimiser steps per round, per block
    refresh_rounds: int = 1  # concurrent schedule: rounds between refreshes of the frozen copies

    def __post_init__(self) -> None:
        _check_all(self, lambda v: v >= 0, ">= 0", "steps", "warmup_steps", "weight_decay", "grad_clip", "eval_bytes",
                   "eval_every", "test_bytes", "profile_steps")
        _check_all(self, lambda v: v > 0, "positive", "batch_size", "checkpoint_every", "log_every", "round_steps",
                   "refresh_rounds")
        _check(self.lr > 0, "lr", f"must be > 0, got {self.lr}")
        _check_all(self, math.isfinite, "finite", "lr", "weight_decay", "grad_clip")  # inf passed the comparisons
        _check(0 <= self.min_lr_ratio <= 1, "min_lr_ratio", f"must be in [0, 1], got {self.min_lr_ratio}")
        _check(0 <= self.seed < SEED_LIMIT, "seed", f"must be in [0, {SEED_LIMIT}), got {self.seed}; set --seed N in that range")
        _check_enums(self)
        _check(
            isinstance(self.device, str) and (self.device in ("auto", "cpu") or self.device.startswith("cuda")),
            "device",
            f"must be auto, cpu, cuda or cuda:N, got {self.device!r}",
        )


@dataclass(frozen=True)
class StackConfig:
    """The ``stack`` objective: every block has a private next-byte head."""

    head_layers: int = 0  # private Transformer layers in each block's local head, before LayerNorm + Linear(d, 256)
    aux_layers: int = 0  # extra Transformer layers in the heads of blocks 0..B-2 only: a training-time decoder, not in the composed model
    head: StackHead = StackHead.PRIVATE  # block k > 0's head: private, a frozen copy of block 0's, or residual on block k-1's
    init: StackInit = StackInit.FRESH  # block k > 0's initial weights: fresh, a copy of block k-1, or identity branches
    dense: StackDense = StackDense.OFF  # block k > 0's input: h_k, or a learned mix with the embeddings or every earlier output
    step_ratio: float = 1.0  # steps of block k+1 over block k's, rescaled to the FLOPs of train.steps per block
    lr_later: float = 1.0  # peak lr of blocks 1..B-1 as a fraction of train.lr (block 0's): a gentler fine-tune of a copy

    def __post_init__(self) -> None:
        _check(0 <= self.head_layers <= 8, "head_layers", f"must be in [0, 8], got {self.head_layers}")
        _check(0 <= self.aux_layers <= 8, "aux_layers", f"must be in [0, 8], got {self.aux_layers}")
        _check_enums(self)
        _check(
            self.aux_layers == 0 or self.head is StackHead.PRIVATE, "aux_layers",
            f"a training-time decoder needs private heads; with head={self.head.value} block 0's decoder would enter "
            "every later prefix. Pass --aux-layers 0 or --head private",
        )
        _check(
            self.head_layers == 0 or self.head is not StackHead.RESIDUAL, "head_layers",
            "a residual head adds block k-1's frozen head, which serving runs position by position; "
            "pass --head-layers 0 with --head residual",
        )
        _check(0.25 <= self.step_ratio <= 4.0 and math.isfinite(self.step_ratio), "step_ratio",
               f"must be in [0.25, 4], got {self.step_ratio}")
        _check(0.05 <= self.lr_later <= 4.0 and math.isfinite(self.lr_later), "lr_later",
               f"must be in [0.05, 4] (a fraction of train.lr), got {self.lr_later}")


@dataclass(frozen=True)
class RunConfig:
    """Everything that defines a run; serialised into every checkpoint."""

    name: str  # preset name this config came from (informational)
    model: ModelConfig = field(default_factory=ModelConfig)  # shapes
    diffusion: DiffusionConfig = field(default_factory=DiffusionConfig)  # noise and sampler (diffusion objective)
    train: TrainConfig = field(default_factory=TrainConfig)  # optimisation
    # Runs written before the objective existed are diffusion runs, hence this default; presets name it.
    objective: str = Objective.DIFFUSION  # name of a registered block objective (the built-ins: Objective)
    stack: StackConfig = field(default_factory=StackConfig)  # local heads (stack objective)
    dataset: str = ""  # sha256 fingerprint of the dataset the run trains on ("" = not recorded)

    def __post_init__(self) -> None:
        _check(bool(self.name), "name", "must be a non-empty string")
        _check(self.dataset == "" or (len(self.dataset) == 64 and all(c in "0123456789abcdef" for c in self.dataset)),
               "dataset", "must be a 64-hex-digit fingerprint or empty")
        _check(isinstance(self.objective, str) and self.objective in OBJECTIVE_NAMES, "objective",
               f"must name a known objective ({', '.join(sorted(OBJECTIVE_NAMES))}), got {self.objective!r}; a plug-in "
               "objective must be registered first (blocktrain.objectives.register_objective)")
        if self.objective in Objective.__members__.values():  # a built-in: its enum member, so `is` comparisons hold
            object.__setattr__(self, "objective", Objective(self.objective))

    # --- serialisation -------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        def enc(obj: Any) -> Any:
            if isinstance(obj, enum.Enum):
                return obj.value
            if isinstance(obj, dict):
                return {k: enc(v) for k, v in obj.items()}
            return obj

        return enc(asdict(self))

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunConfig:
        try:
            return cls(
                name=str(data["name"]),
                model=_build(ModelConfig, data["model"]),
                diffusion=_build(DiffusionConfig, data["diffusion"]),
                train=_build(TrainConfig, data["train"]),
                objective=str(data.get("objective", Objective.DIFFUSION)),
                stack=_build(StackConfig, data.get("stack", {})),
                dataset=str(data.get("dataset", "")),
            )
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, ConfigError):
                raise
            raise ConfigError(f"malformed run config: {exc}") from exc

    @classmethod
    def from_json(cls, text: str) -> RunConfig:
        try:
            return cls.from_dict(json.loads(text))
        except json.JSONDecodeError as exc:
            raise ConfigError(f"run config is not valid JSON: {exc}") from exc

    def architecture_key(self) -> str:
        """JSON of the fields that must agree between blocks of one model: shapes, objective and its settings."""
        d = self.to_dict()
        # the objective's own settings section ({} for a registered objective with none); a stack's init, step
        # split and later blocks' lr are how its blocks were trained, not what they are: never part of the key
        recipe = ("init", "step_ratio", "lr_later")
        own = {k: v for k, v in d.get(str(self.objective), {}).items() if k not in recipe}
        return json.dumps({"model": d["model"], "objective": str(self.objective), str(self.objective): own}, sort_keys=True)

    def with_dataset(self, fingerprint: str) -> RunConfig:
        """This config recording the dataset it trains on."""
        return replace(self, dataset=fingerprint)

    def with_train(self, **changes: Any) -> RunConfig:
        return replace(self, train=replace(self.train, **changes))


def _build(cls: type, data: dict[str, Any]) -> Any:
    known = {f.name for f in fields(cls)}
    unknown = set(data) - known
    if unknown:
        raise ConfigError(f"{cls.__name__}: unknown fields {sorted(unknown)}")
    enums = _enum_fields(cls)
    return cls(**{k: (enums[k](v) if k in enums else v) for k, v in data.items()})
