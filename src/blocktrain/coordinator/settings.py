"""Coordinator settings (aggregation and outer step included) and the lifecycles of workers, rounds and updates."""

from __future__ import annotations

import enum
import math
import typing
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from blocktrain.errors import ConfigError
from blocktrain.protocol.delta import Compression
from blocktrain.protocol.moments import InnerStart, MomentCodec


class Aggregation(enum.Enum):
    MEAN = "mean"  # sample-weighted mean
    MEDIAN = "median"  # coordinate-wise median (robust)
    TRIMMED_MEAN = "trimmed_mean"  # coordinate-wise trimmed mean (robust)
    AGREE_MEAN = "agree_mean"  # the mean scaled by per-coordinate sign agreement (a measured lever, averaging-scaling.md)


NESTEROV_LR = 0.7  # the default outer lr of Nesterov (mu 0.5) on shared moments: 0.80 of the 6x-batch gain on cpu-mini's
# block 0 over five seeds, worst 0.72, against 0.72 (worst 0.54) at 0.85 and 0.62 at 0.5 (two seeds); 1.2 diverged
# (averaging-meanv-fix.jsonl, measured once the published v was the mean gradient's; averaging-scaling.md)


SETTINGS_META = "settings"  # the store's meta key of the settings a run last ran with (to_dict's JSON)
# settings that decide what a stored push is: a round holding pushes made under others could never close
PUSH_FIELDS = ("inner_start", "moment_every", "moment_codec")
# settings a restart goes on with (its training's arithmetic, PUSH_FIELDS among them); the others (deadlines, defences,
# evaluation, the server's limits, the device) are this start's flags and defaults
RUN_FIELDS = frozenset({"rounds", "local_steps", "min_updates", "aggregation", "trim_fraction", "outer", "outer_lr",
                        "outer_momentum", "outer_beta2", "outer_eps", "outer_cap", "step_compression", "moment_clip",
                        "moment_step", "moment_mean_v", "agree_min", *PUSH_FIELDS})

OUTER_ADAM_LR = 1e-3  # the default eta of outer Adam (an absolute step per coordinate, like an inner lr)


class OuterOptimizer(enum.Enum):
    AVERAGE = "average"  # W <- W + eta * Delta_bar
    NESTEROV = "nesterov"  # DiLoCo outer Nesterov momentum
    ADAM = "adam"  # FedAdam (Reddi et al. 2021) on the mean delta: eta m / (sqrt(u) + outer_eps)


class WorkerState(enum.Enum):
    ACTIVE = "active"  # registered and holding a lease
    LAPSED = "lapsed"  # lease expired; out of the round until it comes back
    LEFT = "left"  # said goodbye (SIGINT/SIGTERM)


class UpdateState(enum.Enum):
    ACCEPTED = "accepted"  # validated and stored, waiting for its round to close
    APPLIED = "applied"  # part of an aggregate
    SCREENED = "screened"  # dropped at its round's close: it disagreed with the others (settings.agree_min)
    DROPPED = "dropped"  # its worker was quarantined before its round closed, or its audit's replay broke


class CloseReason(enum.Enum):
    QUORUM = "quorum"  # every live replica reported, with at least the --min-updates floor
    DEADLINE = "deadline"  # the deadline passed with at least one delta


def _shown(value: Any) -> str:
    return str(value.value) if isinstance(value, enum.Enum) else repr(value)


def _stored(value: Any) -> Any:
    """A value as :meth:`CoordinatorSettings.to_dict` stores it."""
    return value.value if isinstance(value, enum.Enum) else value


