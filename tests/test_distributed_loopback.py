"""Multi-process loopback tests: a coordinator process and worker processes on 127.0.0.1.

Includes the fault tests: a worker killed with SIGKILL mid-round, and the
coordinator killed with SIGKILL mid-run and restarted.
"""

from __future__ import annotations

import shutil
import signal
import sqlite3
import ssl
import subprocess
import time
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
import torch

from blocktrain.checkpoint.safetensors_io import unpack
from blocktrain.data.dataset import DataDir
from blocktrain.data.stream import TrainStream
from blocktrain.diffusion.loss import block_loss
from blocktrain.diffusion.partition import NoisePartition
from blocktrain.model.block import BlockDenoiser
from blocktrain.presets import get_preset
from blocktrain.protocol.delta import Compression, decode_delta
from blocktrain.protocol.weights import load_trainable, trainable_state
from blocktrain.train.step import lr_at, make_optimizer
from tests.distributed_utils import add_token, cli, corpus, free_port, get_status, procs, wait_for  # noqa: F401

TIMEOUT = 120  # seconds for any one phase on a busy 2-core machine


def start_coordinator(run: Path, port: int, *extra: str) -> subprocess.Popen[bytes]:
    return cli("coordinator", "--run-dir", str(run), "--preset", "tiny", "--port", str(port), "--no-eval",
               "--threads", "1", *extra, stdout=subprocess.DEVNULL)


