"""Every path computes on the device it is given (issue 42): eval, generate, serving spans and their KV caches, the
coordinator's gate, evaluation and audit replay, the in-process rounds.

No GPU is at hand in CI, so two checks stand in for one, and both fail when a path ignores its device:

* **The host by name only where it is a boundary.** Product code names the CPU (``torch.device("cpu")``,
  ``.cpu()``, a ``"cpu"`` autocast) only in the files listed in ``HOST_BOUNDARIES``, each with why: the device rule
  itself, tensors leaving for a file or the wire.
* **No tensor made without a device.** Each path runs under ``with torch.device("meta")``, which sends every tensor
  created without an explicit device to the meta device. The path is given the CPU, so any such tensor mixes with
  the path's CPU tensors and the op fails: that tensor would have landed on the host beside a GPU model. The test
  then checks that the model's parameters, the batches the model saw and the KV cache are on the device named.

A third check stands for the GPU's pipeline: **no value read back in a hot loop** (:class:`HostReads` counts every
read of a tensor's value on the host, a wait for the device on a GPU), so training steps, drafts, sweeps and
generation queue their work without waiting for it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from blocktrain.config import Objective, RunConfig
from blocktrain.device import CPU, resolve_device
from blocktrain.evaluate.assembled import AssembledModel, E2EModel
from blocktrain.evaluate.generate import generate
from blocktrain.evaluate.scoring import score_split
from blocktrain.model.e2e import E2ETransformer
from blocktrain.objectives import get_objective
from blocktrain.presets import get_preset
from blocktrain.serve.runtime.loading import build_span, random_e2e_span
from blocktrain.serve.wire.frames import Frame, FrameKind, Mode

SRC = Path(__file__).resolve().parents[1] / "src" / "blocktrain"
HOST = re.compile(r"""torch\.device\(\s*["']cpu["']\s*\)|\.cpu\(\)|autocast\(\s*["']cpu["']|device=["']cpu["']|"cpu"\s*,\s*dtype""")
HOST_BOUNDARIES = {  # file -> (uses of the host by name, why)
    "device.py": (1, "the one device rule: CPU is the host constant"),
    "checkpoint/safetensors_io.py": (2, "tensors leave for a file or the wire as safetensors"),
    "protocol/weights.py": (1, "a block's weights leave for the wire"),
    "protocol/inner_state.py": (2, "an audit's inner state leaves for the wire; AdamW's step lives where torch puts it"),
    "evaluate/scoring.py": (1, "target_log_probs returns its figures to the caller"),
    "train/memory.py": (1, "the RSS warm-up loads the host's own kernels before a memory baseline"),
}


def test_product_code_names_the_host_only_at_its_boundaries() -> None:
    found: dict[str, int] = {}
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        n = sum(len(HOST.findall(line)) for line in path.read_text().splitlines() if not line.lstrip().startswith("#"))
        if n:
            found[rel] = n
    extra = {f: n for f, n in found.items() if n > HOST_BOUNDARIES.get(f, (0, ""))[0]}
    assert not extra, f"the host named outside a boundary (move the tensor to the path's device instead): {extra}"
    assert found == {f: n for f, (n, _) in HOST_BOUNDARIES.items()}, "a boundary was removed: update HOST_BOUNDARIES"


@contextmanager
def no_implicit_host() -> Iterator[None]:
    """Tensors created without a device go to meta, and fail the first op that mixes them with the path's."""
    with torch.device("meta"):
        yield


class Seen:
    """Forward pre-hooks recording the device of every tensor input and parameter of the modules they watch."""

    def __init__(self, modules: list[nn.Module]) -> None:
        self.devices: set[torch.device] = set()
        self.calls = 0
        self.handles = [m.register_forward_pre_hook(self._hook) for m in modules]

    def _hook(self, module: nn.Module, args: tuple[object, ...]) -> None:
        self.calls += 1
        self.devices |= {a.device for a in args if isinstance(a, torch.Tensor)}
        self.devices |= {p.device for p in module.parameters()}

    def close(self) -> None:
        for h in self.handles:
            h.remove()


class HostReads:
    """Counts every read of a tensor's value on the host (a wait for the device on a GPU) until ``monkeypatch.undo()``."""

    READS = ("__float__", "__int__", "__bool__", "__index__", "item", "tolist", "cpu", "numpy")

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.names: list[str] = []
        for name in self.READS:
            original = getattr(torch.Tensor, name)

            def counted(tensor: torch.Tensor, *a: object, _orig: object = original, _name: str = name, **kw: object) -> object:
                self.names.append(_name)
                return _orig(tensor, *a, **kw)  # type: ignore[operator]

            monkeypatch.setattr(torch.Tensor, name, counted)


def _cfg(objective: Objective) -> RunConfig:
    cfg = get_preset("tiny")
    return replace(cfg, objective=objective)


def _blocks(cfg: RunConfig) -> list[nn.Module]:
    torch.manual_seed(0)
    return [get_objective(cfg).build_block(k) for k in range(cfg.model.n_blocks)]


TEXT = np.frombuffer(b"The quick brown fox jumps over the lazy dog. " * 12, dtype=np.uint8)


@pytest.mark.parametrize("objective", [Objective.STACK, Objective.DIFFUSION])
def test_eval_scores_on_the_device_named(objective: Objective) -> None:
    cfg = _cfg(objective)
    device = resolve_device("cpu")
    model = AssembledModel(_blocks(cfg), cfg, device=device)
    seen = Seen(model.blocks)
    with no_implicit_host():
        res = score_split(lambda x: model.log_probs(x), TEXT, cfg.model.context, batch_size=4, device=device)
    seen.close()
    assert res.bytes_scored == len(TEXT) - 1 and np.isfinite(res.ce_nats_per_byte)
    assert seen.calls > 0 and seen.devices == {device}
    assert {p.device for b in model.blocks for p in b.parameters()} == {device}


def test_e2e_eval_and_generate_on_the_device_named() -> None:
    cfg = _cfg(Objective.STACK)
    torch.manual_seed(0)
    model = E2EModel(E2ETransformer(cfg.model), cfg, device=CPU)
    seen = Seen([model.model])
    with no_implicit_host():
        score_split(model.log_probs, TEXT, cfg.model.context, batch_size=4, device=CPU)
        out = generate(model, b"The ", 5, seed=1)
    seen.close()
    assert len(out) == 5 and seen.devices == {CPU}


def test_stack_generate_on_the_device_named() -> None:
    cfg = _cfg(Objective.STACK)
    model = AssembledModel(_blocks(cfg), cfg, device=CPU)
    with no_implicit_host():
        assert len(generate(model, b"The ", 4, seed=0)) == 4


def _submit(mode: Mode, x: bytes, **params: object) -> Frame:
    return Frame(FrameKind.SUBMIT, "r1", mode, 0, dict(params),
                 {"x": torch.tensor([list(x)], dtype=torch.uint8)})


def test_stack_span_runs_and_caches_on_its_device() -> None:
    cfg = _cfg(Objective.STACK)
    blocks = dict(enumerate(_blocks(cfg)))
    span = build_span(cfg, blocks, device=CPU)
    assert span.describe()["device"] == "cpu"
    seen = Seen(list(blocks.values()))
    frames = [_submit(Mode.SCORE, b"hello world"), _submit(Mode.AR, b"hello", pos=0),
              _submit(Mode.SPEC, b"hello", pos=0, n_draft=3, temperature=0.8, top_k=0, seed=2)]
    with no_implicit_host():
        score, ar, spec = (span.run([f])[0] for f in frames)
    seen.close()
    assert score.kind is FrameKind.RESULT and ar.kind is FrameKind.RESULT and spec.kind is FrameKind.RESULT
    assert all(t.device == CPU for f in (score, ar, spec) for t in f.tensors.values())  # answers leave on the host
    entry = span.cache.peek("r1")  # type: ignore[attr-defined]
    assert entry is not None and entry.kv and {t.device for pair in entry.kv.values() for t in pair} == {CPU}
    assert seen.devices == {CPU}


def test_diffusion_span_runs_on_its_device() -> None:
    cfg = _cfg(Objective.DIFFUSION)
    span = build_span(cfg, dict(enumerate(_blocks(cfg))), device=CPU)
    frames = [_submit(Mode.AR, b"hello", seed=1),
              _submit(Mode.SWEEP, b"hello", n_new=3, prompt_len=5, sweeps=1, temperature=0.8, seed=1),
              _submit(Mode.SPEC, b"hello", n_draft=2, temperature=0.8, top_k=0, seed=1)]
    with no_implicit_host():
        out, sweep, spec = (span.run([f])[0] for f in frames)
    assert out.kind is FrameKind.RESULT and sweep.kind is FrameKind.RESULT and spec.kind is FrameKind.RESULT


def test_e2e_span_runs_and_caches_on_its_device() -> None:
    cfg = _cfg(Objective.STACK)
    span = random_e2e_span(cfg, 0, cfg.model.n_layers - 1, device=CPU)
    frame = _submit(Mode.BASELINE, b"hello", pos=0)
    with no_implicit_host():
        out = span.run([frame])[0]
    assert out.kind is FrameKind.RESULT
    entry = span.cache.peek("r1")
    assert entry is not None and {t.device for pair in entry.kv.values() for t in pair} == {CPU}
    assert span.describe()["device"] == "cpu"


NO_CUDA = "this torch has no CUDA device"


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA: --device cuda must be refused")
def test_every_command_takes_device_and_uses_it(tmp_path: Path, data_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--device cuda`` reaches each command's device rule: on this CUDA-less machine each one refuses it at once,
    naming the flag's way out, before it trains, loads, listens or registers."""
    from blocktrain.cli.main import main

    run = tmp_path / "run"
    for k in range(4):
        assert main(["train-block", "--preset", "tiny", "--steps", "1", "--out", str(run), "--data", str(data_dir),
                     "--block", str(k), "--no-progress"]) == 0
    commands = {
        "eval": ["eval", str(run), "--data", str(data_dir), "--no-progress"],
        "generate": ["generate", str(run), "--bytes", "2", "--no-progress"],
        "serve": ["serve", "--run", str(run), "--blocks", "0-3", "--listen", "127.0.0.1:1"],
        "coordinator": ["coordinator", "--preset", "tiny", "--run-dir", str(tmp_path / "coord"), "--data", str(data_dir),
                        "--port", "1"],
        "worker": ["worker", "--coordinator", "http://127.0.0.1:1", "--token", "t", "--data", str(data_dir)],
        "train": ["train", "--preset", "tiny", "--out", str(tmp_path / "t"), "--data", str(data_dir), "--no-progress"],
        "bench quality": ["bench", "quality", "--preset", "tiny", "--out", str(tmp_path / "q"), "--data", str(data_dir),
                          "--no-progress"],
        "bench speed": ["bench", "speed", "--preset", "tiny", "--out", str(tmp_path / "s"), "--data", str(data_dir)],
        "bench serve": ["bench", "serve", "--run", str(run)],
        "bench machine": ["bench", "machine"],
    }
    for name, argv in commands.items():
        capsys.readouterr()
        assert main([*argv, "--device", "cuda"]) == 2, name
        err = capsys.readouterr().err
        assert NO_CUDA in err and "--device cpu" in err, (name, err[-400:])
    assert not (tmp_path / "t").exists() and not (tmp_path / "q").exists()


@pytest.mark.parametrize("objective", [Objective.STACK, Objective.DIFFUSION])
def test_in_process_rounds_gate_and_eval_on_the_device_named(tmp_path: Path, objective: Objective) -> None:
    """The in-process rounds (replicas, their inner steps, the coordinator's gate) and the block's test CE, under the
    probe: block 1 of a stack reads block 0 frozen, so the frozen inputs are covered too."""
    from blocktrain.coordinator.evaluation import Evaluator
    from blocktrain.coordinator.settings import CoordinatorSettings
    from blocktrain.coordinator.simulate import BlockRun, LocalRounds
    from blocktrain.protocol.weights import trainable_state
    from tests.distributed_utils import write_corpus

    data = write_corpus(tmp_path / "data")
    cfg = replace(_cfg(objective), train=replace(_cfg(objective).train, device="cpu", batch_size=2))
    obj = get_objective(cfg)
    k = 1 if obj.frozen_inputs(1) else 0
    torch.manual_seed(0)
    earlier = [obj.build_block(j) for j in range(k)]
    frozen = [obj.freeze(b, torch.float32) for b in earlier]
    settings = CoordinatorSettings(gate=True, agree_min=None)
    # modules are built on the host (version 0 is the same draw on every device) and moved, so outside the probe
    run = BlockRun(cfg, settings, LocalRounds(workers=2, local_steps=2, steps=4), data, k=k, frozen=frozen,
                   earlier=earlier)
    blocks = [obj.build_block(j) for j in range(cfg.model.n_blocks)]
    evaluator = Evaluator(cfg, settings, data)
    with no_implicit_host():
        seen = Seen(run.replicas)
        run.round(2, 0)
        run.round(2, 2)
        ce = run.finish().test_ce(cfg, data, 512, k=k, frozen=frozen)
        seen.close()
        assert run.device == CPU and seen.devices == {CPU}
        assert [u.outcome for u in run.run.updates].count("accepted") >= 2 and np.isfinite(ce)
        ce_all, n = evaluator.evaluate({j: trainable_state(b) for j, b in enumerate(blocks)}, None)
        assert evaluator.device == CPU and n == settings.eval_bytes and np.isfinite(ce_all)


def test_the_training_loop_reads_no_figure_per_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """Five steps without hooks read one number from a tensor (the last loss), not one per step: on a GPU each read
    is a wait, and a loop that waits every step cannot keep the device busy."""
    from blocktrain.train.loop import train_steps
    from blocktrain.train.step import make_optimizer

    cfg = _cfg(Objective.STACK)
    torch.manual_seed(0)
    model = E2ETransformer(cfg.model)
    opt, _ = make_optimizer(model, cfg.train)
    x = torch.randint(0, 256, (2, 16), dtype=torch.uint8)

    def loss_at(step: int) -> tuple[torch.Tensor, dict[str, float | torch.Tensor]]:
        logits = model(x[:, :-1])
        return nn.functional.cross_entropy(logits.reshape(-1, 256).float(), x[:, 1:].reshape(-1).long()), {}

    reads = HostReads(monkeypatch)
    result = train_steps(model, opt, loss_at, range(5), lr=lambda s: 1e-3, grad_clip=1.0)
    monkeypatch.undo()
    assert result.done == 5 and np.isfinite(result.last_loss)
    assert reads.names == ["__float__"], reads.names


def test_a_hidden_progress_bar_reads_no_loss() -> None:
    """The worker and ``train`` always add a ProgressHook; with its bar hidden (--no-progress, a log file) it must not
    read the loss (a wait for the device) once a second."""
    from tqdm import tqdm

    from blocktrain.train.loop import ProgressHook, StepRecord

    class Unread(StepRecord):
        @property
        def loss(self) -> float:
            raise AssertionError("the hidden bar read the loss")

    hook = ProgressHook(tqdm(total=3, disable=True))
    hook._shown = -float("inf")
    for i in range(3):
        hook.after(Unread(i + 1, torch.zeros(()), 1e-3, torch.zeros(()), 0.0))
    assert hook.steps == 3


def _reads(monkeypatch: pytest.MonkeyPatch, run: Callable[[int], object], n: int) -> list[str]:
    reads = HostReads(monkeypatch)
    try:
        run(n)
    finally:
        monkeypatch.undo()
    return reads.names


def test_drafts_sweeps_and_generation_read_nothing_back_per_byte(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each drawn byte stays on the device and feeds the next step there: a spec frame's draft (cached and windowed,
    on a stack and on diffusion), a diffusion sweep and local generate read as many values back for 6 bytes as for
    2 (the stack's spans none at all; generate, at the end, whether all was finite and its text). Before, every byte was a read."""
    cfg, dcfg = _cfg(Objective.STACK), _cfg(Objective.DIFFUSION)
    span = build_span(cfg, dict(enumerate(_blocks(cfg))), device=CPU)
    dspan = build_span(dcfg, dict(enumerate(_blocks(dcfg))), device=CPU)
    model = AssembledModel(_blocks(cfg), cfg, device=CPU)
    window = bytes(range(65, 65 + cfg.model.context))
    paths: dict[str, Callable[[int], object]] = {
        "stack spec": lambda n: span.run([_submit(Mode.SPEC, b"hello", pos=0, n_draft=n, temperature=0.8, top_k=5,
                                                  top_p=0.9, seed=2)]) and span.release("r1"),
        "stack windowed spec": lambda n: span.run([_submit(Mode.SPEC, window, pos=3, n_draft=n, temperature=0.8,
                                                           seed=2, window=True)]),
        "diffusion spec": lambda n: dspan.run([_submit(Mode.SPEC, b"hello", n_draft=n, temperature=0.8, seed=1)]),
        "diffusion sweep": lambda n: dspan.run([_submit(Mode.SWEEP, b"hello", n_new=n, prompt_len=5, sweeps=1,
                                                        temperature=0.8, seed=1)]),
        "generate": lambda n: generate(model, b"The ", n, seed=0, top_p=0.9),
    }
    reads = {name: [_reads(monkeypatch, run, n) for n in (2, 6)] for name, run in paths.items()}
    assert all(two == six for two, six in reads.values()), reads
    assert reads["stack spec"][0] == reads["stack windowed spec"][0] == [], reads
    assert reads["generate"][0] == ["__bool__", "tolist"], reads  # all finite?, then the text


def test_a_logged_rate_counts_the_steps_the_device_has_done() -> None:
    """bench speed times a run by the bytes/s of its metrics lines; the rate was read before the line's loss, whose
    read is the wait for the device: on a GPU it counted the steps queued, up to an interval's work too fast."""
    from blocktrain.train.loop import MetricsHook, ProgressHook, StepRecord

    order: list[str] = []

    class Read(StepRecord):
        @property
        def loss(self) -> float:
            order.append("loss")
            return 0.0

    class Rate(ProgressHook):
        def rate(self) -> float:
            order.append("rate")
            return 1.0

    class Lines:
        def write(self, **record: object) -> None:
            order.append("line")

    hook = MetricsHook(Lines(), every=1, progress=Rate(None, bytes_per_step=4))  # type: ignore[arg-type]
    hook.after(Read(1, torch.zeros(()), 1e-3, torch.zeros(()), 0.0))
    assert order == ["loss", "rate", "line"]


def test_a_diffusion_sweep_from_logits_that_are_not_finite_is_an_error() -> None:
    """The sampler draws byte 0 from NaN (multinomial refused it): a sweep whose last block's logits are not finite
    answers an ERROR frame, not bytes, with one read at its last stage."""
    from blocktrain.serve.wire.frames import ErrorCode

    cfg = _cfg(Objective.DIFFUSION)
    blocks = _blocks(cfg)
    with torch.no_grad():
        blocks[-1].head.weight.fill_(float("nan"))  # type: ignore[union-attr, operator]
    span = build_span(cfg, dict(enumerate(blocks)), device=CPU)
    out = span.run([_submit(Mode.SWEEP, b"hello", n_new=3, prompt_len=5, sweeps=1, temperature=0.8, seed=1)])[0]
    assert out.kind is FrameKind.ERROR and out.code is ErrorCode.INTERNAL and "not finite" in (out.error or "")


def test_a_split_is_kept_resident_on_an_accelerator(tmp_path: Path) -> None:
    """TrainStream keeps the split on an accelerator and cuts batches there; its cache was a WeakKeyDictionary keyed
    by the array, which is not hashable: every stream on a GPU raised TypeError before its first batch. The meta
    device stands in for the accelerator; the copy is made once per split and dropped with it."""
    import gc

    from blocktrain.data import stream

    path = tmp_path / "split.bin"
    path.write_bytes(bytes(range(256)) * 4)
    data = np.memmap(path, dtype=np.uint8, mode="r")
    meta = torch.device("meta")
    first = stream.resident(data, meta)
    assert first is not None and first.shape == (1024,) and stream.resident(data, meta) is first
    x, y = stream.TrainStream(data, 16, 3, seed=0, device=meta).batch(0)
    assert x.shape == y.shape == (3, 16) and x.device == meta
    n = len(stream._RESIDENT)
    del data, first
    gc.collect()
    assert len(stream._RESIDENT) == n - 1


def test_auto_resolves_as_its_device_named_tf32_included(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--device auto`` (TrainConfig's default) returned CUDA before TF32 was allowed: on one GPU, auto and cuda
    computed fp32 matmuls apart (the arithmetic an audit's tolerance is set for)."""
    from blocktrain import device as device_mod

    allowed: list[int] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(device_mod, "_allow_tf32", lambda: allowed.append(1))
    assert device_mod.resolve_device("auto") == torch.device("cuda") and allowed == [1]
    assert device_mod.resolve_device("cuda") == torch.device("cuda") and allowed == [1, 1]
