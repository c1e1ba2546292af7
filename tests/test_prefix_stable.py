"""A byte's score never depends on the bytes after it, not even on how many follow: appending bytes to a text
leaves every earlier byte's log-prob as it was, in ``blocktrain eval``'s scoring and in the gateway's."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from blocktrain.evaluate.assembled import AssembledModel, E2EModel
from blocktrain.evaluate.scoring import target_log_probs
from blocktrain.serve.gateway.logprobs import byte_log_probs
from tests.serve_utils import tiny_models

CFG, BLOCKS, E2E = tiny_models()
MODELS: dict[str, AssembledModel | E2EModel] = {"chain": AssembledModel(BLOCKS, CFG), "e2e": E2EModel(E2E, CFG)}
TEXT = np.random.default_rng(0).integers(32, 127, size=40 * CFG.model.context, dtype=np.uint8)
ATOL = 1e-5  # nats: batched matmuls of other batch sizes round differently; a moved window moves scores by >1e-2


def eval_log_probs(model: AssembledModel | E2EModel, data: np.ndarray, batch_size: int) -> torch.Tensor:
    """log p(data[j] | data[:j]) for j = 1..n-1, as ``blocktrain eval`` scores them."""
    return target_log_probs(lambda x: model.log_probs(x.long()), data, model.context, batch_size=batch_size)


def served_log_probs(model: AssembledModel | E2EModel, data: np.ndarray) -> torch.Tensor:
    """The same, laid out as the gateway lays them out, with the local model in place of the pipeline."""
    async def score(x: torch.Tensor) -> torch.Tensor:
        return model.log_probs(x.long())[0]

    lp = asyncio.run(byte_log_probs(bytes(data), model.context, score))  # (n, 256), row 0 NaN
    return lp[1:].gather(-1, torch.from_numpy(data[1:].astype(np.int64))[:, None])[:, 0].double()


@pytest.mark.parametrize("kind", sorted(MODELS))
@settings(max_examples=12, deadline=None)
@given(n=st.integers(2, len(TEXT) - 1), extra=st.integers(1, 5 * CFG.model.context), batch=st.sampled_from([1, 3, 32]))
def test_appending_bytes_moves_no_earlier_score(kind: str, n: int, extra: int, batch: int) -> None:
    model, m = MODELS[kind], min(n + extra, len(TEXT))
    short, long = eval_log_probs(model, TEXT[:n], batch), eval_log_probs(model, TEXT[:m], batch)
    assert short.shape == (n - 1,) and long.shape == (m - 1,)
    torch.testing.assert_close(long[: n - 1], short, atol=ATOL, rtol=0)
    # the gateway's rows ignore what follows too, and equal eval's at any batch (a chain's noise is a function of
    # the position only, the same in every row of a batch)
    served = served_log_probs(model, TEXT[:n])
    torch.testing.assert_close(served_log_probs(model, TEXT[:m])[: n - 1], served, atol=ATOL, rtol=0)
    torch.testing.assert_close(served, short, atol=ATOL, rtol=0)


def test_a_chains_score_depends_neither_on_the_width_nor_on_the_row() -> None:
    """Row 1 of a (2, t) batch, cut to its first 10 bytes, at widths 12, 20 and 32, and alone as row 0: the same
    log-probs on those 10 bytes. With a noise draw numbered per row, row 1 moved by up to 0.27 nats with t."""
    model = MODELS["chain"]
    x = torch.from_numpy(TEXT[: 2 * 32].astype(np.int64)).view(2, 32)  # (2 * 32,) -> (2, 32)
    ref = model.log_probs(x[1:, :10])[0, 0]  # (10, 256): row 1's first 10 bytes alone
    for t in (12, 20, 32):
        torch.testing.assert_close(model.log_probs(x[:, :t])[0, 1, :10], ref, atol=ATOL, rtol=0)


def test_the_old_end_aligned_windows_would_fail_it() -> None:
    """The check above can fail: scoring a prefix in windows aligned to its own end moves its scores."""
    model = MODELS["e2e"]
    ctx = model.context
    n = 3 * ctx + 7
    x = torch.from_numpy(TEXT[: n + 1].astype(np.int64))
    end_aligned = model.log_probs(x[None, n - ctx : n])[0, 0].gather(-1, x[n - ctx + 1 : n + 1, None])[:, 0]
    stable = eval_log_probs(model, TEXT[: n + 1], 32)[n - ctx :]
    assert (end_aligned.double() - stable).abs().max() > 100 * ATOL


def test_the_windows_per_score_call_fit_a_frame_and_leave_every_score_as_it_was() -> None:
    """Scoring sent 32 windows per call whatever their size: at context 2048 and d_model 512 a stage's hidden
    states (32 x 2048 x 512 fp32) exceed the 64 MiB frame cap, and every log-prob request failed. The windows per call
    now fill at most half a frame, and how many a call carries changes no score."""
    from blocktrain.serve.gateway.logprobs import windows_per_call

    assert windows_per_call(2048, 512, 64 << 20) == 8 and windows_per_call(256, 128, 64 << 20) == 32
    assert windows_per_call(1 << 16, 4096, 1 << 20) == 1
    model, data = MODELS["chain"], bytes(TEXT[: 9 * CFG.model.context])

    async def score(x: torch.Tensor) -> torch.Tensor:
        return model.log_probs(x.long())[0]

    whole = asyncio.run(byte_log_probs(data, model.context, score))
    for per_call in (1, 3):
        got = asyncio.run(byte_log_probs(data, model.context, score, per_call))
        assert torch.allclose(got[1:], whole[1:], atol=ATOL) and got[0].isnan().all()


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_a_prompt_scored_once_serves_every_choice(kind: str) -> None:
    """The gateway scores a request's prompt with its first choice and reuses those rows for the others (it scored
    the prompt once per choice, n up to 8): a second continuation's log-probs equal those it scores whole, and it
    sends only the windows that reach its own bytes."""
    model, ctx = MODELS[kind], CFG.model.context
    prompt, first, second = bytes(TEXT[: 6 * ctx + 5]), bytes(TEXT[-ctx:]), bytes(TEXT[-2 * ctx : -ctx - 3])
    sent: list[int] = []

    async def score(x: torch.Tensor) -> torch.Tensor:
        sent.append(len(x))
        return model.log_probs(x.long())[0]

    known = asyncio.run(byte_log_probs(prompt + first, ctx, score))[: len(prompt)]
    sent.clear()
    whole = asyncio.run(byte_log_probs(prompt + second, ctx, score, 1))
    alone = len(sent)
    sent.clear()
    reused = asyncio.run(byte_log_probs(prompt + second, ctx, score, 1, known))
    assert reused[0].isnan().all() and torch.allclose(reused[1:], whole[1:], atol=ATOL)
    assert sum(sent) <= 3 < alone  # the windows of the last rows only (the prompt holds 12 of them)