def start_worker(url: str, token: str, data: DataDir, *extra: str) -> subprocess.Popen[bytes]:
    return cli("worker", "--coordinator", url, "--token", token, "--data", str(data.root), "--threads", "1",
               "--no-progress", *extra, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def blob(run: Path, digest: str) -> dict[str, torch.Tensor]:
    return unpack((run / "coordinator" / "blobs" / f"{digest}.safetensors").read_bytes())[0]


def db(run: Path) -> sqlite3.Connection:
    con = sqlite3.connect(run / "coordinator" / "state.sqlite3")
    con.row_factory = sqlite3.Row
    return con


def reproduce_delta(w0: dict[str, torch.Tensor], k: int, seed: int, stream_id: int, steps: int,
                    data: DataDir, schedule_steps: int) -> dict[str, torch.Tensor]:
    """Re-run a worker's round from the seed the coordinator recorded (the audit path); ``schedule_steps``: the lr
    schedule's length, the block's rounds x the coordinator's H."""
    cfg = get_preset("tiny")
    block = BlockDenoiser(cfg.model, cfg.diffusion.sigma_data)
    load_trainable(block, w0)
    opt, _ = make_optimizer(block, cfg.train)
    schedule = replace(cfg.train, steps=schedule_steps)
    part = NoisePartition(cfg.diffusion, cfg.model.n_blocks)
    stream = TrainStream(data.open("train").data, cfg.model.context, cfg.train.batch_size, seed, stream=stream_id)
    for i in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(i, schedule)
        out = block_loss(block, k, *stream.batch(i), part, cfg.diffusion, stream.generator(i, purpose=1))
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(block.parameters(), cfg.train.grad_clip)
        opt.step()
    w = trainable_state(block)
    return {n: w[n] - w0[n] for n in w0}


def test_three_workers_average_equals_hand_computed_mean(tmp_path: Path, corpus: DataDir, procs) -> None:  # noqa: F811
    run, port = tmp_path / "run", free_port()
    url = f"http://127.0.0.1:{port}"
    tokens = [add_token(run, f"w{i}") for i in range(3)]
    procs.append(start_coordinator(run, port, "--rounds", "1", "--min-updates", "3", "--round-seconds", "60",
                                   "--outer", "average", "--aggregation", "mean", "--local-steps", "5"))  # the sample-weighted mean
    wait_for(lambda: get_status(url), TIMEOUT, "the coordinator")
    for i, t in enumerate(tokens):
        procs.append(start_worker(url, t, corpus, "--block", "0", "--local-steps", str(3 + i), "--compress", "none",
                                  "--precision", "fp32"))  # the audit below replays in fp32
    wait_for(lambda: get_status(url)["blocks"][0]["version"] == 1, TIMEOUT, "round 0 of block 0 to close")
    for p in procs[1:]:
        assert p.wait(timeout=TIMEOUT) == 0  # the block finished: workers exit cleanly
    con = db(run)
    rows = con.execute("SELECT * FROM updates WHERE block=0 AND version=0 ORDER BY worker").fetchall()
    assert len(rows) == 3 and [r["samples"] for r in rows] == [12, 16, 20]  # H x batch 4
    deltas = [decode_delta(blob(run, r["blob"]), Compression.NONE) for r in rows]
    v = {r["version"]: r for r in con.execute("SELECT * FROM versions WHERE block=0").fetchall()}
    w0, w1 = blob(run, v[0]["weights_blob"]), blob(run, v[1]["weights_blob"])
    total = sum(r["samples"] for r in rows)
    for n in w0:
        mean = sum(r["samples"] * d[n] for r, d in zip(rows, deltas, strict=True)) / total
        got = w1[n] - w0[n]
        # the published step is int8 with one scale s = max|step| / 127 per tensor: |error| <= s / 2
        ulp = 2**-23 * float(w0[n].abs().max())  # W + step is rounded to float32 once
        assert torch.all((got - mean).abs() <= 0.5 / 127 * mean.abs().max() * (1 + 1e-5) + ulp + 1e-7), n
    # audit: the recorded seed reproduces worker w1's delta (3 + 1 = 4 local steps)
    seed_row = con.execute("SELECT * FROM seeds WHERE worker='w1' AND block=0 AND version=0").fetchone()
    again = reproduce_delta(w0, 0, seed_row["seed"], seed_row["stream"], 4, corpus, schedule_steps=5)  # 1 round x H=5
    for n in again:
        # Two float32 runs of the same 4 AdamW steps: Adam divides by sqrt(v), so on coordinates whose
        # gradient is at rounding level a last-bit difference moves the step by up to ~1e-6 (seen 1.5e-6
        # in one CI run); a worker that trained on other data or steps is off by ~lr = 3e-3.
        torch.testing.assert_close(again[n], deltas[1][n], rtol=1e-4, atol=1e-5)


def test_worker_killed_mid_round_round_closes_at_deadline(tmp_path: Path, corpus: DataDir, procs) -> None:  # noqa: F811
    run, port = tmp_path / "run", free_port()
    url = f"http://127.0.0.1:{port}"
    ta, tb = add_token(run, "a"), add_token(run, "b")
    procs.append(start_coordinator(run, port, "--rounds", "3", "--round-seconds", "4", "--lease-seconds", "60",
                                   "--local-steps", "100000"))  # the budget a slow worker cannot use up
    wait_for(lambda: get_status(url), TIMEOUT, "the coordinator")
    slow = start_worker(url, tb, corpus, "--block", "0", "--local-steps", "100000")
    procs.append(slow)
    wait_for(lambda: get_status(url)["blocks"][0]["live_replicas"] == 1, TIMEOUT, "worker b to register")
    # b dies mid-round, holding a 60 s lease; killed at once, since a worker near its round's deadline now
    # pushes what it has (it would otherwise report on time and close round 0 by quorum)
    slow.send_signal(signal.SIGKILL)
    slow.wait(timeout=30)
    procs.append(start_worker(url, ta, corpus, "--block", "0", "--local-steps", "3"))
    wait_for(lambda: get_status(url)["blocks"][0]["version"] == 3, TIMEOUT, "the run to go on to version 3")
    assert procs[-1].wait(timeout=TIMEOUT) == 0
    con = db(run)
    reasons = [r["close_reason"] for r in con.execute("SELECT close_reason FROM rounds WHERE block=0 AND "
                                                       "state='closed' ORDER BY version")]
    assert reasons == ["deadline"] * 3
    n = con.execute("SELECT COUNT(*) FROM updates WHERE block=0 AND state='applied'").fetchone()[0]
    assert n == 3  # every accepted update of a was applied exactly once


def test_coordinator_killed_and_restarted_loses_nothing(tmp_path: Path, corpus: DataDir, procs) -> None:  # noqa: F811
    run, port = tmp_path / "run", free_port()
    url = f"http://127.0.0.1:{port}"
    ta, tb = add_token(run, "a"), add_token(run, "b")
    # --norm-k 0: b trains far more local steps than a on purpose, so their norms differ legitimately
    args = ("--rounds", "2", "--round-seconds", "120", "--lease-seconds", "120", "--norm-k", "0", "--lazy-fraction", "0",
            "--local-steps", "1500")
    coord = start_coordinator(run, port, *args)
    procs.append(coord)
    wait_for(lambda: get_status(url), TIMEOUT, "the coordinator")
    wb = start_worker(url, tb, corpus, "--block", "0", "--local-steps", "1500")
    wait_for(lambda: get_status(url)["blocks"][0]["live_replicas"] == 1, TIMEOUT, "worker b to register")
    wa = start_worker(url, ta, corpus, "--block", "0", "--local-steps", "3")
    procs += [wa, wb]
    st = wait_for(lambda: (s := get_status(url))["blocks"][0]["updates_in_round"] == 1 and s, TIMEOUT, "a's update",
                  every=0.05)
    coord.send_signal(signal.SIGKILL)  # mid-round: a's update is accepted, b is still training
    coord.wait(timeout=30)
    before = {b["block"]: (b["version"], b["weights_sha"]) for b in st["blocks"]}
    procs.append(start_coordinator(run, port, *args))
    st2 = wait_for(lambda: get_status(url), TIMEOUT, "the restarted coordinator")
    assert {b["block"]: (b["version"], b["weights_sha"]) for b in st2["blocks"]} == before
    assert st2["blocks"][0]["updates_in_round"] >= 1  # the accepted update survived the kill
    # the workers reconnect by themselves: b pushes, the round closes with both updates, the run goes on
    wait_for(lambda: get_status(url)["blocks"][0]["version"] == 2, 2 * TIMEOUT, "block 0 to reach version 2")
    assert wa.wait(timeout=TIMEOUT) == 0 and wb.wait(timeout=TIMEOUT) == 0
    con = db(run)
    r0 = con.execute("SELECT n_updates FROM rounds WHERE block=0 AND version=0").fetchone()
    assert r0["n_updates"] == 2
    assert con.execute("SELECT COUNT(*) FROM updates WHERE worker='a' AND version=0").fetchone()[0] == 1


def test_worker_sigterm_finishes_the_round_and_leaves(tmp_path: Path, corpus: DataDir, procs) -> None:  # noqa: F811
    run, port = tmp_path / "run", free_port()
    url = f"http://127.0.0.1:{port}"
    token = add_token(run, "a")
    procs.append(start_coordinator(run, port, "--round-seconds", "120", "--local-steps", "400"))
    wait_for(lambda: get_status(url), TIMEOUT, "the coordinator")
    w = start_worker(url, token, corpus, "--block", "2", "--local-steps", "400")
    procs.append(w)
    wait_for(lambda: (s := get_status(url))["workers"] and s["workers"][0]["bytes_out"] > s["block_fp32_bytes"],
             TIMEOUT, "the worker to pull its weights")
    time.sleep(0.5)  # now it trains its 400 local steps (seconds, at tiny's hundred-odd steps a second)
    w.send_signal(signal.SIGTERM)  # mid-round: finish it, push, leave
    assert w.wait(timeout=TIMEOUT) == 0
    st = get_status(url)
    assert st["updates_accepted"] == 1 and st["blocks"][2]["version"] == 1
    assert st["workers"][0]["state"] == "left"


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl CLI not installed")
def test_coordinator_serves_tls(tmp_path: Path, procs) -> None:  # noqa: F811
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    run, port = tmp_path / "run", free_port()
    token = add_token(run, "a")
    procs.append(start_coordinator(run, port, "--tls-cert", str(cert), "--tls-key", str(key)))
    url = f"https://127.0.0.1:{port}"
    ctx = ssl.create_default_context(cafile=str(cert))
    st = wait_for(lambda: httpx.get(f"{url}/v1/status", verify=ctx, timeout=10).json(), TIMEOUT, "TLS status")
    assert st["n_blocks"] == 4
    from blocktrain.worker.client import CoordinatorClient

    client = CoordinatorClient(url, token, verify=str(cert), give_up_s=5)
    assert client.register(None).block == 0
    client.close()
    with pytest.raises(httpx.ConnectError):  # an unverified certificate is refused by default
        httpx.get(f"{url}/v1/status", timeout=10)
