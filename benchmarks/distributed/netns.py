"""Three network namespaces in a ring, joined by veth pairs: a placement of the serving benchmark's stages.

    ns0 --link 1 (10.231.1.0/30)--> ns1 --link 2 (10.231.2.0/30)--> ns2 --link 3 (10.231.3.0/30)--> ns0

Stage i runs in namespace i and listens on all its addresses; the client runs
in ns0 beside stage 0 and reaches it over ns0's loopback. Each link gets a
netem delay on both ends where the kernel has netem; where it has not (e.g. a
minimal VM kernel), :attr:`Topology.netem` is False and the stages inject the
delay on their forward link instead. Only our own namespaces and addresses
are touched, and :meth:`Topology.teardown` removes them (also on errors).

A set-up :class:`Topology` is a :class:`blocktrain.bench.serve_pipeline.Placement`;
``benchmarks/serving/serve_netns.py`` runs ``blocktrain bench serve`` on it. Needs root.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from typing import Any

from blocktrain.bench.serve_pipeline import Placement
from blocktrain.errors import ServeError

log = logging.getLogger(__name__)

PREFIX = "btsv"
SUBNET = "10.231"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True)


def netns_available() -> bool:
    """Root, the ip tool and a working ``ip netns add``."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return False
    name = f"{PREFIX}probe"
    try:
        ok = _ip("netns", "add", name, check=False).returncode == 0
    finally:
        _ip("netns", "del", name, check=False)
    return ok


@dataclass
class Topology(Placement):
    """A ring of three namespaces; ``stage_addr[i]`` is how stage i-1 reaches stage i."""

    delay_ms: float
    n: int = 3
    names: list[str] = field(default_factory=list)
    stage_host: list[str] = field(default_factory=list)  # address the predecessor uses for stage i
    netem: bool = False

    def setup(self) -> Topology:
        self.names = [f"{PREFIX}{i}" for i in range(self.n)]
        self.teardown()  # leftovers of an interrupted run
        try:
            for ns in self.names:
                _ip("netns", "add", ns)
                _ip("-n", ns, "link", "set", "lo", "up")
                subprocess.run(["ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv4.tcp_slow_start_after_idle=0"],
                               check=False, capture_output=True)
            self.stage_host = [""] * self.n
            netem_ok = True
            for link in range(1, self.n + 1):
                a, b = (link - 1) % self.n, link % self.n  # link k joins ns(k-1) -> ns(k)
                va, vb = f"{PREFIX}{link}a", f"{PREFIX}{link}b"
                _ip("link", "add", va, "netns", self.names[a], "type", "veth", "peer", "name", vb,
                    "netns", self.names[b])
                _ip("-n", self.names[a], "addr", "add", f"{SUBNET}.{link}.1/30", "dev", va)
                _ip("-n", self.names[b], "addr", "add", f"{SUBNET}.{link}.2/30", "dev", vb)
                for ns, dev in ((self.names[a], va), (self.names[b], vb)):
                    _ip("-n", ns, "link", "set", dev, "up")
                    if self.delay_ms > 0 and netem_ok:
                        r = subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root",
                                            "netem", "delay", f"{self.delay_ms}ms"], capture_output=True, text=True)
                        netem_ok = r.returncode == 0
                        if not netem_ok:
                            log.warning("netem unavailable (%s); stages will inject the delay", r.stderr.strip())
                self.stage_host[b] = f"{SUBNET}.{link}.2"
            self.netem = netem_ok and self.delay_ms > 0
            if not self.netem:
                for link in range(1, self.n + 1):  # no partial netem: injected delay everywhere instead
                    a, b = (link - 1) % self.n, link % self.n
                    for ns, dev in ((self.names[a], f"{PREFIX}{link}a"), (self.names[b], f"{PREFIX}{link}b")):
                        subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root"],
                                       capture_output=True)
        except subprocess.CalledProcessError as exc:
            self.teardown()
            raise ServeError(f"could not build the namespace ring: {exc.stderr or exc}") from exc
        log.info("namespaces %s up, delay %s ms per hop (%s)", self.names, self.delay_ms,
                 "netem" if self.netem else "injected by the stages")
        return self

    def stats_host(self, i: int) -> str:
        """Address of stage i as reached from ns0 (where the client runs)."""
        if i == 0:
            return "127.0.0.1"
        if i == 1:
            return f"{SUBNET}.1.2"
        return f"{SUBNET}.{self.n}.1" if i == self.n - 1 else self.stage_host[i]

    def exec_prefix(self, i: int) -> list[str]:
        return ["ip", "netns", "exec", self.names[i]]

    # The rest of Placement's methods (blocktrain.bench.serve_pipeline), for the ring.
    @property
    def network_delays(self) -> bool:
        return self.netem

    def listen_host(self, i: int) -> str:
        return "0.0.0.0"  # every address of stage i's namespace

    def next_host(self, i: int) -> str:
        return self.stage_host[i]

    def client_host(self, i: int) -> str:
        return self.stats_host(i)

    def describe(self) -> dict[str, Any]:
        return {"namespaces": True, "delay": "netem" if self.netem else "injected on each stage's forward link",
                "client": "in stage 0's namespace, over its loopback (no delay)"}

    def teardown(self) -> None:
        for ns in self.names or [f"{PREFIX}{i}" for i in range(self.n)]:
            _ip("netns", "del", ns, check=False)
