"""Size limits of the serving wire (no torch here: the CLI reads them when it builds its flags)."""

from __future__ import annotations

MAX_HEADER_BYTES = 64 * 1024  # JSON headers are small; anything larger is an attack or a bug
DEFAULT_MAX_FRAME_BYTES = 64 * 1024 * 1024  # header + payload cap; `--max-frame-mib` changes it
MAX_HELLO_BYTES = 4096  # bytes: the largest frame a stage reads before the connection is authenticated
SMALL_FRAME_BYTES = 64 * 1024  # bytes: a stage sets this much buffer aside per connection for frames this small
MAX_SWEEPS = 16  # sweeps one sweep request may ask for: stages refuse more (the gateway too, before it sends any)
