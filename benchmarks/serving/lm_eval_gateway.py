"""lm-evaluation-harness against the gateway: a trained stack and its E2E, served as two stages each, scored by
lm-eval's ``local-completions`` model with its remote tokenizer, every request checked against local eval.

Two tasks of our own (``benchmarks/serving/lm_eval_tasks/*.yaml``) over JSONL cut here from WikiText-2 test (never
committed): ``wikitext_bytes_ll`` (log-likelihood of the next 32 bytes after a context of several model windows) and
``wikitext_bytes_mc`` (which of four 32-byte spans follows it). Each log-likelihood lm-eval reads off the gateway is
compared with the same sum computed locally from the run's weights, in the windows ``blocktrain eval`` lays out.

Needs ``pip install -e '.[lmeval]'`` and two trained runs, e.g. (cpu-quick, a few minutes on 2 cores):

    blocktrain train --preset cpu-quick --objective stack --out runs/lmeval/stack --data DATA
    blocktrain train-e2e --preset cpu-quick --out runs/lmeval/e2e --data DATA
    flock /tmp/blocktrain-cpu.lock python benchmarks/serving/lm_eval_gateway.py --stack-run runs/lmeval/stack \\
        --e2e-run runs/lmeval/e2e --json benchmarks/results/lm-eval-gateway.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import torch

from blocktrain.checkpoint.run import RunDir
from blocktrain.evaluate.assembled import AssembledModel, E2EModel
from blocktrain.serve.gateway.logprobs import byte_log_probs

TASKS = Path(__file__).parent / "lm_eval_tasks"
RAW_TEST = Path(__file__).resolve().parents[3] / "shared/data/wikitext/wikitext-2-raw/wiki.test.raw"


def build_tasks(raw: Path, out: Path, docs: int, context_bytes: int, span: int, seed: int = 0) -> None:
    """Cut the two tasks' JSONL from ``raw`` into ``out`` and write their YAML there, pointing at them."""
    text = raw.read_bytes().decode("utf-8", errors="ignore")
    data = text.encode()
    rng = random.Random(seed)
    ll: list[dict[str, str]] = []
    mc: list[dict[str, Any]] = []
    while len(ll) < docs:
        p = rng.randrange(context_bytes, len(data) - span)
        ctx, cont = data[p - context_bytes : p], data[p : p + span]
        try:  # spans that cut a character in two are drawn again (a task's strings are text)
            doc = {"context": ctx.decode(), "continuation": cont.decode()}
            others = [data[q : q + span].decode() for q in (rng.randrange(0, len(data) - span) for _ in range(3))]
        except UnicodeDecodeError:
            continue
        if not doc["continuation"].strip() or doc["continuation"] in others:
            continue
        label = rng.randrange(4)
        choices = [*others[:label], doc["continuation"], *others[label:]]
        ll.append(doc)
        mc.append({"context": doc["context"], "choices": choices, "label": label})
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in (("wikitext_bytes_ll", ll), ("wikitext_bytes_mc", mc)):
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        yaml = (TASKS / f"{name}.yaml").read_text().replace(f"test: {name}.jsonl", f"test: {out / name}.jsonl")
        (out / f"{name}.yaml").write_text(yaml)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def served(run: Path, kind: str, spans: tuple[str, str], log_dir: Path) -> Iterator[str]:
    """Two stages of ``run`` in a ring and a gateway in front of them; yields the gateway's URL."""
    bl = "blocktrain"
    a, b, g = free_port(), free_port(), free_port()
    flag = "--blocks" if kind == "blocktrain" else "--layers"
    cmds = [
        [bl, "serve", "--run", str(run), "--model", kind, flag, spans[0], "--listen", f"127.0.0.1:{a}", "--next",
         f"127.0.0.1:{b}", "--threads", "1"],
        [bl, "serve", "--run", str(run), "--model", kind, flag, spans[1], "--listen", f"127.0.0.1:{b}", "--next",
         f"127.0.0.1:{a}", "--threads", "1"],
        [bl, "gateway", "--pipeline", f"127.0.0.1:{a}", "--listen", f"127.0.0.1:{g}"],
    ]
    procs = [subprocess.Popen(c, stdout=(log_dir / f"{kind}-{i}.log").open("w"), stderr=subprocess.STDOUT)
             for i, c in enumerate(cmds)]
    url = f"http://127.0.0.1:{g}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise RuntimeError(f"the {kind} pipeline did not come up; see {log_dir}")
            time.sleep(0.5)
        yield url
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=30)


def local_loglikelihood(model: AssembledModel | E2EModel, context: bytes, continuation: bytes) -> float:
    """sum log p(continuation | context) from the local weights, each byte scored in the window ``blocktrain eval``
    scores it in (the gateway's own layout, :func:`byte_log_probs`), over the prompt and the one byte lm-eval asks the
    gateway to generate (it is a target only, so its value moves nothing)."""
    data = context + continuation + b"\0"

    async def score(x: torch.Tensor) -> torch.Tensor:  # the local model in place of the pipeline
        with torch.no_grad():
            return model.log_probs(x.long())[0]  # (w, t, 256); log_softmax of log-probs leaves them as they are

    lp = asyncio.run(byte_log_probs(data, model.context, score))  # (n, 256), row i: byte i given the bytes before
    idx = torch.tensor(list(data), dtype=torch.long)[:, None]
    return float(lp.gather(-1, idx)[len(context) : len(context) + len(continuation), 0].double().sum())


