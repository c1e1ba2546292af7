"""Fuzz the coordinator's HTTP API from its own OpenAPI schema (schemathesis): never a 5xx.

Each operation is fuzzed twice: anonymously and with a valid worker token (so
the generated bodies reach validation instead of stopping at 401).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

schemathesis = pytest.importorskip("schemathesis", reason="schemathesis is a dev dependency: pip install -e .[dev]")
from hypothesis import HealthCheck, settings  # noqa: E402

from blocktrain.coordinator.app import create_app  # noqa: E402
from blocktrain.coordinator.service import Coordinator  # noqa: E402
from blocktrain.coordinator.settings import CoordinatorSettings  # noqa: E402
from blocktrain.presets import get_preset  # noqa: E402


def _coordinator(tmp: Path) -> tuple[Coordinator, str]:
    c = Coordinator(tmp, get_preset("tiny"), CoordinatorSettings(round_seconds=60), None)
    token = c.add_token("fuzzer")
    c.register("fuzzer", 0)
    return c, token


_TMP = tempfile.TemporaryDirectory(prefix="blocktrain-fuzz-")  # removed at interpreter exit
_C, _TOKEN = _coordinator(Path(_TMP.name))
schema = schemathesis.openapi.from_asgi("/openapi.json", create_app(_C, background=False))


@schema.parametrize()
@settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
def test_fuzz_no_server_errors(case) -> None:  # type: ignore[no-untyped-def]
    for headers in ({}, {"Authorization": f"Bearer {_TOKEN}"}):
        response = case.call(headers=headers)
        assert response.status_code < 500, (
            f"{case.method} {case.formatted_path} -> {response.status_code}: {response.text[:300]}"
        )
