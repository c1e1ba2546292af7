"""lm-evaluation-harness against the gateway: a trained stack and its E2E, served as two stages each, scored by
lm-eval's ``local-completions`` model with its default model arguments (base_url and model only: the remote
tokenizer, its prefix token and max_length 2048 are lm-eval's own choices), every request checked against local eval.

Four tasks of our own (``benchmarks/serving/lm_eval_tasks/*.yaml``), one per request type, over JSONL cut here from
WikiText-2 test (never committed): ``wikitext_bytes_ll`` (log-likelihood of the next 32 bytes after a context of
several model windows), ``wikitext_bytes_mc`` (which of four 32-byte spans follows it), ``wikitext_bytes_rolling``
(loglikelihood_rolling of whole paragraphs) and ``wikitext_bytes_gen`` (generate_until with seven stop strings).
Each log-likelihood lm-eval reads off the gateway is compared with the same sum computed locally from the run's
weights, in the windows ``blocktrain eval`` lays out (a rolling document in the windows lm-eval cuts it into), and
each generation with the local greedy text cut at the first stop.

Needs ``pip install -e '.[lmeval]'`` and two trained runs, e.g. (cpu-quick, a few minutes on 2 cores):

    blocktrain train --preset cpu-quick --objective stack --out runs/lmeval/stack --data DATA
    blocktrain train-e2e --preset cpu-quick --out runs/lmeval/e2e --data DATA
    flock /tmp/blocktrain-cpu.lock python benchmarks/serving/lm_eval_gateway.py --stack-run runs/lmeval/stack \\
        --e2e-run runs/lmeval/e2e --json benchmarks/results/lm-eval-gateway.json
"""

from __future__ import annotations

import argparse
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
import yaml

from blocktrain.checkpoint.run import RunDir
from blocktrain.evaluate.assembled import AssembledModel, E2EModel
from blocktrain.evaluate.generate import generate
from blocktrain.evaluate.scoring import target_log_probs

TASKS = Path(__file__).parent / "lm_eval_tasks"
TASK_NAMES = ("wikitext_bytes_ll", "wikitext_bytes_mc", "wikitext_bytes_rolling", "wikitext_bytes_gen")
ROLLING_BYTES = (200, 3000)  # paragraph lengths of the rolling task: up to one window of lm-eval's 2048, and past it
RAW_TEST = Path(__file__).resolve().parents[3] / "shared/data/wikitext/wikitext-2-raw/wiki.test.raw"


def build_tasks(raw: Path, out: Path, docs: int, context_bytes: int, span: int, seed: int = 0) -> None:
    """Cut the four tasks' JSONL from ``raw`` into ``out`` and write their YAML there, pointing at them."""
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
    paragraphs = [line.strip() for line in text.split("\n") if ROLLING_BYTES[0] <= len(line.strip().encode()) <= ROLLING_BYTES[1]
                  and not line.strip().startswith("=")]
    rolling = [{"text": t} for t in rng.sample(paragraphs, min(docs, len(paragraphs)))]
    tasks = {"wikitext_bytes_ll": ll, "wikitext_bytes_mc": mc, "wikitext_bytes_rolling": rolling,
             "wikitext_bytes_gen": ll}
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in tasks.items():
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
    scores it in over context + continuation (what the gateway serves: its scores never depend on later bytes)."""
    lp = target_log_probs(lambda x: model.log_probs(x.long()), context + continuation, model.context)
    return float(lp[len(context) - 1 :].sum())


def local_rolling(model: AssembledModel | E2EModel, doc: str, max_length: int, prefix: int) -> float:
    """A document's rolling log-likelihood from the local weights, in the windows lm-eval cuts it into."""
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    windows = map(make_disjoint_window, get_rolling_token_windows(token_list=list(doc.encode()), prefix_token=prefix,
                                                                  max_seq_len=max_length - 1, context_len=1))
    return sum(local_loglikelihood(model, bytes(c), bytes(t)) for c, t in windows)


