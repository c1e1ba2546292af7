"""The stage processes of ``blocktrain bench serve``: three ``blocktrain serve`` processes and the bench client.

Where the stages run is a :class:`Placement`: loopback here (the per-hop delay
injected by the stages), or a ring of network namespaces in the benchmark harness
(``benchmarks/distributed/netns.py``). The client (:mod:`blocktrain.bench.serve_client`)
runs beside stage 0.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

from blocktrain.errors import ServeError

log = logging.getLogger(__name__)


def split_layers(n_layers: int, n_stages: int = 3) -> list[tuple[int, int]]:
    """Contiguous, nearly equal layer spans; the first stage (with the embeddings) gets any extra."""
    base, extra = divmod(n_layers, n_stages)
    spans, lo = [], 0
    for i in range(n_stages):
        size = base + (1 if i < extra else 0)
        spans.append((lo, lo + size - 1))
        lo += size
    return spans


def split_blocks(n_blocks: int, n_stages: int = 3) -> list[tuple[int, int]]:
    return split_layers(n_blocks, n_stages)


class Placement:
    """Where stage i (and the client, beside stage 0) runs, and how the others reach it.

    This one places every stage on 127.0.0.1, the stages injecting the per-hop delay on their forward link; the
    benchmark harness's ring of network namespaces (``benchmarks/distributed/netns.py``) overrides it.
    """

    @property
    def network_delays(self) -> bool:
        """True when the network itself delays each hop (the stages then inject no delay)."""
        return False

    def exec_prefix(self, i: int) -> list[str]:
        """Command prefix that runs a process where stage i runs (the client uses stage 0's)."""
        return []

    def listen_host(self, i: int) -> str:
        """Host stage i listens on."""
        return "127.0.0.1"

    def next_host(self, i: int) -> str:
        """Address stage i-1 uses for stage i."""
        return "127.0.0.1"

    def client_host(self, i: int) -> str:
        """Address the client uses for stage i."""
        return "127.0.0.1"

    def describe(self) -> dict[str, Any]:
        """The ``network`` entry of the result: ``namespaces``, ``delay`` and ``client``."""
        return {"namespaces": False, "delay": "injected on each stage's forward link",
                "client": "in stage 0's namespace, over its loopback (no delay)"}


class Pipeline:
    """Three `blocktrain serve` processes, placed by ``placement``."""

    def __init__(self, placement: Placement, delay_ms: float, base_port: int, log_dir: Path, device: str = "auto") -> None:
        self.placement = placement
        self.device = device  # every stage's --device
        self.inject_ms = 0.0 if placement.network_delays else delay_ms
        self.base_port = base_port
        self.log_dir = log_dir
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, model: str, spans: list[tuple[int, int]], source: list[str], threads: int) -> None:
        flag = "--layers" if model == "e2e" else "--blocks"
        n = len(spans)
        for i, (lo, hi) in enumerate(spans):
            port, nxt = self.base_port + i, self.base_port + (i + 1) % n
            listen, nxt_host = f"{self.placement.listen_host(i)}:{port}", self.placement.next_host((i + 1) % n)
            cmd = [*self.placement.exec_prefix(i), sys.executable, "-m", "blocktrain", "serve", "--model", model, flag, f"{lo}-{hi}",
                   "--listen", listen, "--next", f"{nxt_host}:{nxt}", "--delay-ms", str(self.inject_ms),
                   "--threads", str(threads), "--timeout", "900", "--max-frame-mib", "512", "--device", self.device,
                   *source]
            logf = (self.log_dir / f"{model}-stage{i}.log").open("wb")
            log.info("starting: %s", shlex.join(cmd))
            env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
            self.procs.append(subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env))

    def addresses(self) -> tuple[list[int], list[list[Any]]]:
        return [0], [[self.placement.client_host(i), self.base_port + i] for i in range(len(self.procs))]

    def client(self, plan: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        _, stages = self.addresses()
        plan = {**plan, "entry": stages[0], "stages": stages}
        plan_path, out_path = self.log_dir / "plan.json", self.log_dir / "client-out.json"
        plan_path.write_text(json.dumps(plan))
        out_path.unlink(missing_ok=True)
        cmd = [*self.placement.exec_prefix(0), sys.executable, "-m", "blocktrain.bench.serve_client", str(plan_path), str(out_path)]
        log.info("client: %s", shlex.join(cmd))
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        rc = subprocess.run(cmd, timeout=timeout_s, env=env).returncode
        for i, p in enumerate(self.procs):
            if p.poll() is not None:
                raise ServeError(f"stage {i} exited with {p.returncode}; see {self.log_dir}")
        if rc != 0 or not out_path.is_file():
            raise ServeError(f"bench client failed (exit {rc}); stage logs are in {self.log_dir}")
        return json.loads(out_path.read_text())  # type: ignore[no-any-return]

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs = []


