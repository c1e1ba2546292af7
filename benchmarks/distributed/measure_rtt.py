"""Median round-trip time of small HTTP requests over one kept-alive connection.

    python benchmarks/distributed/measure_rtt.py http://10.77.1.1:8470/ --n 30
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import httpx

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("url")
    ap.add_argument("--n", type=int, default=30)
    a = ap.parse_args()
    with httpx.Client(timeout=30) as h:
        h.get(a.url)  # connect first: time requests, not the handshake
        samples = []
        for _ in range(a.n):
            t0 = time.perf_counter()
            h.get(a.url)
            samples.append(1000 * (time.perf_counter() - t0))
    print(json.dumps({"rtt_ms_median": statistics.median(samples), "rtt_ms_min": min(samples), "n": a.n}))
