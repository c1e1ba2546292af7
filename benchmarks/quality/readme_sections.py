"""The README's own sections, run as written: every shell block of "Train on your own text", "A decentralised run"
and "Serving", then the Python snippet, in order, in a fresh directory, each command timed.

One substitution table says what changes (:func:`substitutions`): free loopback ports for the hosts, a folder of 30
generated notes for ``~/my-notes``, and, for the test suite (``tests/test_readme.py``), a CPU-sized preset. Run
alone, with the README's own presets, it measures what the README states and writes it as JSON:

    flock /tmp/blocktrain-cpu.lock python -m benchmarks.quality.readme_sections --json benchmarks/results/readme-sections.json

A command that exits non-zero, or prints a traceback or an error, fails the run. Servers (coordinator, stages,
gateway) start in the background and are waited for on their port; the worker runs until its coordinator says the
run has finished.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shlex
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"
SECTIONS = ("## Train on your own text", "## A decentralised run", "## Serving")
SERVERS = ("coordinator", "serve", "gateway")  # commands that run until stopped
CPU_VARIANT = ("--preset cpu-small --rounds 24", "--preset tiny --objective stack --rounds 4")  # the README's own


@dataclass(frozen=True)
class Ran:
    """One command of the README as it ran."""

    section: str  # the README section it is in
    command: str  # as written in the README
    ran: str  # as run, after the substitutions
    seconds: float  # wall time (a server: until it listened)
    facts: dict[str, float | int | bool | str] = field(default_factory=dict)  # what it printed or left, for the text


def blocks(text: str) -> list[tuple[str, str, str]]:
    """(section, language, body) of every fenced block in the README's SECTIONS, in order."""
    out = []
    for title in SECTIONS:
        start = text.index(title)
        end = text.find("\n## ", start + len(title))
        part = text[start : end if end >= 0 else None]
        out += [(title.removeprefix("## "), m.group(1), m.group(2)) for m in re.finditer(r"```(\w+)\n(.*?)```", part, re.S)]
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def substitutions(preset: tuple[str, str] | None = None) -> list[tuple[str, str]]:
    """The one table of what changes in the README's commands (applied in this order): ``preset`` (old, new) for
    the training preset, the README's own CPU variant of the decentralised run, the notes folder and the hosts."""
    coord, a, b, gw = free_port(), free_port(), free_port(), free_port()
    return [
        *([preset] if preset else []),
        CPU_VARIANT,
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


def wait_listening(port: int, proc: subprocess.Popen[bytes], log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
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


def run_readme(root: Path, table: list[tuple[str, str]], servers: list[subprocess.Popen[bytes]],
               timeout_s: float = 240.0, readme: Path = README) -> list[Ran]:
    """Run the README's sections in ``root`` with ``table``; the servers it starts are appended to ``servers`` (the
    caller stops them). Returns every command as it ran, timed."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONUNBUFFERED": "1",
           "BLOCKTRAIN_CACHE": str(root / "cache")}
    env.pop("BLOCKTRAIN_DATA", None)  # the README's commands name their data
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # the blocktrain of this environment
    write_notes(root / "my-notes")
    token = ""
    ran: list[Ran] = []
    for section, lang, body in blocks(readme.read_text()):
        if lang == "python":
            run = body
            for old, new in table:
                run = run.replace(old, new)
            t0 = time.perf_counter()
            r = subprocess.run([sys.executable, "-c", run], cwd=root, env=env, capture_output=True, text=True,
                               timeout=timeout_s)
            check_output("the README's Python snippet", r.returncode, r.stdout + r.stderr)
            assert r.stdout.strip(), "the chat answered nothing"
            ran.append(Ran(section, "python: the openai snippet", "python", time.perf_counter() - t0))
            continue
        assert lang == "bash", lang
        for written in body.splitlines():
            line = written.split("  #")[0].strip()
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
            t0 = time.perf_counter()
            if argv[1] in SERVERS:
                log = root / f"server{len(servers)}.log"
                proc = subprocess.Popen(argv, cwd=root, env=cmd_env, stdout=log.open("wb"), stderr=subprocess.STDOUT)
                servers.append(proc)
                wait_listening(port_of(argv), proc, log, timeout_s)
            else:
                r = subprocess.run(argv, cwd=root, env=cmd_env, capture_output=True, text=True, timeout=timeout_s)
                check_output(line, r.returncode, r.stdout + r.stderr)
                if argv[1:3] == ["token", "add"]:
                    token = r.stdout.strip().splitlines()[-1]
            seconds = time.perf_counter() - t0
            ran.append(Ran(section, written.split("  #")[0].strip(), line, seconds, facts(argv, r.stdout if argv[1]
                                                                                           not in SERVERS else "")))
    return ran


def facts(argv: list[str], out: str) -> dict[str, float | int | bool | str]:
    """What the README's text says of a command: a worker's run as its coordinator reports it afterwards (finished,
    rounds, bytes pushed per accepted update over the block's fp32 bytes), an eval's CE."""
    if argv[1] == "worker":
        url = argv[argv.index("--coordinator") + 1]
        with urllib.request.urlopen(f"{url}/v1/status", timeout=30) as resp:
            st = json.load(resp)
        pushed = sum(w["bytes_in"] for w in st["workers"])
        return {"finished": st["finished"], "rounds": sum(b["version"] for b in st["blocks"]),
                "updates_accepted": st["updates_accepted"],
                "bytes_in_per_update_over_fp32": pushed / max(1, st["updates_accepted"]) / st["block_fp32_bytes"]}
    if argv[1] == "eval":
        ce = re.findall(r"(\d+\.\d+) nats/byte", out)
        return {"ce": float(ce[0])} if ce else {}  # the CE line comes first (a gain line follows)
    return {}


def stop(servers: list[subprocess.Popen[bytes]]) -> None:
    for p in servers:
        p.terminate()
    for p in servers:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", type=Path, required=True, help="write every command's time here")
    ap.add_argument("--timeout-s", type=float, default=3600.0, help="seconds any one command may take")
    args = ap.parse_args(argv)
    servers: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory(prefix="readme-sections-") as tmp:
        try:
            ran = run_readme(Path(tmp), substitutions(), servers, args.timeout_s)
        finally:
            stop(servers)
    for r in ran:
        print(f"{r.seconds:8.1f} s  {r.command}")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=README.parent, capture_output=True, text=True,
                            check=False).stdout.strip()
    args.json.write_text(json.dumps({
        "what": "the README's sections 'Train on your own text', 'A decentralised run' and 'Serving', run as written "
                "in a fresh directory on 30 generated notes (hosts on 127.0.0.1; the decentralised run is the README's "
                "own CPU variant); a server's time is until it listens",
        "command": "python -m benchmarks.quality.readme_sections " + " ".join(argv if argv is not None else sys.argv[1:]),
        "commit": commit, "commands": [asdict(r) for r in ran]}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
