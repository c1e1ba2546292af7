"""Byte-level Transformer pieces: block denoiser, E2E reference, target embedding.

Model code never imports network, checkpoint or CLI code.
"""

from blocktrain.model.block import BlockDenoiser
from blocktrain.model.e2e import E2ETransformer
from blocktrain.model.embedding import make_target_embedding

__all__ = ["BlockDenoiser", "E2ETransformer", "make_target_embedding"]
