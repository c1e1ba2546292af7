"""Options and lifecycle states of a stage server (``blocktrain serve`` derives its flags from the fields)."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from blocktrain.errors import ConfigError
from blocktrain.serve.wire.limits import DEFAULT_MAX_FRAME_BYTES, MAX_HEADER_BYTES, SMALL_FRAME_BYTES

if TYPE_CHECKING:
    from blocktrain.serve.wire.links import Address


class StageState(enum.Enum):
    """Lifecycle of a stage server."""

    STARTING = "starting"
    SERVING = "serving"
    STOPPING = "stopping"
    STOPPED = "stopped"


@dataclass(frozen=True)
class StageOptions:
    next_stages: tuple[Address, ...] = ()  # the next stage and its replicas, tried in order
    link_delay_s: float = 0.0  # injected one-way delay on the forward link (benchmarks without netem)
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES  # cap on header + payload of any frame
    max_batch: int = 16  # frames run together at most
    max_batch_rows: int = 256  # sequences run together at most (a frame carries at most 64)
    batch_window_s: float = 0.0  # wait this long after the first frame for others to join its batch
    request_timeout_s: float = 60.0  # entry: deadline of a request (per attempt)
    retries: int = 1  # entry: re-runs of a deterministic request after a downstream failure
    connect_timeout_s: float = 2.0  # per connection attempt to the next stage
    connect_attempts: int = 3  # rounds over all replicas before giving up
    backoff_s: float = 0.1  # first pause between rounds (doubles)
    idle_timeout_s: float = 300.0  # seconds: close a connection on which no frame starts (and none of whose work is in flight)
    read_timeout_s: float = 30.0  # seconds: a frame whose first byte arrived must be complete (room to buffer it included)
    write_timeout_s: float = 30.0  # seconds: close a connection whose peer reads nothing of a pending write for this long
    max_connections: int = 256  # inbound connections held at once; more get an ERROR (overloaded) and are closed
    conn_buffer_bytes: int = DEFAULT_MAX_FRAME_BYTES  # bytes: the largest frame one connection may have buffered
    # bytes: frames buffered at once over all inbound connections, SMALL_FRAME_BYTES per connection set aside
    buffer_bytes: int = 4 * DEFAULT_MAX_FRAME_BYTES + 256 * SMALL_FRAME_BYTES
    # requests held at once: at the entry, submitted and not yet answered (their tensors kept for a retry, at most
    # buffer_bytes of them); at any stage, frames queued from one connection (at most buffer_bytes); more: OVERLOADED
    max_pending: int = 1024
    max_pending_per_conn: int = 256  # requests one connection may have pending at the entry at once
    token: str = field(default="", repr=False)  # shared secret a connection must send first in a HELLO ("" = none)

    def __post_init__(self) -> None:
        for name in ("idle_timeout_s", "read_timeout_s", "write_timeout_s"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                flag = "--" + name.removesuffix("_s").replace("_", "-")
                raise ConfigError(f"{name} must be a positive number of seconds, got {value!r}; set {flag}")
        if self.max_connections < 1:
            raise ConfigError(f"max_connections must be at least 1, got {self.max_connections}; set --max-connections")
        if self.max_batch < 1 or self.max_batch_rows < 1:
            raise ConfigError(f"max_batch ({self.max_batch}) and max_batch_rows ({self.max_batch_rows}) must be at "
                              "least 1; set --max-batch and --max-batch-rows")
        if self.max_pending < 1 or not 1 <= self.max_pending_per_conn <= self.max_pending:
            raise ConfigError(f"max_pending ({self.max_pending}) and max_pending_per_conn ({self.max_pending_per_conn}) "
                              "must be at least 1, the second at most the first; set --max-pending and "
                              "--max-pending-per-conn")
        if self.conn_buffer_bytes < 12 + MAX_HEADER_BYTES:
            raise ConfigError(
                f"conn_buffer_bytes ({self.conn_buffer_bytes}) must hold at least a frame with a full header "
                f"({12 + MAX_HEADER_BYTES} bytes); raise --conn-buffer-mib"
            )
        small = self.max_connections * SMALL_FRAME_BYTES
        if self.buffer_bytes < self.conn_buffer_bytes + small:
            raise ConfigError(
                f"buffer_bytes ({self.buffer_bytes}) must hold conn_buffer_bytes ({self.conn_buffer_bytes}) plus "
                f"{SMALL_FRAME_BYTES // 1024} KiB set aside for small frames on each of max_connections "
                f"({self.max_connections}), {self.conn_buffer_bytes + small} bytes in all; raise --buffer-mib, or "
                "lower --conn-buffer-mib or --max-connections"
            )
        if self.token and not (16 <= len(self.token) <= 512 and all(33 <= ord(c) <= 126 for c in self.token)):
            raise ConfigError(
                "the serving token must be 16-512 printable ASCII characters without spaces; make one with "
                "`python -c 'import secrets; print(secrets.token_hex(16))'`"
            )
