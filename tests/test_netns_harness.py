"""The benchmark harness's namespace ring (benchmarks/distributed/netns.py) and its serve-bench entry point.

Building the ring needs root and ``ip netns``; those tests skip otherwise. The rest runs anywhere.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from benchmarks.distributed.netns import Topology, netns_available
from benchmarks.serving import serve_netns

from blocktrain.bench.serve_pipeline import Placement


def test_both_placements_give_what_the_pipeline_needs() -> None:
    topo = Topology(delay_ms=25, names=["ns0", "ns1", "ns2"], stage_host=["", "10.231.1.2", "10.231.2.2"], netem=True)
    placements = [Placement(), topo]
    for p in placements:
        assert {"namespaces", "delay", "client"} <= set(p.describe())
    assert Placement().exec_prefix(1) == [] and not Placement().network_delays
    assert topo.exec_prefix(1) == ["ip", "netns", "exec", "ns1"] and topo.network_delays
    assert (topo.next_host(1), topo.client_host(0), topo.listen_host(2)) == ("10.231.1.2", "127.0.0.1", "0.0.0.0")


def test_serve_netns_refuses_without_namespaces(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(serve_netns, "netns_available", lambda: False)
    assert serve_netns.main([]) == 2
    assert "run as root" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.skipif(not netns_available(), reason="needs root and 'ip netns'")
def test_namespace_ring_is_built_and_removed() -> None:
    topo = Topology(delay_ms=25).setup()
    try:
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert all(name in listed for name in topo.names)
        listen = ("import socket; s = socket.socket(); s.bind(('0.0.0.0', 47999)); s.listen(); "
                  "c, _ = s.accept(); c.sendall(b'ok')")
        server = subprocess.Popen([*topo.exec_prefix(1), sys.executable, "-c", listen])
        connect = ("import socket, time\nfor _ in range(50):\n try:\n  c = socket.create_connection"
                   f"(('{topo.stage_host[1]}', 47999), timeout=2); break\n except OSError: time.sleep(0.1)\n"
                   "assert c.recv(2) == b'ok'")
        client = subprocess.run([*topo.exec_prefix(0), sys.executable, "-c", connect], capture_output=True, timeout=30)
        server.wait(10)
        assert client.returncode == 0, client.stderr
    finally:
        topo.teardown()
    assert not any(n in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
                   for n in topo.names)

