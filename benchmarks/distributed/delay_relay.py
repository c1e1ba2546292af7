"""A TCP relay that adds a fixed one-way delay in each direction (userspace latency emulation).

Used by scripts/netns_three_hosts.sh when the kernel has no netem qdisc
(CONFIG_NET_SCH_NETEM unset): every chunk read from one side is written to the
other side ``--delay-ms`` later, in order, so a request/response exchange gains
2 x delay of round-trip time. Bandwidth is capped separately with tbf on the veths.

    python benchmarks/distributed/delay_relay.py --listen 10.77.1.1:8470 --listen 10.77.2.1:8470 \
        --target 127.0.0.1:8471 --delay-ms 20
"""

from __future__ import annotations

import argparse
import asyncio
import logging

log = logging.getLogger("delay_relay")


async def pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float) -> None:
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def feed() -> None:
        while True:
            data = await reader.read(1 << 16)
            await queue.put((loop.time() + delay, data))
            if not data:
                return

    feeder = asyncio.create_task(feed())
    try:
        while True:
            due, data = await queue.get()
            wait = due - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            if not data:
                if writer.can_write_eof():
                    writer.write_eof()
                return
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        return
    finally:
        feeder.cancel()


async def handle(cr: asyncio.StreamReader, cw: asyncio.StreamWriter, target: tuple[str, int], delay: float) -> None:
    try:
        tr, tw = await asyncio.open_connection(*target)
    except OSError as exc:
        log.warning("target %s unreachable: %s", target, exc)
        cw.close()
        return
    await asyncio.gather(pump(cr, tw, delay), pump(tr, cw, delay), return_exceptions=True)
    for w in (cw, tw):
        w.close()


async def main(listen: list[str], target: str, delay_ms: float) -> None:
    th, tp = target.rsplit(":", 1)
    servers = []
    for addr in listen:
        h, p = addr.rsplit(":", 1)
        servers.append(await asyncio.start_server(
            lambda r, w: handle(r, w, (th, int(tp)), delay_ms / 1000), h, int(p)))
        log.info("relaying %s -> %s with %.1f ms each way", addr, target, delay_ms)
    await asyncio.gather(*(s.serve_forever() for s in servers))


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--listen", action="append", required=True, help="HOST:PORT to listen on (repeatable)")
    ap.add_argument("--target", required=True, help="HOST:PORT to forward to")
    ap.add_argument("--delay-ms", type=float, default=20.0, help="one-way delay added in each direction")
    a = ap.parse_args()
    asyncio.run(main(a.listen, a.target, a.delay_ms))
