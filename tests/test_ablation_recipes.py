"""The ablation harness (benchmarks/) must score the library's chain, and its recipes must not leak the target."""

from __future__ import annotations

import pytest
import torch
from benchmarks.quality import ablation_recipes

from blocktrain.diffusion.partition import NoisePartition
from blocktrain.diffusion.sampler import chain_logits
from blocktrain.model.block import BlockDenoiser
from blocktrain.noise import normal
from blocktrain.objectives.diffusion import DiffusionObjective
from blocktrain.presets import tiny
from blocktrain.seeds import init_seed


def _blocks() -> list[BlockDenoiser]:
    cfg = tiny()
    blocks = []
    for k in range(cfg.model.n_blocks):
        torch.manual_seed(k)
        b = BlockDenoiser(cfg.model, cfg.diffusion.sigma_data)
        torch.nn.init.normal_(b.z_in.weight, std=0.2)  # make z matter, so a wrong z shows
        torch.nn.init.normal_(b.mod.weight, std=0.2)
        blocks.append(b.eval())
    return blocks


def test_harness_chain_equals_library_chain() -> None:
    cfg = tiny()
    blocks = _blocks()
    part = NoisePartition(cfg.diffusion, cfg.model.n_blocks)
    obj = ablation_recipes.objective_for(cfg, "naive")
    assert isinstance(obj, DiffusionObjective)  # every recipe but library-stack builds on diffusion
    x = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        ref = chain_logits(blocks, x, part, cfg.diffusion, torch.Generator().manual_seed(3))
        _, got, steps = ablation_recipes.chain_state("naive", obj, blocks, x, torch.Generator().manual_seed(3), len(blocks))
    # the harness runs the library's chain step: bit for bit the same logits
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    assert len(steps) == len(blocks)
    torch.testing.assert_close(steps[-1], ref, rtol=0, atol=0)


def test_boost_chain_reads_out_the_running_logit_sum() -> None:
    """boost: D and the readout use the sum of the blocks' logits, through the library's Euler step."""
    cfg = tiny()
    blocks = _blocks()
    obj = ablation_recipes.objective_for(cfg, "boost")
    assert isinstance(obj, DiffusionObjective)
    x = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        _, total, steps = ablation_recipes.chain_state("boost", obj, blocks, x, torch.Generator().manual_seed(3), len(blocks))
        # by hand: z_0 = sigma_max eps (one draw per position, the same in each row), then
        # z <- z + (s' - s)(z - softmax(sum) @ E) / s
        g = torch.Generator().manual_seed(3)
        z = cfg.diffusion.sigma_max * normal((1, 16, cfg.model.d_model), g).expand(2, 16, cfg.model.d_model)
        acc = torch.zeros(2, 16, 256)
        for k, blk in enumerate(blocks):
            s, s_next = obj.partition.block_steps(k, 1)
            acc = acc + blk(x, z, torch.tensor(s))
            z = z + (s_next - s) * ((z - torch.softmax(acc, -1) @ blk.E) / s)
    assert total is not None
    torch.testing.assert_close(total, acc, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(steps[-1], steps[0])


def test_library_stack_recipe_trains_the_library_objective() -> None:
    """library-stack: StackBlocks trained on the library's stack loss, two steps each; the loss is the stack objective's."""
    from blocktrain.model.stack import StackBlock
    from blocktrain.objectives.stack import StackObjective

    cfg = tiny().with_train(steps=2, warmup_steps=1)
    data = torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(0)).to(torch.uint8).numpy()
    blocks, frozen = ablation_recipes.train_blocks(ablation_recipes.Variant(ablation_recipes.LIBRARY_STACK, 2), cfg, data)
    assert [type(b) for b in blocks] == [StackBlock] * 4
    assert frozen == (0 + 1 + 2 + 3) * 2  # block k reads k frozen blocks per step
    obj = ablation_recipes.objective_for(cfg, ablation_recipes.LIBRARY_STACK)
    assert isinstance(obj, StackObjective)
    x = torch.from_numpy(data[: 2 * 16].reshape(2, 16).copy())
    refs = obj.reference_logits(blocks, x, torch.Generator())
    assert len(refs) == 4 and refs[-1].shape == (2, 16, 256)
    for k, blk in enumerate(blocks):  # each block starts from the harness's seeded init and moved off it
        torch.manual_seed(init_seed(ablation_recipes.HARNESS_SEED, k))
        init = obj.build_block(k)
        pairs = list(zip(init.state_dict().values(), blk.state_dict().values(), strict=True))
        assert any(not torch.equal(a, b) for a, b in pairs)  # two AdamW steps moved the weights
        assert all(a.shape == b.shape for a, b in pairs)


def test_variant_rejects_unknown_recipe() -> None:
    with pytest.raises(ValueError, match="unknown recipe"):
        ablation_recipes.Variant("e2e", 10)


@pytest.mark.parametrize("mode", ["features", "stack"])
def test_feature_chain_is_causal(mode: str) -> None:
    """Changing byte t must not change the feature chain's logits before t (no look-ahead, no target leak)."""
    cfg = tiny()
    torch.manual_seed(0)
    blocks = [ablation_recipes.FeatureBlock(cfg.model, cfg.diffusion.sigma_data, identity=mode == "stack").eval() for _ in range(4)]
    x = torch.randint(0, 256, (1, 16))
    x2 = x.clone()
    x2[0, 10] = (x2[0, 10] + 1) % 256
    with torch.no_grad():
        a, _ = ablation_recipes.feature_chain(blocks, x, torch.Generator().manual_seed(1), cfg.diffusion.sigma_max, cfg.model.d_model)
        b, _ = ablation_recipes.feature_chain(blocks, x2, torch.Generator().manual_seed(1), cfg.diffusion.sigma_max, cfg.model.d_model)
    torch.testing.assert_close(a[:, :10], b[:, :10], rtol=0, atol=0)
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_readout_ablation_last_step_is_the_assembled_models_chain() -> None:
    """benchmarks/quality/readout_ablation.py reads the library's chain: its last_step readout is AssembledModel.log_probs."""
    from benchmarks.quality import readout_ablation

    from blocktrain.evaluate.assembled import AssembledModel

    cfg = tiny()
    model = AssembledModel(_blocks(), cfg)
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        lps = readout_ablation.chain_all_logits(model, x, 0)
        want = model.log_probs(x, chains=1, seed=0)[0]
    assert len(lps) == cfg.model.n_blocks + 1  # one per block, then the sigma_min readout
    torch.testing.assert_close(readout_ablation.combine(lps, "last_step"), want, rtol=0, atol=0)
    assert not torch.allclose(readout_ablation.combine(lps, "sigma_min"), want)
