"""Quality and compute measures of ``blocktrain bench serve``: generative CE, repeats, traversal time, prompts."""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np
import torch

from blocktrain.bench.serve_options import ServeBenchOptions
from blocktrain.checkpoint.run import RunDir
from blocktrain.config import RunConfig
from blocktrain.data.dataset import DataDir, eval_windows, resolve_run_data
from blocktrain.device import synchronize
from blocktrain.evaluate.assembled import AssembledModel, E2EModel
from blocktrain.sampling import EMPTY_PROMPT


def generative_ce(e2e: E2EModel, prompt: bytes, output: bytes) -> float:
    """CE (nats/byte) of ``output`` under the E2E model, given ``prompt``.

    An output that fits one window is scored in the last window of prompt + output; a longer one in
    ``blocktrain eval``'s windows over prompt + output (:func:`eval_windows`: each byte once, with at least half a
    context before it), averaged over the output's bytes.

    An empty prompt is scored as generation continues it, after :data:`EMPTY_PROMPT`: every output byte is scored,
    its first too, and the mean is over all of them.
    """
    prompt = prompt or EMPTY_PROMPT  # else the first output byte had no history: scored by none, yet counted in n
    n = len(output)
    if n <= e2e.context:
        seq = (prompt + output)[-(e2e.context + 1) :]
        x = torch.tensor(list(seq[:-1]), dtype=torch.uint8).unsqueeze(0)
        y = torch.tensor(list(seq[1:]), dtype=torch.long)
        logp = e2e.log_probs(x)[0, 0]  # (t, 256) on the model's device
        return float(-logp[-n:].gather(-1, y[-n:].to(logp.device).unsqueeze(-1)).mean())
    text = torch.tensor(list(prompt + output), dtype=torch.long)
    total = 0.0
    for start, length, first in eval_windows(len(text), e2e.context):
        x = text[start : start + length].to(torch.uint8).unsqueeze(0)
        y = text[start + 1 : start + length + 1]
        keep = max(first, len(prompt) - 1 - start)  # window position p predicts byte start + p + 1: the output's
        logp = e2e.log_probs(x)[0, 0]  # (length, 256) on the model's device
        total -= float(logp[keep:].gather(-1, y[keep:].to(logp.device).unsqueeze(-1)).sum())
    return total / n


def output_quality(e2e: E2EModel, prompts: list[bytes], task: dict[str, Any]) -> dict[str, Any]:
    """Generative CE (under the E2E model) and repetition of a task's outputs, one per prompt."""
    outs = [bytes(o) for o in task["quality_outputs"]]
    ces = [generative_ce(e2e, p, o) for p, o in zip(prompts, outs, strict=True)]
    return {"generative_ce": statistics.mean(ces), "generative_ce_per_prompt": ces,
            "repeat_4gram_fraction": statistics.mean(repeat_fraction(o) for o in outs),
            "sample": outs[0].decode("utf-8", errors="replace")}


def repeat_fraction(text: bytes, n: int = 4) -> float:
    """Fraction of n-grams of ``text`` that already occurred earlier in it (1.0 = all repeats)."""
    seen, rep, total = set(), 0, 0
    for i in range(len(text) - n + 1):
        g = text[i : i + n]
        rep += g in seen
        seen.add(g)
        total += 1
    return rep / max(total, 1)


def traversal_compute_s(cfg: RunConfig, model: AssembledModel, t: int, repeat: int = 5) -> float:
    """Median wall time of one traversal of the block stack on a text of t bytes, one thread (as a stage).

    A traversal carries at most one context window (a longer text is served in windows of the context), so a
    text longer than the context is timed on (1, context) bytes.
    """
    t = min(t, model.context)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        x = torch.randint(0, 256, (1, t), dtype=torch.uint8).to(model.device)
        times = []
        for i in range(repeat + 1):
            t0 = time.perf_counter()
            model.log_probs(x, seed=i)
            synchronize(model.device)
            times.append(time.perf_counter() - t0)
        return statistics.median(times[1:])
    finally:
        torch.set_num_threads(threads)


def prompt_pairs(data: np.ndarray, k: int, p_len: int, n: int) -> list[tuple[bytes, bytes]]:
    """k (prompt, true continuation) pairs starting at line starts spread over the split."""
    out = []
    for j in range(k):
        start = int(len(data) * (j + 0.5) / (k + 1))
        while start < len(data) - 1 and data[start - 1] != 10:
            start += 1
        seg = bytes(data[start : start + p_len + n])
        out.append((seg[:p_len], seg[p_len:]))
    return out


def bench_data(opts: ServeBenchOptions) -> DataDir:
    """The bench's data: --data, else the directory the run's run.json records (its fingerprint checked)."""
    run = RunDir(opts.run)
    return resolve_run_data(opts.data, run.recorded_data(), run.load_config().dataset, str(opts.run))


def bench_prompts(opts: ServeBenchOptions) -> tuple[np.ndarray, list[tuple[bytes, bytes]], dict[str, Any]]:
    """The test split's bytes, the (prompt, true continuation) pairs, and the sampling every bench task shares."""
    data = bench_data(opts).open("test").data
    pairs = prompt_pairs(np.asarray(data), opts.prompts, opts.prompt_bytes, opts.output_bytes)
    base = {"output_bytes": opts.output_bytes, "temperature": opts.temperature, "top_k": opts.top_k, "seed": 0,
            "prompts": [list(p) for p, _ in pairs]}
    return data, pairs, base
