"""lm-evaluation-harness's three request types against a live gateway, with lm-eval's default model arguments
(``local-completions``: base_url and model only; the remote tokenizer found by itself), every per-request value
checked against local scoring of the same bytes. Offline: a tiny stack trained here, requests built here."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from blocktrain.checkpoint.run import RunDir
from blocktrain.evaluate.assembled import AssembledModel
from blocktrain.evaluate.generate import generate
from blocktrain.evaluate.scoring import target_log_probs
from blocktrain.serve.gateway.app import GatewayOptions
from blocktrain.serve.runtime.loading import load_run_span
from tests.serve_utils import ring
from tests.test_gateway import serve_app
from tests.test_gateway_scoring import stack_run  # noqa: F401  (a tiny stack trained in-process)

lm_eval = pytest.importorskip("lm_eval")  # the dev extra installs it (scripts/test.sh)
from benchmarks.serving.lm_eval_gateway import split_as_lm_eval  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.models.openai_completions import LocalCompletionsAPI  # noqa: E402

TOL = 1e-4  # nats: the served sum against the local one (fp32 scoring on both sides; 1e-6 is typical)
STOPS = [".", "\n\n", "Sega", "the game", "Q:", "\n=", "###"]  # more than OpenAI's 4, as lm-eval's code tasks send
TEXT = ("Senjo no Valkyria 3 : Unrecorded Chronicles is a tactical role @-@ playing video game developed by Sega "
        "and Media.Vision for the PlayStation Portable . Released in January 2011 in Japan , it is the third game "
        "in the Valkyria series . Employing the same fusion of tactical and real @-@ time gameplay as its "
        "predecessors , the story runs parallel to the first game and follows the Nameless , a penal military unit .")


def local_log_probs(model: AssembledModel, data: bytes) -> torch.Tensor:
    """log p(data[j] | data[:j]) for j = 1..n-1, as ``blocktrain eval`` scores them."""
    return target_log_probs(lambda x: model.log_probs(x), data, model.context)


def test_lm_eval_request_types_against_the_gateway_equal_local_scoring(stack_run: Path,  # noqa: F811
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    run = RunDir(stack_run)
    model = AssembledModel.load(run)
    pairs = [(TEXT[:a], TEXT[a:b]) for a, b in ((40, 52), (150, 151), (200, 290), (7, 380))]
    docs = [TEXT[:90], TEXT, "a"]
    gens = [TEXT[:60], TEXT[:130]]
    spans = [load_run_span(run, 0, 1), load_run_span(run, 2, 3)]
    with caplog.at_level(logging.WARNING), ring(spans) as stages, \
            serve_app(GatewayOptions(pipeline=f"127.0.0.1:{stages[0].address[1]}")) as url:
        lm = LocalCompletionsAPI(base_url=f"{url}/v1/completions", model="blocktrain")  # lm-eval's defaults otherwise
        lm.model = lm_model_id(url)
        assert lm.tokenizer_backend == "remote" and lm.prefix_token_id == 10  # /tokenizer_info's bos_token, "\n"
        ll = lm.loglikelihood([Instance("loglikelihood", {}, p, i) for i, p in enumerate(pairs)], disable_tqdm=True)
        rolling = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (d,), i) for i, d in enumerate(docs)],
                                           disable_tqdm=True)
        until = {"until": STOPS, "max_gen_toks": 24}
        out = lm.generate_until([Instance("generate_until", {}, (g, dict(until)), i) for i, g in enumerate(gens)],
                                disable_tqdm=True)
    for (ctx, cont), (served, _) in zip(pairs, ll, strict=True):
        c, t = split_as_lm_eval(ctx, cont)
        want = float(local_log_probs(model, c + t)[len(c) - 1 :].sum())
        assert served == pytest.approx(want, abs=TOL), (ctx[-10:], cont)
    for doc, served in zip(docs, rolling, strict=True):  # one window each (max_length 2048): "\n" + doc, every byte
        assert served == pytest.approx(float(local_log_probs(model, b"\n" + doc.encode()).sum()), abs=TOL)
    for g, text in zip(gens, out, strict=True):
        greedy = generate(model, g.encode(), 24, temperature=0).decode("utf-8", errors="replace")
        cut = min([greedy.find(s) for s in STOPS if s in greedy], default=len(greedy))
        assert text == greedy[:cut]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith("blocktrain")]


def lm_model_id(url: str) -> str:
    import httpx

    return str(httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"])
