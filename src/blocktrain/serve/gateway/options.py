"""Options of ``blocktrain gateway``: a light module, so the CLI derives its flags without loading the web stack."""

from __future__ import annotations

from dataclasses import dataclass

from blocktrain.errors import ConfigError


@dataclass(frozen=True)
class GatewayOptions:
    """How ``blocktrain gateway`` serves; ConfigError on a bad value."""

    pipeline: str  # HOST:PORT of the pipeline's entry stage
    model_name: str | None = None  # model id reported and accepted; None: derived from the entry stage
    token: str = ""  # bearer token HTTP clients must send; "" = none
    pipeline_token: str | None = None  # token of the stages' HELLO; None: $BLOCKTRAIN_SERVE_TOKEN
    max_tokens_cap: int = 4096  # bytes: the largest max_tokens accepted
    max_body_bytes: int = 1 << 20  # bytes: the largest request body accepted
    request_timeout_s: float = 120.0  # seconds: a request (body read, generation, whole stream) must end within this
    max_connections: int = 256  # HTTP connections served at once; more are answered 503
    max_scoring: int = 4  # requests scored at once (each holds up to 128 MiB of log-prob rows); others wait

    def __post_init__(self) -> None:
        if self.max_tokens_cap < 1:
            raise ConfigError(f"--max-tokens-cap must be >= 1 byte, got {self.max_tokens_cap}")
        if self.max_body_bytes < 1024:
            raise ConfigError(f"--max-body-kib must allow at least 1 KiB, got {self.max_body_bytes} bytes")
        if not self.request_timeout_s > 0:
            raise ConfigError(f"--timeout must be > 0 seconds, got {self.request_timeout_s}")
        if self.max_connections < 1:
            raise ConfigError(f"--max-connections must be >= 1, got {self.max_connections}")
        if self.max_scoring < 1:
            raise ConfigError(f"--max-scoring must be >= 1 request, got {self.max_scoring}")
        if self.model_name is not None and not self.model_name.strip():
            raise ConfigError("--model-name must not be empty; omit it to name the model after the pipeline")
