"""``blocktrain bench serve`` with its three stages in three network namespaces (needs root and ``ip netns``).

    sudo .venv/bin/python -m benchmarks.serving.serve_netns --json benchmarks/results/serve.json [--stack-run RUN] ...

It takes every flag of ``blocktrain bench serve`` and runs the product's benchmark
with the namespace ring of :mod:`netns` as the stages' placement: veth links in a
ring, netem delay per hop where the kernel has it, else injected by the stages as
on loopback. The client runs in stage 0's namespace. The ring is removed
afterwards, also on errors.
"""

from __future__ import annotations

import logging
import shlex
import sys

from benchmarks.distributed.netns import Topology, netns_available
from blocktrain.bench.serve import run_serve_bench
from blocktrain.cli.main import build_parser
from blocktrain.cli.serving import bench_options
from blocktrain.errors import BlockTrainError


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(["bench", "serve", *argv])
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not netns_available():
        sys.stderr.write("error: network namespaces are unavailable: run as root on a machine with 'ip netns' "
                         "(or run 'blocktrain bench serve' on loopback)\n")
        return 2
    opts = bench_options(args)
    topo = Topology(opts.hop_delay_ms).setup()
    try:
        run_serve_bench(opts, topo, command=shlex.join(["python", "-m", "benchmarks.serving.serve_netns", *argv]))
    except BlockTrainError as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 1
    finally:
        topo.teardown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
