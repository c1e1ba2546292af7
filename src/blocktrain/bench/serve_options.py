"""Options of ``blocktrain bench serve`` (the CLI derives its flags from these fields).

The benchmark times outputs on a machine shared with nothing else: run it alone
(no other benchmark or training on the same cores), or its times mean little.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from blocktrain.errors import ConfigError


@dataclass(frozen=True)
class ServeBenchOptions:
    run: Path = Path("runs/serve-cpu-small")  # run directory with a diffusion run's blocks and its E2E reference
    # beside them: 'blocktrain train' then 'blocktrain train-e2e', the same --preset, --objective diffusion and --out
    data: Path | None = None  # data directory: prompts and teacher-forced CE from its test split (None: the one run.json records)
    json: Path | None = None  # write the result JSON here, and its markdown summary beside it (None: stdout only)
    hop_delay_ms: float = 25.0  # ms: one-way delay per hop
    output_bytes: int = 128  # bytes per output
    prompt_bytes: int = 128  # bytes of each prompt
    prompts: int = 4  # prompts for the generative CE
    sweeps: tuple[int, ...] = (1, 2, 4)  # k values of sweep to measure (comma-separated on the command line)
    temperature: float = 0.8  # sampling temperature of every mode
    top_k: int = 40  # sampling top-k of every mode
    tf_bytes: int = 16384  # test bytes for the teacher-forced CE
    base_port: int = 47100  # port of stage 0; stage i listens on base_port + i
    stack_run: Path | None = None  # a trained stack run: adds the spec row (speculative decoding over the same stages)
    draft_min: int = 1  # bytes: spec row's shortest draft
    draft_max: int = 16  # bytes: spec row's longest draft
    device: str = "auto"  # where the stages and the local references compute: auto, cpu, cuda or cuda:N
    long_output_bytes: int = 512  # bytes per output of the long rows (baseline; spec and ar on --stack-run): several
    # context windows, so the modes slide their windows; 0 = no long rows

    def __post_init__(self) -> None:
        positive = {"output_bytes": self.output_bytes, "prompt_bytes": self.prompt_bytes, "prompts": self.prompts,
                    "tf_bytes": self.tf_bytes, "draft_min": self.draft_min}
        for name, value in positive.items():
            if value < 1:
                raise ConfigError(f"{name} must be at least 1, got {value}; set --{name.replace('_', '-')}")
        if self.long_output_bytes < 0:
            raise ConfigError(f"long_output_bytes must be >= 0 (0 = no long rows), got {self.long_output_bytes}; "
                              "set --long-output-bytes")
        if self.draft_max < self.draft_min:
            raise ConfigError(f"draft_max ({self.draft_max}) must be at least draft_min ({self.draft_min}); "
                              "set --draft-max or --draft-min")
        if not self.sweeps or min(self.sweeps) < 1:
            raise ConfigError(f"sweeps must be positive k values, got {self.sweeps}; set --sweeps like 1,2,4")
        for name in ("hop_delay_ms", "temperature"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ConfigError(f"{name} must be a finite number >= 0, got {value!r}; set --{name.replace('_', '-')}")
        if not 1 <= self.base_port <= 65535 - 2:
            raise ConfigError(f"base_port must leave room for three ports below 65536, got {self.base_port}; "
                              "set --base-port")
