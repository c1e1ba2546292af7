"""What one stage of a ``diffusion`` run computes: blocks ``lo..hi`` of the chain.

:class:`BlockSpan` holds blocks ``lo..hi`` of a diffusion run and runs each
block's share of the chain with :func:`blocktrain.diffusion.sampler.chain_step`.
Frames that arrive together are batched: sequences are right-padded to the
longest, which is exact because every block is causal (padding sits after the
positions that are read back). It turns an input frame into an output frame
(WORK for the next stage, RESULT for the client) and never touches the network.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from blocktrain.config import VOCAB_SIZE, Precision, RunConfig
from blocktrain.device import CPU
from blocktrain.diffusion.partition import NoisePartition
from blocktrain.diffusion.sampler import chain_step, initial_noise, position_noise
from blocktrain.errors import WireError
from blocktrain.model.block import BlockDenoiser
from blocktrain.sampling import sample_rows
from blocktrain.seeds import Seed
from blocktrain.serve.runtime import input_tensor, on_device
from blocktrain.serve.runtime.kvcache import CacheOptions
from blocktrain.serve.wire.frames import INT64, ErrorCode, Frame, FrameKind, Mode, frame_number, frame_param
from blocktrain.serve.wire.limits import MAX_SWEEPS
from blocktrain.serve.wire.speculative import SpecParams, validate_carried_draft, windows

log = logging.getLogger(__name__)

PLACEHOLDER_BYTE = 32  # context byte of not-yet-estimated sweep positions (a space)



class BlockSpan:
    """Blocks ``lo..hi`` of a BlockTrain model."""

    family = "diffusion"

    def __init__(
        self, blocks: dict[int, BlockDenoiser], cfg: RunConfig, precision: Precision = Precision.FP32,
        cache: CacheOptions | None = None, device: torch.device = CPU,
    ) -> None:
        """``cache`` is accepted as every span's constructor takes it; diffusion stages keep no KV cache (each
        traversal carries the whole text). Noise is drawn on the host by the request's seeded CPU generators (the
        same draw on every device) and moved to ``device``, where the blocks run."""
        self.cfg = cfg
        self.precision = precision  # arithmetic of run(), under blocktrain.device.autocast
        self.device = device
        self.lo, self.hi = min(blocks), max(blocks)
        if sorted(blocks) != list(range(self.lo, self.hi + 1)):
            raise ValueError(f"a stage holds a contiguous span of blocks, got {sorted(blocks)}")
        self.blocks = {k: b.to(device).eval() for k, b in blocks.items()}
        self.n_last = cfg.model.n_blocks - 1
        self.partition = NoisePartition(cfg.diffusion, cfg.model.n_blocks)

    def describe(self) -> dict[str, Any]:
        return {"family": self.family, "lo": self.lo, "hi": self.hi, "n": self.cfg.model.n_blocks,
                "context": self.cfg.model.context, "d_model": self.cfg.model.d_model,
                "modes": ["ar", "sweep", "spec", "score"], "cached": False, "device": str(self.device)}

    def holds(self, index: int) -> bool:
        return self.lo <= index <= self.hi

    @property
    def is_last(self) -> bool:
        return self.hi == self.n_last

    def release(self, request_id: str, seq: int | None = None) -> bool:
        return False  # no caches: each traversal carries the whole text

    def expire_idle(self) -> int:
        return 0

    def n_params(self) -> int:
        return sum(p.numel() for b in self.blocks.values() for p in b.parameters())

    def batch_key(self, frame: Frame) -> tuple[Any, ...]:
        if frame.mode is Mode.SPEC:
            return (self.family, frame.sigma_index, frame.request_id)  # spec frames carry a draft: one at a time
        return (self.family, frame.sigma_index)

    def validate(self, frame: Frame) -> None:
        """Reject a frame this span cannot run (raises WireError with the reason)."""
        if frame.mode not in (Mode.SCORE, Mode.SWEEP, Mode.AR, Mode.SPEC):
            raise WireError(f"this stage serves BlockTrain blocks; mode {frame.mode} is not one of score/sweep/ar/spec")
        x = input_tensor(frame, "x", self.cfg.model.d_model, "of a diffusion stage")  # every block reads the bytes
        t = x.shape[1]
        frame_param(frame.params, "seed", int, 0)
        if frame.mode is Mode.SWEEP:
            if frame_param(frame.params, "sweep_index", int, 0) < 0:
                raise WireError("parameter 'sweep_index' must be >= 0")
            if frame_param(frame.params, "estimate", str, "sample") not in ("sample", "greedy"):
                raise WireError("parameter 'estimate' must be 'sample' or 'greedy'")
            n_new = frame_param(frame.params, "n_new", int)
            prompt_len = frame_param(frame.params, "prompt_len", int)
            sweeps = frame_param(frame.params, "sweeps", int, 1)
            frame_param(frame.params, "top_k", int, 0)
            frame_number(frame.params, "temperature", 0.0)
            if n_new < 1 or sweeps < 1 or prompt_len < 1:
                raise WireError("sweep needs n_new >= 1, sweeps >= 1 and a prompt of at least 1 byte")
            if sweeps > MAX_SWEEPS:  # each sweep is a traversal of the whole pipeline: bound what one frame asks
                raise WireError(f"parameter 'sweeps' must be at most {MAX_SWEEPS}, got {sweeps}; ask for fewer sweeps")
            if frame_param(frame.params, "sweep_index", int, 0) >= sweeps:
                raise WireError(f"parameter 'sweep_index' must be below 'sweeps' ({sweeps})")
            expected = prompt_len if "z" not in frame.tensors and frame.kind is FrameKind.SUBMIT else prompt_len + n_new
            if t != expected:
                raise WireError(f"sweep frame holds {t} bytes, expected {expected}")
            t = prompt_len + n_new
        if frame.mode is Mode.SPEC:
            t = self._validate_spec(frame)
        if t > self.cfg.model.context:
            raise WireError(
                f"{t} positions exceed the model context of {self.cfg.model.context}; shorten the prompt or the output"
            )
        z = frame.tensors.get("z")
        if (frame.sigma_index > 0 or z is not None) and (z is None or tuple(z.shape) != (*x.shape, self.cfg.model.d_model)):
            raise WireError(f"a frame at sigma index {frame.sigma_index} needs 'z' of shape (b, t, d_model) matching 'x'")

    def _validate_spec(self, frame: Frame) -> int:
        """A spec frame: one sequence (a windowed one: n_draft + 1 windows past the entry); the entry (no z yet)
        drafts, later stages get the draft and q. Returns its length."""
        sp = SpecParams.read(frame.params)
        n, c = sp.n_draft, self.cfg.model.context
        x = frame.tensors["x"]
        self._validate_spec_pos(frame, sp, x.shape[1])
        if "z" not in frame.tensors:
            if x.shape[0] != 1:
                raise WireError("spec frames carry one sequence: x of shape (1, t)")
            if frame.sigma_index != 0 or self.lo != 0:
                raise WireError("a spec request starts at block 0, whose stage drafts with block 0 alone")
            if sp.window and x.shape[1] != c:
                raise WireError(f"a windowed spec frame carries the text's last {c} bytes (the context): x of shape "
                                f"(1, {c}), got {tuple(x.shape)}; send shorter texts without 'window'")
            return x.shape[1] if sp.window else x.shape[1] + n
        validate_carried_draft(frame.tensors, n)
        if sp.window:
            if x.shape[0] != n + 1:
                raise WireError(f"a windowed spec frame past the entry carries its {n + 1} windows, got {x.shape[0]}")
            return x.shape[1]
        if x.shape[0] != 1:
            raise WireError("spec frames carry one sequence: x of shape (1, t)")
        if x.shape[1] <= n:
            raise WireError(f"'x' must cover the accepted text and the {n} draft positions")
        return x.shape[1]

    @staticmethod
    def _validate_spec_pos(frame: Frame, sp: SpecParams, t: int) -> None:
        """``pos`` of a spec frame: diffusion stages keep no cache, so an unwindowed frame carries the whole text
        (pos 0); a windowed one says where its window starts in the text (>= 0; the draft's seed, pos + t + n_draft,
        a 64-bit integer)."""
        pos = frame_param(frame.params, "pos", int, 0)
        if not sp.window and pos != 0:
            raise WireError(f"parameter 'pos' must be 0 on diffusion stages (they keep no KV cache: a spec frame "
                            f"carries the whole text), got {pos}; send the whole text, or a windowed frame")
        if pos < 0 or pos + t + sp.n_draft >= INT64[1]:
            raise WireError(f"parameter 'pos' (where the window starts in the text) must be in 0..{INT64[1] - 1 - t - sp.n_draft}, "
                            f"got {pos}")

    # --- compute -----------------------------------------------------------
    def _start(self, frame: Frame) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, z) of a frame; draws z_0 from the request seed when the frame starts a traversal."""
        x = frame.tensors["x"]
        seed = int(frame.params.get("seed", 0))
        d = self.cfg.model.d_model
        if "z" in frame.tensors:
            return x.clone(), frame.tensors["z"].float()
        if frame.mode is Mode.SWEEP:
            sweep_index = int(frame.params.get("sweep_index", 0))
            if x.shape[1] == int(frame.params["prompt_len"]):
                pad = torch.full((x.shape[0], int(frame.params["n_new"])), PLACEHOLDER_BYTE, dtype=torch.uint8,
                                 device=x.device)
                x = torch.cat([x, pad], dim=1)
            g = Seed.SWEEP_NOISE.generator(seed, sweep_index)
        else:
            g = Seed.CHAIN.generator(seed, 0)  # the draw of AssembledModel.log_probs(x, chains=1, seed): chain 0
        return x.clone(), initial_noise((x.shape[0], x.shape[1]), d, self.cfg.diffusion.sigma_max, g, x.device)

    def run(self, frames: Sequence[Frame]) -> list[Frame]:
        """Run this span on frames that share ``batch_key``; one output frame per input."""
        return on_device(frames, self.device, self.precision, self._run)

    def _run(self, frames: Sequence[Frame]) -> list[Frame]:
        if frames[0].mode is Mode.SPEC:
            return [self._run_spec(f) for f in frames]
        starts = [self._start(f) for f in frames]
        rows = [x.shape[0] for x, _ in starts]
        lens = [x.shape[1] for x, _ in starts]
        t_max, b_all, d = max(lens), sum(rows), self.cfg.model.d_model
        x = torch.zeros(b_all, t_max, dtype=torch.uint8, device=self.device)
        z = torch.zeros(b_all, t_max, d, device=self.device)
        offsets = [sum(rows[:i]) for i in range(len(rows))]
        for (xi, zi), r0, r, t in zip(starts, offsets, rows, lens, strict=True):
            x[r0 : r0 + r, :t] = xi
            z[r0 : r0 + r, :t] = zi
        logits = torch.empty(0)
        for k in range(frames[0].sigma_index, self.hi + 1):
            z, logits = chain_step(self.blocks[k], k, x, z, self.partition, self.cfg.diffusion, k == self.n_last)
            for f, r0, r in zip(frames, offsets, rows, strict=True):
                if f.mode is Mode.SWEEP:
                    self._update_estimate(f, k, x[r0 : r0 + r], logits[r0 : r0 + r])
        outs = []
        for f, r0, r, t in zip(frames, offsets, rows, lens, strict=True):
            outs.append(self._output(f, x[r0 : r0 + r, :t], z[r0 : r0 + r, :t], logits[r0 : r0 + r, :t]))
        return outs

    def _run_spec(self, f: Frame) -> Frame:
        """Speculative decoding on diffusion blocks: the entry drafts with block 0 alone, the chain verifies.

        The noise of a spec request is a function of (seed, position) only
        (:func:`~blocktrain.diffusion.sampler.position_noise`), so the chain's p at a
        draft position is the p the one-byte-longer text gets: the accepted text is
        distributed as autoregressive sampling from the chain under that noise.
        Block 0 alone drafts from the chain's own first evaluation, at the same noise.
        A windowed frame (the text outgrew the context) carries the text's last ``context`` bytes; row i is the
        window before draft byte i (:func:`~blocktrain.serve.wire.speculative.windows`), each on the same
        per-position noise, as a sliding fixed-noise loop reads it.
        """
        sp = SpecParams.read(f.params)
        n, d = sp.n_draft, self.cfg.model.d_model
        carried = {k: v for k, v in f.tensors.items() if k in ("draft", "q")}
        c = self.cfg.model.context
        if "z" in f.tensors:
            x, z = f.tensors["x"].clone(), f.tensors["z"].float()
        else:
            text = f.tensors["x"][0]  # (t,) on the device
            g_noise = Seed.CHAIN.generator(sp.seed, 0)
            eps = position_noise(1, min(text.shape[0] + n, c), c, d, g_noise, self.device)  # (1, t + n, d), a window at most
            s0 = self.partition.block_steps(0, self.cfg.diffusion.steps_per_block)[0]

            def block0_alone(draft: torch.Tensor) -> torch.Tensor:
                win = torch.cat([text, draft.to(torch.uint8)])[-c:].unsqueeze(0)  # (1, t'): the text or its last window
                t = win.shape[1]
                logits = self.blocks[0](win, s0 * eps[:, :t], eps.new_full((), s0))  # (1, t, 256)
                return logits[0, -1].float()

            draft, drafted = sp.draft(int(f.params.get("pos", 0)) + text.shape[0], block0_alone, self.device)
            if drafted:
                carried = drafted
            # windowed: every row is c bytes (n + 1, c); else the one row (1, t + n)
            x = windows(text, draft, c) if sp.window else torch.cat([text, draft.to(torch.uint8)]).unsqueeze(0)
            z = (self.cfg.diffusion.sigma_max * eps).expand(x.shape[0], -1, -1).clone()
        logits = torch.empty(0)
        for k in range(f.sigma_index, self.hi + 1):
            z, logits = chain_step(self.blocks[k], k, x, z, self.partition, self.cfg.diffusion, k == self.n_last)
        if not self.is_last:
            return Frame(FrameKind.WORK, f.request_id, f.mode, self.hi + 1, dict(f.params), {"x": x, "z": z, **carried})
        out = logits[:, -1] if sp.window else logits[0, -(n + 1):]  # windowed: each row's last position
        return Frame(FrameKind.RESULT, f.request_id, f.mode, 0, dict(f.params), {"logits": out.float(), **carried})

    def _update_estimate(self, f: Frame, k: int, x: torch.Tensor, logits: torch.Tensor) -> None:
        """Generated positions take the running estimate: byte p+1 is read off the logits at p."""
        p, n = int(f.params["prompt_len"]), int(f.params["n_new"])
        s = int(f.params.get("sweep_index", 0))
        g = Seed.SWEEP_ESTIMATE.generator(int(f.params.get("seed", 0)), s, k)
        est = logits[:, p - 1 : p + n - 1].reshape(-1, VOCAB_SIZE)  # (b*n, 256)
        temp = float(f.params.get("temperature", 0.0))
        if k < self.n_last and f.params.get("estimate", "sample") == "greedy":
            temp = 0.0  # intermediate estimates by argmax; only the last block samples
        drawn = sample_rows(est, temp, int(f.params.get("top_k", 0)), g)  # (b*n,) on the device; the CPU generator's noise
        x[:, p : p + n] = drawn.view(x.shape[0], n).to(torch.uint8)

    def _output(self, f: Frame, x: torch.Tensor, z: torch.Tensor, logits: torch.Tensor) -> Frame:
        params = dict(f.params)
        if not self.is_last:
            return Frame(FrameKind.WORK, f.request_id, f.mode, self.hi + 1, params, {"x": x, "z": z})
        if f.mode is Mode.SCORE:
            return Frame(FrameKind.RESULT, f.request_id, f.mode, 0, params, {"logits": logits.float()})
        if f.mode is Mode.AR:
            return Frame(FrameKind.RESULT, f.request_id, f.mode, 0, params, {"logits": logits[:, -1].float()})
        if not bool(torch.isfinite(logits).all()):  # a NaN estimate drew byte 0 (the sampler reads nothing back): one
            # read per traversal, at its last stage, where the bytes go to the host anyway
            return f.reply_error(ErrorCode.INTERNAL, "the model's logits are not finite (a diverged or damaged "
                                 "checkpoint?): no sweep from it")
        s = int(params.get("sweep_index", 0))
        if s + 1 < int(params.get("sweeps", 1)):
            params["sweep_index"] = s + 1  # another sweep: fresh noise, the estimate as context
            return Frame(FrameKind.WORK, f.request_id, f.mode, 0, params, {"x": x})
        return Frame(FrameKind.RESULT, f.request_id, f.mode, 0, params, {"bytes": x[:, int(params["prompt_len"]) :]})