def evaluate(url: str, tasks: Path, limit: int | None) -> tuple[dict[str, Any], Any]:
    import lm_eval
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.tasks import TaskManager

    model_id = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
    lm = LocalCompletionsAPI(base_url=f"{url}/v1/completions", model=model_id)  # lm-eval's defaults otherwise
    out = lm_eval.simple_evaluate(
        model=lm, tasks=list(TASK_NAMES), task_manager=TaskManager(include_path=str(tasks)),
        log_samples=True, limit=limit, random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0,
    )
    return out, lm


def split_as_lm_eval(context: str, continuation: str) -> tuple[bytes, bytes]:
    """lm-eval moves a context's trailing whitespace to the front of the continuation before it asks (``_encode_pair``)."""
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    return context.encode(), continuation.encode()


def until_of(task: str) -> tuple[list[str], int]:
    """The stop strings and byte budget of a generate_until task's YAML."""
    kw = yaml.safe_load((TASKS / f"{task}.yaml").read_text())["generation_kwargs"]
    return list(kw["until"]), int(kw["max_gen_toks"])


def check(out: dict[str, Any], model: AssembledModel | E2EModel, lm: Any) -> dict[str, Any]:
    """Every served value against the local one, per request type, and the true continuations' CE per byte as served."""
    diffs: dict[str, list[float]] = {"loglikelihood": [], "loglikelihood_rolling": []}
    gen_equal, gen_total, ll_sum, ll_bytes, roll_windows = 0, 0, 0.0, 0, 0
    stops, budget = until_of("wikitext_bytes_gen")
    for task, samples in out["samples"].items():
        for s in samples:
            doc = s["doc"]
            if task == "wikitext_bytes_rolling":
                served = float(s["resps"][0][0])
                local = local_rolling(model, doc["text"], lm.max_length, lm.prefix_token_id)
                diffs["loglikelihood_rolling"].append(abs(served - local))
                roll_windows = max(roll_windows, 1 + len(doc["text"].encode()) // (lm.max_length - 1))
                continue
            if task == "wikitext_bytes_gen":
                greedy = generate(model, doc["context"].encode(), budget, temperature=0).decode("utf-8", errors="replace")
                cut = min([greedy.find(x) for x in stops if x in greedy], default=len(greedy))
                gen_equal += s["resps"][0][0] == greedy[:cut]
                gen_total += 1
                continue
            conts = [doc["continuation"]] if task == "wikitext_bytes_ll" else doc["choices"]
            for cont, resp in zip(conts, s["resps"], strict=True):
                served = float(resp[0][0])
                ctx_b, cont_b = split_as_lm_eval(doc["context"], cont)
                diffs["loglikelihood"].append(abs(served - local_loglikelihood(model, ctx_b, cont_b)))
                if task == "wikitext_bytes_ll":
                    ll_sum, ll_bytes = ll_sum + served, ll_bytes + len(cont_b)
    return {"requests_checked": {k: len(v) for k, v in diffs.items()},
            "max_abs_diff_nats": {k: max(v) for k, v in diffs.items()},
            "mean_abs_diff_nats": {k: sum(v) / len(v) for k, v in diffs.items()},
            "rolling_most_windows_per_doc": roll_windows,
            "generate_until": {"requests": gen_total, "equal_to_local_greedy": gen_equal, "stop_strings": len(stops)},
            "prefix_token_id": lm.prefix_token_id, "max_length": lm.max_length,
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
            out, lm = evaluate(url, work / "tasks", args.limit)
        seconds = time.perf_counter() - t0
        metrics = {t: {k.split(",")[0]: v for k, v in r.items() if isinstance(v, int | float) and "stderr" not in k}
                   for t, r in out["results"].items()}
        result[name] = {"run": str(run), "preset": cfg.name, "context": cfg.model.context, "doc_context_bytes": context,
                        "docs": args.limit or args.docs, "metrics": metrics, "seconds": seconds, **check(out, model, lm)}
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
        for kind, d in result[name]["max_abs_diff_nats"].items():
            print(f"| {name} | {kind} | max abs(served - local), nats | {d:.2e} |")
        g = result[name]["generate_until"]
        print(f"| {name} | generate_until | equal to local greedy, {g['stop_strings']} stops | "
              f"{g['equal_to_local_greedy']} of {g['requests']} |")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