def per_block_h(block_steps: int, rounds: int) -> int:
    """H of a block with ``block_steps`` inner steps under ``--local-steps 0``: the largest that still gives it
    ``rounds`` rounds (a stack's later blocks train fewer steps, so their H is smaller: averaging-scaling.md)."""
    return max(1, block_steps // rounds)


@dataclass(frozen=True)
class CoordinatorSettings:
    round_seconds: float = 60.0  # deadline of a round after it opens, in seconds
    min_round_seconds: float = 2.0  # lower bound of an adaptive deadline
    adaptive_deadline: bool = False  # deadline <- clamp(slack * slowest arrival of the last round)
    deadline_slack: float = 2.0  # multiple of the last round's arrival quantile
    deadline_quantile: float = 1.0  # which arrival the adaptive deadline scales: 1 = the slowest, 0.5 = the median
    lease_seconds: float = 30.0  # a worker without a heartbeat this long leaves the round
    rounds: int = 0  # rounds per block before the run finishes (0 = never)
    min_updates: int = 1  # deltas a block's round needs to close by quorum, less its refused or quarantined workers (deadline: 1)
    max_body_bytes: int = 0  # cap on an update body (0 = 2 x the block's fp32 size x (1 + shared moments) + 64 KiB)
    # 3: honest ratios on cpu-mini at the defaults reach 1.21 (3,440 pushes, averaging-meanv-fix.jsonl; 1.71 over every
    # setting in averaging-scaling.jsonl); x10 random: 10
    norm_k: float = 3.0  # reject ||Delta|| / s_v > norm_k x the median of recent ones (0 = off)
    norm_history: int = 16  # recent accepted norms of the block used for that median
    norm_min_history: int = 2  # the norm check starts once this many norms are known
    aggregation: Aggregation = Aggregation.MEDIAN  # how one round's deltas are combined (median: aggregation-choice.md)
    trim_fraction: float = 0.2  # trimmed mean: fraction cut at each end
    outer: OuterOptimizer | None = None  # outer step (None: the objective's; benchmarks/results/averaging-study.md)
    outer_lr: float | None = None  # eta of the outer step (None: NESTEROV_LR for nesterov, averaging-scaling.md; 1 for
    # average; OUTER_ADAM_LR for outer Adam)
    outer_momentum: float = 0.5  # mu of Nesterov; beta1 of outer Adam
    outer_beta2: float = 0.99  # outer Adam: decay of its second moment u
    outer_eps: float = 1e-8  # outer Adam: tau, added to sqrt(u) (larger: less adaptive)
    outer_cap: float | None = None  # the outer step's norm is at most this x ||mean delta|| (None: uncapped)
    step_compression: Compression = Compression.INT8  # encoding of the published step (with error feedback)
    local_steps: int = 25  # H: inner steps per work answer (0: per block, its steps // --rounds, all steps run); claims <= H x batch
    inner_start: InnerStart = InnerStart.SHARED_MV  # what a worker's inner AdamW starts each round from (train.inner;
    # shared m and v: averaging-scaling.md)
    moment_codec: MomentCodec = MomentCodec.FACTORED  # encoding of pushed and published inner moments (a push with them: 0.39x the block)
    moment_clip: float = 8.0  # a pushed v is clipped into [median / this, median x this] of the round's, per coordinate
    moment_step: float = 4.0  # the published v moves at most this factor per round
    moment_every: int = 3  # rounds: moments are pushed and published every this many rounds, the workers' own between
    # (DES-LOC; 1: every round). 3: cpu-mini block 0 recovers 0.80 over five seeds (worst 0.72) against 0.77 (0.67)
    # every round, at 0.28x the fp32 block a push on average (averaging-meanv-fix.jsonl, averaging-scaling.md)
    moment_mean_v: bool = True  # with m and v shared: publish the v of the workers' mean gradient, m^2 + (v - m^2) / M
    lazy_fraction: float = 0.1  # refuse norm < this x median of recent norms x claimed/assigned samples (0 = off)
    replay_cosine: float = 0.9999  # refuse an update whose sketch's cosine with any accepted delta of the block is above
    # (1 = off): a replay, re-encoded or not, is above 0.99999; honest updates reached 0.991 on a 20-word corpus
    # (benchmarks/results/replay-threshold.json for WikiText)
    sketch_dim: int = 8192  # entries of the count sketch kept of every accepted delta (the replay check)
    agree_min: float | None = 0.0  # round close: drop updates whose cosine with the others' mean is below (None = off)
    gate: bool = True  # loss gate on every update (needs the coordinator's data; off without it)
    gate_tolerance: float | None = None  # nats: a fixed gate tolerance (None: calibrated from accepted updates)
    gate_floor: float = 0.02  # nats: the calibrated tolerance's least value
    gate_start: float = 0.1  # nats: the tolerance until gate_min_history rises are known (honest rises reached 0.075 on
    # depth-proxy, aggregation-choice.json, and 0.039 in the second round of a copy-initialised cpu-quick block)
    gate_z: float = 6.0  # calibrated tolerance: median + gate_z x 1.4826 MAD of the block's recent accepted loss rises
    gate_history: int = 64  # recent accepted loss rises of the block the calibration reads
    gate_min_history: int = 8  # the calibration starts once this many rises are known
    gate_batch: int = 8  # sequences in the gate's held-out batch
    quarantine_after: int = 3  # refusals for what an update is or does before its worker is quarantined (0 = never)
    quarantine_window: int = 100  # updates: a refusal stops counting toward quarantine_after once its worker has had
    # this many updates applied since (0: never; honest pushes are refused now and then, 1 of 1,200 in a depth-proxy
    # row of averaging-scaling.json, so without it a run of thousands of rounds quarantined an honest worker)
    refusal_burst: int = 10  # refused update requests a worker may make per refusal_window_s before a 429 (0 = no cap)
    refusal_window_s: float = 60.0  # seconds of the refusal rate limit's window
    audit_fraction: float = 0.05  # accepted pushes replayed by the coordinator (needs its --data; 0 = no audits)
    probation_pushes: int = 3  # a worker's first this many accepted pushes of each block are all replayed (0 = none)
    audit_outlier_fraction: float = 0.5  # after probation, an outlier push is replayed with this probability
    audit_outlier_ratio: float = 2.0  # an outlier: its norm per unit of lr above this x the block's recent median, or a
    # loss rise above half the gate's tolerance
    audit_tolerance: float = 0.05  # fp32 push: a replay passes at ||replayed - pushed|| / ||pushed|| <= this x sqrt(max(H, 25)/25)
    audit_tolerance_bf16: float = 0.05  # the same for a push trained in bf16 (benchmarks/results/audit-replay*.json)
    audit_scale_tolerance: float = 0.02  # a replay passes only if the push's scale on it is within this of 1
    audit_moment_tolerance: float = 1.0  # relative distance of uploaded AdamW moments from derived ones, m and v each
    # (honest across bf16/fp32 after 2 rounds: up to 0.51, benchmarks/results/audit-replay-moments.json)
    audit_pushed_moment_tolerance: float = 0.25  # relative distance of a push's carried moments from its replay's, m
    # and v each (honest across bf16/fp32 and thread counts on cpu-mini, through the factored codec: up to 0.051 at
    # H=25, 0.047 at H=100; benchmarks/results/audit-replay-pushed-moments*.json)
    audit_timeout_s: float = 120.0  # seconds an audited worker has to begin its state upload before it is quarantined
    audit_replays: int = 2  # audit replays run at once (each builds its block and frozen inputs on --device and trains
    # H steps); more uploads wait their turn, held by their rounds, not overdue
    upload_timeout_s: float = 600.0  # seconds a request body may take to arrive; a stalled or trickling one gets 408
    max_connections: int = 1024  # connections the HTTP server serves at once; more are answered 503
    head_timeout_s: float = 10.0  # seconds a request's head (request line and headers) may take, and the small JSON
    # body of a route other than uploads; slower: closed (the rest of a body answered before it was read: 6x this)
    device: str = "auto"  # where the gate, evaluations and audit replays compute: auto, cpu, cuda or cuda:N
    eval_every: int = 1  # evaluate the assembled model every this many epochs (0 = never)
    eval_bytes: int = 4096  # validation bytes scored per evaluation
    tick_seconds: float = 0.5  # period of the deadline/lease/eval loop; the most a status served over HTTP lags
    fsync: bool = True  # fsync every blob and SQLite commit (False: safe from process crashes, not power loss)
    hivemind: bool = False  # host the run's hivemind DHT and admit workers averaging on it (needs blocktrain[hivemind])
    hivemind_host: str = "0.0.0.0"  # IPv4 address the DHT peer listens on (its port is chosen by the system)

    def for_objective(self, default_outer: str) -> CoordinatorSettings:
        """These settings with the objective's outer step where none was chosen (``Objective.outer_step``), and its
        lr where none was: NESTEROV_LR for Nesterov, 1 (the plain mean) for an average."""
        outer = self.outer if self.outer is not None else OuterOptimizer(default_outer)
        return replace(self, outer=outer, outer_lr=self.eta(outer))

    def eta(self, outer: OuterOptimizer) -> float:
        """The outer lr of ``outer``: ``outer_lr`` if set, else NESTEROV_LR for Nesterov, OUTER_ADAM_LR for outer Adam
        and 1 for an average."""
        if self.outer_lr is not None:
            return self.outer_lr
        return {OuterOptimizer.NESTEROV: NESTEROV_LR, OuterOptimizer.ADAM: OUTER_ADAM_LR}.get(outer, 1.0)

    def moments_at(self, version: int) -> tuple[str, ...]:
        """The moment prefixes a push against ``version`` carries (``m/``, ``v/``): the inner start's on every
        ``moment_every``-th round (:func:`~blocktrain.protocol.moments.shares_moments`), else none."""
        return self.inner_start.shares_at(version, self.moment_every)

    def to_dict(self) -> dict[str, Any]:
        """Every field, enums as their values: what a result records of the settings it ran with."""
        return {f.name: (v.value if isinstance(v := getattr(self, f.name), enum.Enum) else v) for f in fields(self)}

    def refuse_push_changes(self, stored: Mapping[str, Any]) -> None:
        """Raise :class:`ConfigError` where these settings change one that decides what a stored push is (``stored``:
        :meth:`to_dict`'s of the run's last start): the rounds' stored pushes would no longer parse, and never close."""
        ours = self.to_dict()
        changed = [f"--{n.replace('_', '-')} {stored[n]} (now {ours[n]})" for n in PUSH_FIELDS
                   if n in stored and stored[n] != ours[n]]
        if changed:
            raise ConfigError(f"this run's stored pushes were made under {', '.join(changed)}; restart it with the "
                              "run's own value (or without the flag: a restart keeps the run's settings), or start a new "
                              "--run-dir")

    @classmethod
    def continued(cls, stored: Mapping[str, Any], given: Mapping[str, Any]) -> tuple[CoordinatorSettings, list[str]]:
        """The settings a restarted run goes on with: :data:`RUN_FIELDS` (its training's arithmetic) as it ran with
        them (``stored``, :meth:`to_dict`'s, its outer step and lr resolved), the rest from this start's flags and
        defaults; each field in ``given`` (the flags given now) sets its value. So rerunning a command after an
        upgrade keeps the run's outer lr, where a new version's default would change it halfway.

        Returns them and one line per value kept that this version's default would change, per field ``given``
        changed, and per stored value this version cannot read (dropped: its flag or default applies). A new outer
        step given without an lr takes its own default lr, not the old step's."""
        hints, default = typing.get_type_hints(cls), cls()
        values: dict[str, Any] = {}
        notes = [f"{name}: {value!r} is not a setting of this version, dropped" for name, value in stored.items()
                 if name not in {f.name for f in fields(cls)}]
        for name in (n for n in RUN_FIELDS if n in stored and n not in given):
            kind = next((t for t in typing.get_args(hints[name]) or (hints[name],) if isinstance(t, type)), None)
            try:
                value = stored[name]
                if value is not None and kind is not None and issubclass(kind, enum.Enum):
                    value = kind(value)
                elif value is not None and kind is float and isinstance(value, int) and not isinstance(value, bool):
                    value = float(value)
                if value is not None and kind is not None and not isinstance(value, kind):
                    raise TypeError(f"{value!r} is not a {kind.__name__}")
            except (ValueError, TypeError) as exc:
                notes.append(f"{name}: the stored {stored[name]!r} cannot be read ({exc}), dropped")
                continue
            values[name] = value
        if "outer" in given and "outer_lr" not in given and given["outer"] != values.get("outer"):
            values.pop("outer_lr", None)  # the new outer step's own default lr
        for name, value in values.items():
            outer = values.get("outer")
            now = default.eta(outer) if name == "outer_lr" and outer is not None else getattr(default, name)
            if value != now and name != "outer":  # (the outer step: the objective's when none is chosen)
                notes.append(f"{name}: {_shown(value)} kept (this version's default: {_shown(now)})")
        notes += [f"{name}: {_shown(stored[name]) if name in stored else 'unset'} -> {_shown(v)}, as given"
                  for name, v in given.items() if name in RUN_FIELDS and stored.get(name, object()) != _stored(v)]
        try:
            return cls(**{**values, **given}), notes
        except ConfigError as exc:
            raise ConfigError(f"the settings this run last ran with do not hold: {exc}; pass the flag with a good "
                              "value, or --reset-settings") from exc

    def __post_init__(self) -> None:
        if not (self.device in ("auto", "cpu") or self.device == "cuda" or self.device.startswith("cuda:")):
            raise ConfigError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}; set --device")
        if self.round_seconds <= 0 or self.min_round_seconds <= 0:
            raise ConfigError("round_seconds and min_round_seconds must be positive")
        if not 0 < self.deadline_quantile <= 1 or self.deadline_slack <= 0:
            raise ConfigError("deadline_quantile must be in (0, 1] and deadline_slack > 0")
        if self.lease_seconds <= 0:
            raise ConfigError(f"lease_seconds must be positive, got {self.lease_seconds}")
        if self.rounds < 0 or self.max_body_bytes < 0 or self.eval_every < 0 or self.eval_bytes < 0:
            raise ConfigError("rounds, max_body_bytes, eval_every and eval_bytes must be >= 0")
        if self.min_updates < 1:
            raise ConfigError(f"min_updates must be >= 1, got {self.min_updates}")
        if self.norm_k < 0:
            raise ConfigError(f"norm_k must be >= 0 (0 disables the norm check), got {self.norm_k}")
        if not 0 <= self.trim_fraction < 0.5:
            raise ConfigError(f"trim_fraction must be in [0, 0.5), got {self.trim_fraction}")
        if (self.outer_lr is not None and self.outer_lr <= 0) or not 0 <= self.outer_momentum < 1:
            raise ConfigError("outer_lr must be > 0 and outer_momentum in [0, 1)")
        if not 0 <= self.outer_beta2 < 1 or self.outer_eps <= 0 or (self.outer_cap is not None and self.outer_cap <= 0):
            raise ConfigError("outer_beta2 must be in [0, 1), outer_eps > 0 and outer_cap > 0 (or None)")
        if self.moment_clip < 1 or self.moment_step < 1:
            raise ConfigError(f"moment_clip and moment_step must be >= 1 (factors), got {self.moment_clip}, "
                              f"{self.moment_step}")
        if self.moment_every < 1:
            raise ConfigError(f"moment_every must be >= 1 (rounds between shared moments), got {self.moment_every}")
        if self.gate_tolerance is not None and self.gate_tolerance < 0:
            raise ConfigError(f"gate_tolerance must be >= 0, got {self.gate_tolerance}")
        if min(self.gate_floor, self.gate_start, self.gate_z) < 0 or min(self.gate_history, self.gate_min_history,
                                                                         self.gate_batch) < 1:
            raise ConfigError("gate_floor, gate_start and gate_z must be >= 0; gate_history, gate_min_history and gate_batch >= 1")
        if self.local_steps < 0 or self.sketch_dim < 16:
            raise ConfigError(f"local_steps must be >= 0 and sketch_dim >= 16, got {self.local_steps}, {self.sketch_dim}")
        if self.local_steps == 0 and self.rounds <= 0:
            raise ConfigError("--local-steps 0 (H per block) divides each block's steps by --rounds: pass --rounds N > 0")
        if not 0 <= self.lazy_fraction < 1 or not 0 < self.replay_cosine <= 1:
            raise ConfigError("lazy_fraction must be in [0, 1) and replay_cosine in (0, 1]")
        if self.agree_min is not None and not -1 <= self.agree_min < 1:
            raise ConfigError(f"agree_min must be in [-1, 1) or None, got {self.agree_min}")
        if not (self.audit_moment_tolerance > 0 and math.isfinite(self.audit_moment_tolerance)):
            raise ConfigError(f"audit_moment_tolerance must be positive (a relative distance), got "
                              f"{self.audit_moment_tolerance}; set --audit-moment-tolerance")
        if not (self.audit_pushed_moment_tolerance > 0 and math.isfinite(self.audit_pushed_moment_tolerance)):
            raise ConfigError(f"audit_pushed_moment_tolerance must be positive (a relative distance), got "
                              f"{self.audit_pushed_moment_tolerance}; set --audit-pushed-moment-tolerance")
        if not 0 < self.audit_scale_tolerance < 0.1:
            raise ConfigError(f"audit_scale_tolerance must be in (0, 0.1) (a push scaled by 1.1 must fail), got "
                              f"{self.audit_scale_tolerance}; set --audit-scale-tolerance")
        if not 0 <= self.audit_fraction <= 1 or min(self.audit_tolerance, self.audit_tolerance_bf16) < 0 \
                or self.audit_timeout_s <= 0:
            raise ConfigError("audit_fraction must be in [0, 1], audit_tolerance >= 0 and audit_timeout_s > 0")
        if not (self.upload_timeout_s > 0 and math.isfinite(self.upload_timeout_s)) or self.max_connections < 1:
            raise ConfigError(f"upload_timeout_s must be a positive number of seconds and max_connections >= 1, got "
                              f"{self.upload_timeout_s!r} and {self.max_connections}; set --upload-timeout-s, "
                              "--max-connections")
        if not (self.head_timeout_s > 0 and math.isfinite(self.head_timeout_s)):
            raise ConfigError(f"head_timeout_s must be a positive number of seconds, got {self.head_timeout_s!r}; set "
                              "--head-timeout-s")
        if self.audit_replays < 1:
            raise ConfigError(f"audit_replays must be >= 1, got {self.audit_replays}; set --audit-replays")
        if self.probation_pushes < 0:
            raise ConfigError(f"probation_pushes must be >= 0, got {self.probation_pushes}")
        if not 0 <= self.audit_outlier_fraction <= 1 or self.audit_outlier_ratio < 1:
            raise ConfigError("audit_outlier_fraction must be in [0, 1] and audit_outlier_ratio >= 1")
        if self.quarantine_after < 0 or self.refusal_burst < 0 or self.refusal_window_s <= 0 or self.quarantine_window < 0:
            raise ConfigError("quarantine_after, quarantine_window and refusal_burst must be >= 0 and refusal_window_s > 0")
