"""The stage processes of ``blocktrain bench serve``: three ``blocktrain serve`` processes and the bench client.

The stages run in network namespaces (:mod:`blocktrain.bench.netns`) or on
loopback; the client (:mod:`blocktrain.bench.serve_client`) runs beside stage 0.
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

from blocktrain.bench.netns import Topology
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


class Pipeline:
    """Three `blocktrain serve` processes, in namespaces or on loopback."""

    def __init__(self, topo: Topology | None, delay_ms: float, base_port: int, log_dir: Path) -> None:
        self.topo = topo
        self.inject_ms = delay_ms if topo is None or not topo.netem else 0.0
        self.base_port = base_port
        self.log_dir = log_dir
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, model: str, spans: list[tuple[int, int]], source: list[str], threads: int) -> None:
        flag = "--layers" if model == "e2e" else "--blocks"
        n = len(spans)
        for i, (lo, hi) in enumerate(spans):
            port, nxt = self.base_port + i, self.base_port + (i + 1) % n
            if self.topo is not None:
                listen, prefix = f"0.0.0.0:{port}", self.topo.exec_prefix(i)
                nxt_host = self.topo.stage_host[(i + 1) % n]
            else:
                listen, nxt_host, prefix = f"127.0.0.1:{port}", "127.0.0.1", []
            cmd = [*prefix, sys.executable, "-m", "blocktrain", "serve", "--model", model, flag, f"{lo}-{hi}",
                   "--listen", listen, "--next", f"{nxt_host}:{nxt}", "--delay-ms", str(self.inject_ms),
                   "--threads", str(threads), "--timeout", "900", "--max-frame-mib", "512", *source]
            logf = (self.log_dir / f"{model}-stage{i}.log").open("wb")
            log.info("starting: %s", shlex.join(cmd))
            env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
            self.procs.append(subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env))

    def addresses(self) -> tuple[list[int], list[list[Any]]]:
        n = len(self.procs)
        if self.topo is not None:
            return [0], [[self.topo.stats_host(i), self.base_port + i] for i in range(n)]
        return [0], [["127.0.0.1", self.base_port + i] for i in range(n)]

    def client(self, plan: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        _, stages = self.addresses()
        plan = {**plan, "entry": stages[0], "stages": stages}
        plan_path, out_path = self.log_dir / "plan.json", self.log_dir / "client-out.json"
        plan_path.write_text(json.dumps(plan))
        out_path.unlink(missing_ok=True)
        prefix = self.topo.exec_prefix(0) if self.topo is not None else []
        cmd = [*prefix, sys.executable, "-m", "blocktrain.bench.serve_client", str(plan_path), str(out_path)]
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


