"""What a worker is told (:class:`WorkerOptions`, the ``blocktrain worker`` flags) and what it reports at the end
(:class:`WorkerSummary`); the loop that uses them is :mod:`.loop`."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from blocktrain.config import CompileMode, Precision
from blocktrain.errors import ConfigError
from blocktrain.protocol.delta import Compression
from blocktrain.worker.engines import Averaging


@dataclass(frozen=True)
class WorkerOptions:
    url: str  # coordinator base URL
    token: str  # bearer token of this worker
    block: int | None = None  # pin to block K (else the coordinator assigns one)
    local_steps: int | None = None  # H: optimiser steps per round, at most the coordinator's budget (None: its budget)
    compression: Compression = Compression.INT8  # delta encoding on the wire (lossy ones carry error feedback)
    progress: bool = True  # per-round progress bar
    poll_s: float = 0.5  # wait between polls while a round is closing
    give_up_s: float = 600.0  # stop retrying an unreachable coordinator after this long
    max_rejections: int = 5  # consecutive rejected updates before the worker gives up
    verify_tls: bool | str = True  # TLS verification (or a CA bundle path)
    precision: Precision | None = None  # forward/backward arithmetic (None: the run config's, bf16 by default)
    device: str = "auto"  # where to train: auto, cpu, cuda or cuda:N
    compile: CompileMode = CompileMode.OFF  # torch.compile of the block and its frozen inputs (the trainers' --compile)
    work_dir: Path = field(default_factory=lambda: Path("runs/worker"))  # this worker's own files (its frozen cache)
    frozen_cache: Path | None = None  # verified frozen blocks on disk (None: WORK_DIR/frozen)
    averaging: Averaging = Averaging.COORDINATOR  # engine that carries the delta (hivemind: pip install 'blocktrain[hivemind]')
    group_size: int = 16  # hivemind engine: peers per group at most
    matchmaking_s: float = 3.0  # hivemind engine: seconds a forming group waits for more peers
    p2p_host: str = "0.0.0.0"  # hivemind engine: IPv4 address this worker's DHT peer listens on

    @property
    def frozen_dir(self) -> Path:
        """Where the verified frozen blocks are kept: --frozen-cache, else under the worker's own directory."""
        return self.frozen_cache if self.frozen_cache is not None else self.work_dir / "frozen"

    def __post_init__(self) -> None:
        if self.local_steps is not None and self.local_steps < 1:
            raise ConfigError(f"local_steps must be >= 1, got {self.local_steps}")
        if not 0 < self.poll_s < math.inf or not self.give_up_s > 0:  # NaN passed `<= 0`; an infinite poll never polls
            raise ConfigError(f"poll_s must be a finite number of seconds > 0 and give_up_s a number > 0 (inf: never give "
                              f"up), got {self.poll_s}, {self.give_up_s}")
        if self.max_rejections < 1:
            raise ConfigError(f"max_rejections must be >= 1, got {self.max_rejections}")
        if self.group_size < 2 or not 0 < self.matchmaking_s < math.inf:  # inf passed `> 0`: the exchange's bounds derive from it
            raise ConfigError(f"group_size must be >= 2 and matchmaking_s a finite number > 0 (seconds), got "
                              f"{self.group_size}, {self.matchmaking_s}")
        if self.averaging is Averaging.HIVEMIND:
            from blocktrain.p2p import require_hivemind

            require_hivemind()


@dataclass
class WorkerSummary:
    rounds_pushed: int = 0  # deltas accepted by the coordinator
    rounds_stale: int = 0  # deltas answered 409 (their round had moved on)
    local_steps: int = 0  # optimiser steps taken
    bytes_sent: int = 0  # request body bytes
    bytes_received: int = 0  # response body bytes
    block: int = -1  # the block trained last
    frozen_downloads: int = 0  # frozen earlier blocks downloaded (each block version once; cache hits excluded)
    rounds_cut: int = 0  # rounds pushed with fewer than H steps because the deadline was near
    groups_uploaded: int = 0  # hivemind engine: group means this worker uploaded
    rounds_grouped: int = 0  # hivemind engine: rounds whose delta another member uploaded in its group's mean
    rounds_alone: int = 0  # hivemind engine: grouped rounds whose mean had not landed near the deadline, pushed alone
    peer_pulls: int = 0  # hivemind engine: published versions fetched from a peer (hash-checked), not the coordinator
    audits: int = 0  # pushes the coordinator audited (this worker uploaded its inner state for a replay)
