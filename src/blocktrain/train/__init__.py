"""Block-local training and the end-to-end reference."""

from blocktrain.train.block import train_block
from blocktrain.train.e2e import train_e2e
from blocktrain.train.run import TrainSummary

__all__ = ["TrainSummary", "train_block", "train_e2e"]
