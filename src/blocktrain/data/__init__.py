"""Byte-level WikiText: locating, validating, memory-mapping and windowing."""

from blocktrain.data.dataset import ByteSplit, DataDir, eval_windows, resolve_data_dir
from blocktrain.data.stream import TrainStream

__all__ = ["ByteSplit", "DataDir", "TrainStream", "eval_windows", "resolve_data_dir"]
