"""The client half of ``blocktrain bench serve``: runs beside stage 0 (in its namespace).

``python -m blocktrain.bench.serve_client PLAN.json OUT.json`` waits for every
stage, warms each mode up once (the first opens the ring), then for each task times one output (``repeat``
times) with the traffic counters of every stage read before and after, and
generates one output per prompt (concurrently) for the quality numbers.
Optionally it scores test bytes teacher-forced through the pipeline.
"""

from __future__ import annotations

import asyncio
import json
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from blocktrain.errors import ServeError, StageUnavailableError
from blocktrain.evaluate.scoring import score_split
from blocktrain.serve.client.pipeline import PipelineClient, generate_with
from blocktrain.serve.wire.frames import Frame, FrameKind, encode

log = logging.getLogger(__name__)


async def wait_ready(addrs: list[tuple[str, int]], deadline_s: float) -> None:
    t_end = time.monotonic() + deadline_s
    for addr in addrs:
        while True:
            try:
                async with PipelineClient(addr, timeout_s=5, connect_attempts=1) as c:
                    if c.stage.state == "serving":
                        break
            except ServeError:
                pass
            if time.monotonic() > t_end:
                raise StageUnavailableError(f"stage {addr[0]}:{addr[1]} did not come up within {deadline_s:.0f}s")
            await asyncio.sleep(0.5)


async def _stats(clients: list[PipelineClient]) -> tuple[int, int]:
    """(sum of bytes_out over stages, bytes of the PONGs those stats will have cost)."""
    total, pong_bytes = 0, 0
    for c in clients:
        info = await c.ping()
        total += int(info["stats"]["bytes_out"])
        pong_bytes += len(encode(Frame(FrameKind.PONG, "x" * 16, params=info)))
    return total, pong_bytes


async def timed_output(
    c: PipelineClient, task: dict[str, Any], prompt: bytes, n: int, seed: int, **kw: Any
) -> tuple[bytes, int | None]:
    """One output of a task's mode, and the pipeline traversals it took (spec only; None for the other modes)."""
    if task["mode"] == "spec":
        res = await c.generate_spec(prompt, n, seed=seed, **draft_settings(task), **kw)
        return res.data, res.traversals
    return await generate_with(c, task["mode"], prompt, n, sweeps=int(task.get("sweeps", 1)), seed=seed, **kw), None


def draft_settings(task: dict[str, Any]) -> dict[str, int]:
    """draft_min/draft_max of a spec task (defaults 1 and 16); empty for the other modes."""
    if task["mode"] != "spec":
        return {}
    return {"draft_min": int(task.get("draft_min", 1)), "draft_max": int(task.get("draft_max", 16))}


async def run_plan(plan: dict[str, Any]) -> dict[str, Any]:
    entry = tuple(plan["entry"])
    stage_addrs = [tuple(a) for a in plan["stages"]]
    await wait_ready(stage_addrs, plan.get("ready_s", 300))  # type: ignore[arg-type]
    prompts = [bytes(p) for p in plan["prompts"]]
    n = int(plan["output_bytes"])
    kw = {"temperature": float(plan["temperature"]), "top_k": int(plan["top_k"])}
    out: dict[str, Any] = {"tasks": {}}
    stats_clients = [PipelineClient(a, timeout_s=30) for a in stage_addrs]  # type: ignore[arg-type]
    for sc in stats_clients:
        await sc.connect()
    async with PipelineClient(entry, timeout_s=float(plan.get("timeout_s", 600))) as c:  # type: ignore[arg-type]
        warmed: set[str] = set()
        for task in plan["tasks"]:
            mode, sweeps = task["mode"], int(task.get("sweeps", 1))
            if mode not in warmed:  # each mode's first use (the ring's opening, its kernels) is timed in no row: only
                warmed.add(mode)    # the first task's mode was warmed, and the others' first rows paid for theirs
                await generate_with(c, mode, prompts[0], min(n, 4), sweeps=1, seed=999, **kw, **draft_settings(task))
            n = int(task.get("output_bytes", plan["output_bytes"]))  # a long row's own output length
            times, wire, client_bytes, texts, traversals = [], [], [], [], []
            for r in range(int(task.get("repeat", 1))):
                before, pong = await _stats(stats_clients)
                c0 = c.counters.bytes_out
                t0 = time.perf_counter()
                text, trav = await timed_output(c, task, prompts[0], n, int(plan["seed"]) + r, **kw)
                times.append(time.perf_counter() - t0)
                if trav is not None:
                    traversals.append(trav)
                after, _ = await _stats(stats_clients)
                wire.append(after - before - pong)
                client_bytes.append(c.counters.bytes_out - c0)
                texts.append(text)
                log.info("%s: %.3fs, %d stage bytes out", task["name"], times[-1], wire[-1])
            res: dict[str, Any] = {
                "mode": mode, "sweeps": sweeps, "seconds_all": times, "seconds": statistics.median(times),
                "stage_bytes_out": int(statistics.median(wire)),
                "client_bytes_out": int(statistics.median(client_bytes)),
                "timing_output": list(texts[0]),
            }
            if traversals:
                res["traversals"] = statistics.median(traversals)
            if task.get("quality", True):
                t0 = time.perf_counter()
                outs = await asyncio.gather(*(
                    generate_with(c, mode, p, n, sweeps=sweeps, seed=int(plan["seed"]) + 100 + j, **kw, **draft_settings(task))
                    for j, p in enumerate(prompts)
                ))
                res["quality_outputs"] = [list(o) for o in outs]
                res["quality_seconds_concurrent"] = time.perf_counter() - t0
            out["tasks"][task["name"]] = res
        if plan.get("teacher_forced_path"):
            data = np.fromfile(plan["teacher_forced_path"], dtype=np.uint8)[: int(plan["teacher_forced_bytes"]) + 1]

            async def score_all() -> float:
                windows: list[torch.Tensor] = []
                results: dict[int, torch.Tensor] = {}

                def fn(x: torch.Tensor) -> torch.Tensor:  # first pass only collects the windows
                    windows.append(x)
                    return torch.zeros(1, *x.shape, 256)

                score_split(fn, data, c.stage.context, batch_size=8)
                got = await asyncio.gather(*(c.score(w, seed=0) for w in windows))
                for i, g in enumerate(got):
                    results[i] = torch.log_softmax(g.float(), -1).unsqueeze(0)
                it = iter(range(len(windows)))
                res = score_split(lambda x: results[next(it)], data, c.stage.context, batch_size=8)
                return res.ce_nats_per_byte

            t0 = time.perf_counter()
            out["teacher_forced_ce_pipeline"] = await score_all()
            out["teacher_forced_seconds"] = time.perf_counter() - t0
    for sc in stats_clients:
        await sc.close()
    return out


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)
    plan = json.loads(Path(argv[0]).read_text())
    result = asyncio.run(run_plan(plan))
    Path(argv[1]).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
