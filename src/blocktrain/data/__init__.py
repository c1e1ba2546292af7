"""Byte-level datasets: preparing, locating, validating, memory-mapping and windowing.

Nothing here imports torch at package level (``blocktrain prepare`` starts fast and lean); the training stream is
:mod:`blocktrain.data.stream`.
"""

from blocktrain.data.dataset import ByteSplit, DataDir, eval_windows, resolve_data_dir

__all__ = ["ByteSplit", "DataDir", "eval_windows", "resolve_data_dir"]