def evaluate(url: str, tasks: Path, limit: int | None) -> dict[str, Any]:
    import lm_eval
    from lm_eval.tasks import TaskManager

    model_id = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
    return lm_eval.simple_evaluate(
        model="local-completions",
        model_args={"base_url": f"{url}/v1/completions", "model": model_id, "tokenizer_backend": "remote",
                    "max_length": 1 << 15, "num_concurrent": 1, "max_retries": 2, "timeout": 120},
        tasks=["wikitext_bytes_ll", "wikitext_bytes_mc"], task_manager=TaskManager(include_path=str(tasks)),
        log_samples=True, limit=limit, random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0,
    )


def split_as_lm_eval(context: str, continuation: str) -> tuple[bytes, bytes]:
    """lm-eval moves a context's trailing whitespace to the front of the continuation before it asks (``_encode_pair``)."""
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    return context.encode(), continuation.encode()


def check(out: dict[str, Any], model: AssembledModel | E2EModel) -> dict[str, Any]:
    """Every served log-likelihood against the local one, and the true continuations' CE per byte as served."""
    diffs, ll_sum, ll_bytes = [], 0.0, 0
    for task, samples in out["samples"].items():
        for s in samples:
            doc = s["doc"]
            conts = [doc["continuation"]] if task == "wikitext_bytes_ll" else doc["choices"]
            for cont, resp in zip(conts, s["resps"], strict=True):
                served = float(resp[0][0])
                ctx_b, cont_b = split_as_lm_eval(doc["context"], cont)
                diffs.append(abs(served - local_loglikelihood(model, ctx_b, cont_b)))
                if task == "wikitext_bytes_ll":
                    ll_sum, ll_bytes = ll_sum + served, ll_bytes + len(cont_b)
    return {"requests_checked": len(diffs), "max_abs_diff_nats": max(diffs), "mean_abs_diff_nats": sum(diffs) / len(diffs),
            "ll_task_ce_nats_per_byte": -ll_sum / ll_bytes}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--stack-run", type=Path, required=True)
    ap.add_argument("--e2e-run", type=Path, default=None)
    ap.add_argument("--raw", type=Path, default=RAW_TEST, help="WikiText-2 raw test text the tasks are cut from")
    ap.add_argument("--docs", type=int, default=100)
    ap.add_argument("--context-bytes", type=int, default=0, help="context of each doc (default: 4 model windows)")
    ap.add_argument("--span-bytes", type=int, default=32)
    ap.add_argument("--limit", type=int, default=None, help="lm-eval's limit (docs per task)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="blocktrain-lmeval-"))
    arms = [("stack", args.stack_run, "blocktrain")] + ([("e2e", args.e2e_run, "e2e")] if args.e2e_run else [])
    result: dict[str, Any] = {"command": "python benchmarks/serving/lm_eval_gateway.py " + " ".join(sys.argv[1:])}
    for name, run, kind in arms:
        rd = RunDir(run)
        cfg = rd.load_config()
        model = AssembledModel.load(rd) if kind == "blocktrain" else E2EModel.load(rd)
        context = args.context_bytes or 4 * cfg.model.context
        build_tasks(args.raw, work / "tasks", args.docs, context, args.span_bytes)
        half = (cfg.model.n_blocks if kind == "blocktrain" else cfg.model.n_layers) // 2
        top = (cfg.model.n_blocks if kind == "blocktrain" else cfg.model.n_layers) - 1
        spans = (f"0-{half - 1}", f"{half}-{top}")
        t0 = time.perf_counter()
        with served(run, kind, spans, work) as url:
            out = evaluate(url, work / "tasks", args.limit)
        seconds = time.perf_counter() - t0
        metrics = {t: {k.split(",")[0]: v for k, v in r.items() if isinstance(v, int | float) and "stderr" not in k}
                   for t, r in out["results"].items()}
        result[name] = {"run": str(run), "preset": cfg.name, "context": cfg.model.context, "doc_context_bytes": context,
                        "docs": args.limit or args.docs, "metrics": metrics, "seconds": seconds, **check(out, model)}
        print(f"{name}: {json.dumps(result[name])}", file=sys.stderr, flush=True)
    import lm_eval

    result["lm_eval_version"] = getattr(lm_eval, "__version__", "?")
    print("| model | task | metric | value |\n|---|---|---|---|")
    for name, _, _ in arms:
        for task, ms in result[name]["metrics"].items():
            for m, v in ms.items():
                print(f"| {name} | {task} | {m} | {v:.4f} |")
        print(f"| {name} | wikitext_bytes_ll | CE of the continuations, nats/byte | "
              f"{result[name]['ll_task_ce_nats_per_byte']:.4f} |")
        print(f"| {name} | all | max abs(served - local) ll, nats | {result[name]['max_abs_diff_nats']:.2e} |")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
