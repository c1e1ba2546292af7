"""The gateway under load and under bad requests: status codes, 5xx and logged tracebacks, counted.

    python benchmarks/serving/gateway_load.py --json benchmarks/results/gateway-load.json [--factor 4] [--bytes 16]

Two stages of a tiny random-weight stack (its KV cache holds ``--cache-requests`` requests, 64 by default, each)
run in this process on loopback behind the OpenAI-style gateway. Then:

1. ``factor`` x the cache's capacity of completions at once, in each mode the stack serves (spec, ar): every
   request must come back 200 with ``max_tokens`` bytes; the stages' evictions show the cache was overrun.
2. Each of the gateway's error cases (hostile numbers, deep nesting, bad parameters): every answer must be a 4xx;
   and a few valid requests at an edge (a temperature of 1e-300 samples greedily): every answer must be a 200.

Tracebacks are counted from every log record that carries exception info, in this process (gateway and stages).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import dataclasses
import json
import logging
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import torch
import uvicorn

from blocktrain.bench.machine import machine_info
from blocktrain.config import Objective
from blocktrain.serve.gateway.app import GatewayOptions, make_app
from blocktrain.serve.runtime.kvcache import CacheOptions
from blocktrain.serve.runtime.loading import parse_shape, random_run_span
from blocktrain.serve.stage.options import StageOptions
from blocktrain.serve.stage.server import StageThread

ROOT = Path(__file__).resolve().parents[2]

SHAPE = "d_model=64,n_heads=2,n_layers=4,n_blocks=4,context=64,mlp_ratio=2"
ERROR_CASES: list[tuple[str, Any]] = [  # (what, body) sent to /v1/completions; raw strings are sent as they are
    ("number with 5000 digits", '{"prompt": "a", "max_tokens": ' + "9" * 5000 + "}"),
    ("float past range", '{"prompt": "a", "temperature": 1e999}'),
    ("nested 100k deep", '{"prompt": ' + "[" * 100_000 + "]" * 100_000 + "}"),
    ("logprobs above the limit", {"prompt": "a", "logprobs": 1000, "echo": True, "max_tokens": 0}),
    ("n above the limit", {"prompt": "a", "n": 1000}),
    ("unknown role", "chat:" + json.dumps({"messages": [{"role": "wizard", "content": "hi"}]})),
    ("empty messages", "chat:" + json.dumps({"messages": []})),
    ("token id 256", {"prompt": [97, 256]}),
    ("not JSON", "{"),
    ("max_tokens 0 without echo", {"prompt": "a", "max_tokens": 0}),
    ("stream with logprobs", {"prompt": "a", "logprobs": 1, "stream": True}),
]


EDGE_CASES: list[tuple[str, Any]] = [  # (what, body): valid requests at an edge; each must get a 200
    ("temperature 1e-300 (sampled greedily)", {"prompt": "a", "temperature": 1e-300, "max_tokens": 4}),
    ("top_k 1000 (every byte kept)", {"prompt": "a", "top_k": 1000, "max_tokens": 4}),
    ("token-id prompt, echo, max_tokens 0, logprobs 20", {"prompt": [97, 98, 99], "echo": True, "max_tokens": 0,
                                                          "logprobs": 20}),
]


class TracebackCounter(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.count = 0
        self._guard = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info:
            with self._guard:
                self.count += 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve_gateway(opts: GatewayOptions) -> tuple[uvicorn.Server, threading.Thread, str]:
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(make_app(opts), host="127.0.0.1", port=port, log_level="warning",
                                           limit_concurrency=opts.max_connections))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    return server, thread, f"http://127.0.0.1:{port}"


async def burst(url: str, n: int, mode: str, n_bytes: int) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
        async def one(i: int) -> tuple[int, int]:
            r = await client.post("/v1/completions", json={"prompt": f"request {i}: Sega", "max_tokens": n_bytes,
                                                           "mode": mode, "temperature": 0.8, "seed": i})
            got = len(base64.b64decode(r.json()["choices"][0]["raw_bytes"])) if r.status_code == 200 else -1
            return r.status_code, got

        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(i) for i in range(n)))
        wall = time.perf_counter() - t0
    codes: dict[str, int] = {}
    for code, _ in results:
        codes[str(code)] = codes.get(str(code), 0) + 1
    short = sum(1 for code, got in results if code == 200 and got != n_bytes)
    return {"mode": mode, "requests": n, "status_codes": codes, "errors": n - codes.get("200", 0) + short,
            "wall_s": round(wall, 2), "requests_per_s": round(n / wall, 1)}


def send_cases(url: str, cases: list[tuple[str, Any]]) -> list[dict[str, Any]]:
    out = []
    with httpx.Client(base_url=url, timeout=60) as client:
        for what, body in cases:
            path = "/v1/completions"
            if isinstance(body, str) and body.startswith("chat:"):
                path, body = "/v1/chat/completions", body[5:]
            r = (client.post(path, content=body, headers={"content-type": "application/json"}) if isinstance(body, str)
                 else client.post(path, json=body))
            err = r.json().get("error", {}) if r.headers.get("content-type", "").startswith("application/json") else {}
            out.append({"case": what, "status": r.status_code, "code": err.get("code")})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--factor", type=int, default=4, help="concurrent requests as a multiple of the cache capacity")
    ap.add_argument("--cache-requests", type=int, default=CacheOptions().max_requests, help="requests each stage caches")
    ap.add_argument("--bytes", type=int, default=16, help="max_tokens of each request")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    counter = TracebackCounter()
    logging.getLogger().addHandler(counter)
    torch.set_num_threads(1)
    cfg = parse_shape(SHAPE, objective=Objective.STACK)
    cache = dataclasses.replace(CacheOptions(), max_requests=args.cache_requests)
    spans = [random_run_span(cfg, lo, hi, seed=0, cache=cache) for lo, hi in ((0, 1), (2, 3))]
    ports = [free_port(), free_port()]
    stages = [StageThread(spans[0], "127.0.0.1", ports[0], StageOptions(next_stages=(("127.0.0.1", ports[1]),))),
              StageThread(spans[1], "127.0.0.1", ports[1], StageOptions(next_stages=(("127.0.0.1", ports[0]),)))]
    n = args.factor * args.cache_requests
    opts = GatewayOptions(pipeline=f"127.0.0.1:{ports[0]}", request_timeout_s=300, max_connections=n + 16)
    server, thread, url = serve_gateway(opts)
    try:
        runs = [asyncio.run(burst(url, n, mode, args.bytes)) for mode in ("ar", "spec")]
        cases = send_cases(url, ERROR_CASES)
        edges = send_cases(url, EDGE_CASES)
    finally:
        server.should_exit = True
        thread.join(20)
        for s in stages:
            s.stop()
    evictions = [s.describe()["cache_evictions"] for s in spans]
    result = {
        "benchmark": "gateway-load", "shape": SHAPE, "cache_requests_per_stage": args.cache_requests,
        "concurrent_requests": n, "max_tokens": args.bytes, "bursts": runs, "stage_cache_evictions": evictions,
        "error_cases": cases, "error_cases_5xx": sum(1 for c in cases if c["status"] >= 500),
        "error_cases_not_4xx": sum(1 for c in cases if not 400 <= c["status"] < 500),
        "edge_cases": edges, "edge_cases_not_200": sum(1 for c in edges if c["status"] != 200),
        "tracebacks_logged": counter.count, "machine": machine_info(),
        "command": "python benchmarks/serving/gateway_load.py " + " ".join(sys.argv[1:]),
    }
    print("| mode | requests at once | status codes | errors | wall (s) |\n|---|---|---|---|---|")
    for r in runs:
        print(f"| {r['mode']} | {r['requests']} | {r['status_codes']} | {r['errors']} | {r['wall_s']} |")
    print(f"\nKV cache evictions per stage: {evictions}; error cases: {len(cases)}, 5xx: {result['error_cases_5xx']}, "
          f"not 4xx: {result['error_cases_not_4xx']}; edge cases: {len(edges)}, not 200: {result['edge_cases_not_200']}; "
          f"tracebacks logged: {counter.count}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    ok = (all(r["errors"] == 0 for r in runs) and result["error_cases_not_4xx"] == 0 and result["edge_cases_not_200"] == 0
          and counter.count == 0)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
