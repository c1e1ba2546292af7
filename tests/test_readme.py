"""The README as a newcomer runs it: every shell block of "Train on your own text", "A decentralised run" and
"Serving", then the Python snippet, run in order in a fresh directory, word for word but for one substitution
table (a CPU-sized preset, free loopback ports for the hosts, a folder of 30 notes for ``~/my-notes``).

A command that exits non-zero, or prints a traceback or an error, fails the test. Servers (coordinator, stages,
gateway) start in the background and are waited for on their port; the worker runs until its coordinator says the
run has finished. Edit a README command and this test runs the edit.
"""

from __future__ import annotations

import os
import random
import re
import shlex
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
SECTIONS = ("## Train on your own text", "## A decentralised run", "## Serving")
SERVERS = ("coordinator", "serve", "gateway")  # commands that run until stopped
TIMEOUT_S = 240  # seconds any one command may take
CPU = "--preset tiny --objective stack --steps 30"  # the CPU-sized stand-in for the README's presets

pytestmark = pytest.mark.timeout(600)


def blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of every fenced block in the README's SECTIONS, in order."""
    out = []
    for title in SECTIONS:
        start = text.index(title)
        end = text.find("\n## ", start + len(title))
        part = text[start : end if end >= 0 else None]
        out += [(m.group(1), m.group(2)) for m in re.finditer(r"```(\w+)\n(.*?)```", part, re.S)]
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def substitutions() -> list[tuple[str, str]]:
    """The one table of what the test changes in the README's commands (applied in this order)."""
    coord, a, b, gw = free_port(), free_port(), free_port(), free_port()
    return [
        ("--preset cpu-mini", CPU),
        ("--preset cpu-small --rounds 24", "--preset tiny --objective stack --rounds 4"),  # the README's CPU variant
        ("~/my-notes", "my-notes"),
        ("--host 0.0.0.0 --port 8470", f"--host 127.0.0.1 --port {coord}"),
        ("http://HOST:8470", f"http://127.0.0.1:{coord}"),
        ("0.0.0.0:7000", f"127.0.0.1:{a}"), ("0.0.0.0:7001", f"127.0.0.1:{b}"),
        ("hostA:7000", f"127.0.0.1:{a}"), ("hostB:7001", f"127.0.0.1:{b}"),
        ("127.0.0.1:8000", f"127.0.0.1:{gw}"),
    ]


def write_notes(root: Path, n: int = 30) -> None:
    """A folder of ``n`` Markdown notes, as a reader's own text."""
    rng = random.Random(0)
    words = ["river", "song", "city", "album", "game", "series", "story", "night", "light", "music", "field", "stone"]
    root.mkdir()
    for i in range(n):
        paras = [" ".join(rng.choice(words) for _ in range(rng.randint(8, 30))).capitalize() + "." for _ in range(40)]
        (root / f"note{i:02d}.md").write_text(f"# Note {i}\n\n" + "\n\n".join(paras) + "\n")


def port_of(argv: list[str]) -> int:
    """The port a server command listens on."""
    for flag in ("--port", "--listen"):
        if flag in argv:
            return int(argv[argv.index(flag) + 1].rsplit(":", 1)[-1])
    raise AssertionError(f"no port in {argv}")


def wait_listening(port: int, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"server exited {proc.returncode}:\n{log.read_text()[-3000:]}"
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise AssertionError(f"nothing listens on {port}:\n{log.read_text()[-3000:]}")


def check_output(what: str, rc: int, out: str) -> None:
    assert rc == 0, f"{what}\nexited {rc}:\n{out[-4000:]}"
    bad = [ln for ln in out.splitlines()  # a traceback, a log record at ERROR, or a CLI's "error:"
           if "Traceback" in ln or re.search(r"\b(ERROR|CRITICAL)\b", ln) or re.search(r"(^|: )error:", ln)]
    assert not bad, f"{what}\nprinted errors:\n" + "\n".join(bad[:10])


@pytest.fixture
def servers() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()


def test_the_readme_runs_as_written(tmp_path: Path, servers: list[subprocess.Popen[bytes]]) -> None:
    table = substitutions()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "BLOCKTRAIN_CACHE": str(tmp_path / "cache")}
    env.pop("BLOCKTRAIN_DATA", None)  # the README's commands name their data
    bin_dir = Path(sys.executable).parent
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"  # the blocktrain of this environment
    write_notes(tmp_path / "my-notes")
    token = ""
    ran = []
    for lang, body in blocks(README.read_text()):
        if lang == "python":
            for old, new in table:
                body = body.replace(old, new)
            r = subprocess.run([sys.executable, "-c", body], cwd=tmp_path, env=env, capture_output=True, text=True,
                               timeout=TIMEOUT_S)
            check_output("the README's Python snippet", r.returncode, r.stdout + r.stderr)
            assert r.stdout.strip(), "the chat answered nothing"
            ran.append("python")
            continue
        assert lang == "bash", lang
        for line in body.splitlines():
            line = line.split("  #")[0].strip()
            if not line:
                continue
            for old, new in table:
                line = line.replace(old, new)
            cmd_env = dict(env)
            if line.startswith("BLOCKTRAIN_TOKEN=..."):
                assert token, "no token was printed before the worker needs one"
                cmd_env["BLOCKTRAIN_TOKEN"] = token
                line = line.removeprefix("BLOCKTRAIN_TOKEN=...").strip()
            argv = shlex.split(line)
            assert argv[0] == "blocktrain", line
            if argv[1] in SERVERS:
                log = tmp_path / f"server{len(servers)}.log"
                proc = subprocess.Popen(argv, cwd=tmp_path, env=cmd_env, stdout=log.open("wb"), stderr=subprocess.STDOUT)
                servers.append(proc)
                wait_listening(port_of(argv), proc, log)
                ran.append(argv[1])
                continue
            r = subprocess.run(argv, cwd=tmp_path, env=cmd_env, capture_output=True, text=True, timeout=TIMEOUT_S)
            check_output(line, r.returncode, r.stdout + r.stderr)
            if argv[1:3] == ["token", "add"]:
                token = r.stdout.strip().splitlines()[-1]
            ran.append(" ".join(argv[1:3]))
    assert ran.count("python") == 1 and "worker" in " ".join(ran) and ran.count("serve") == 2, ran
    for p in servers:
        assert p.poll() is None, f"{p.args[1]} stopped early"
