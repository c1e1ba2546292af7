"""`blocktrain serve` and `blocktrain bench serve` options: validation, and flags derived from the option fields."""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import fields
from pathlib import Path
from typing import Any, cast

import pytest

from blocktrain.bench.serve import _finish
from blocktrain.bench.serve_options import ServeBenchOptions
from blocktrain.cli.main import build_parser
from blocktrain.cli.serving import BENCH_PREFIX, STAGE_EXPLICIT, bench_options, next_stages, stage_options
from blocktrain.errors import ConfigError
from blocktrain.serve.client.pipeline import TOKEN_ENV
from blocktrain.serve.stage.server import StageOptions
from blocktrain.serve.wire.frames import SMALL_FRAME_BYTES
from tests.serve_sockets import MIB, TOKEN


# --- options -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("opts", "needle"),
    [
        ({"idle_timeout_s": 0}, "idle_timeout_s must be a positive"),
        ({"read_timeout_s": float("inf")}, "read_timeout_s must be a positive"),
        ({"write_timeout_s": -1}, "--write-timeout"),
        ({"max_connections": 0}, "max_connections must be at least 1"),
        ({"conn_buffer_bytes": 1000}, "raise --conn-buffer-mib"),
        ({"conn_buffer_bytes": 2 * MIB, "buffer_bytes": MIB}, "raise --buffer-mib"),
        ({"conn_buffer_bytes": MIB, "buffer_bytes": 2 * MIB, "max_connections": 17}, "64 KiB set aside"),
        ({"token": "short"}, "16-512 printable ASCII"),
        ({"token": "has a space in it, sadly"}, "16-512 printable ASCII"),
    ],
)
def test_stage_options_are_validated(opts: dict[str, Any], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        StageOptions(**opts)


def test_serve_flags_reach_stage_options(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    parse = build_parser().parse_args
    opts = stage_options(parse(["serve", "--idle-timeout", "7", "--read-timeout", "3", "--write-timeout", "4",
                                "--max-connections", "9", "--max-frame-mib", "2"]))
    assert (opts.idle_timeout_s, opts.read_timeout_s, opts.write_timeout_s, opts.max_connections) == (7, 3, 4, 9)
    assert (opts.conn_buffer_bytes, opts.buffer_bytes, opts.token) == (2 * MIB, 8 * MIB + 9 * SMALL_FRAME_BYTES, "")
    opts = stage_options(parse(["serve", "--conn-buffer-mib", "1", "--buffer-mib", "3", "--max-connections", "16"]))
    assert (opts.conn_buffer_bytes, opts.buffer_bytes) == (MIB, 3 * MIB)
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    assert stage_options(parse(["serve"])).token == TOKEN
    (tmp_path / "tok").write_text("f" * 32 + "\n")
    assert stage_options(parse(["serve", "--token-file", str(tmp_path / "tok")])).token == "f" * 32
    with pytest.raises(ConfigError, match="max_connections"):
        stage_options(parse(["serve", "--max-connections", "0"]))
    with pytest.raises(ConfigError, match="cannot read --token-file"):
        stage_options(parse(["serve", "--token-file", str(tmp_path / "missing")]))



def _bumped(value: Any) -> Any:
    """A value of the same type as a field default, different from it (and valid for every StageOptions field)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise AssertionError(f"no test value for a {type(value).__name__} field: give it a case in this test")
    return value + 1 if isinstance(value, int) else value * 2 + 1


def test_every_stage_option_is_reachable_from_the_cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    (tmp_path / "tok").write_text(TOKEN)
    parser = build_parser()

    def options(*argv: str) -> StageOptions:
        args = parser.parse_args(["serve", *argv])
        return stage_options(args, next_stages(args))

    explicit = {  # unit-converting, parsed and secret flags: field -> (argv, the value it must set)
        "next_stages": (["--next", "127.0.0.1:7001,h:7002"], (("127.0.0.1", 7001), ("h", 7002))),
        "link_delay_s": (["--delay-ms", "25"], 0.025),
        "max_frame_bytes": (["--max-frame-mib", "2"], 2 * MIB),
        "batch_window_s": (["--batch-window-ms", "5"], 0.005),
        "conn_buffer_bytes": (["--conn-buffer-mib", "1"], MIB),
        "buffer_bytes": (["--buffer-mib", "300"], 300 * MIB),
        "token": (["--token-file", str(tmp_path / "tok")], TOKEN),
    }
    assert set(explicit) == set(STAGE_EXPLICIT)
    default = StageOptions()
    for f in fields(StageOptions):
        if f.name in explicit:
            argv, want = explicit[f.name]
            flags = [argv]
        else:
            want = _bumped(getattr(default, f.name))
            flag = "--" + f.name.replace("_", "-")
            flags = [[flag, str(want)]]
            if f.name.endswith("_s"):  # seconds fields keep their flag without the unit suffix too
                flags.append([flag.removesuffix("-s"), str(want)])
        for argv in flags:
            got = getattr(options(*argv), f.name)
            assert got == want and got != getattr(default, f.name), (f.name, argv, got)
    assert options("--timeout", "5").request_timeout_s == 5.0  # the entry's deadline kept its old flag name
    assert options() == StageOptions()  # no flags: the dataclass defaults, none repeated in the CLI


def _subcommand(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    """The parser of ``parser``'s subcommand ``name`` (argparse keeps them in its first subparsers action's choices)."""
    assert parser._subparsers is not None
    return cast(dict[str, argparse.ArgumentParser], parser._subparsers._group_actions[0].choices)[name]


def test_bench_serve_flags_build_the_options(tmp_path: Path) -> None:
    parse = build_parser().parse_args
    assert bench_options(parse(["bench", "serve"])) == ServeBenchOptions()
    opts = bench_options(parse(["bench", "serve", "--sweeps", "1,3", "--hop-delay-ms", "10", "--json",
                                str(tmp_path / "r.json"), "--stack-run", str(tmp_path), "--draft-max", "8"]))
    assert opts == ServeBenchOptions(sweeps=(1, 3), hop_delay_ms=10.0, json=tmp_path / "r.json", stack_run=tmp_path,
                                     draft_max=8)
    dests = {a.dest for a in _subcommand(_subcommand(build_parser(), "bench"), "serve")._actions}
    assert {BENCH_PREFIX + f.name for f in fields(ServeBenchOptions)} <= dests
    with pytest.raises(SystemExit):
        parse(["bench", "serve", "--sweeps", "1,x"])


@pytest.mark.parametrize(
    ("opts", "needle"),
    [
        ({"sweeps": ()}, "--sweeps like 1,2,4"),
        ({"draft_min": 4, "draft_max": 2}, "draft_max \\(2\\) must be at least draft_min"),
        ({"output_bytes": 0}, "--output-bytes"),
        ({"base_port": 65534}, "--base-port"),
    ],
)
def test_bench_serve_options_are_validated(opts: dict[str, Any], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        ServeBenchOptions(**opts)


def test_bench_records_its_command_without_a_lock(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["/venv/bin/blocktrain", "bench", "serve", "--json", "serve.json"])
    result = _finish(ServeBenchOptions(), {}, time.time())
    assert result["commands"]["bench"] == "blocktrain bench serve --json serve.json"
