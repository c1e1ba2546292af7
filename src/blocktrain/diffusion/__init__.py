"""Noise schedule, partition of the noise range, loss and sampler.

Pure math on tensors: nothing here imports network, checkpoint or CLI code.
"""

from blocktrain.diffusion.partition import NoisePartition, Slice
from blocktrain.diffusion.schedule import edm_loss_weight
from blocktrain.model.preconditioning import Preconditioning

__all__ = ["NoisePartition", "Preconditioning", "Slice", "edm_loss_weight"]
