"""Safetensors checkpoints with a versioned metadata header, and run directories."""

from blocktrain.checkpoint.safetensors_io import FORMAT_VERSION, load_file, pack, save_file, tensors_sha256, unpack

__all__ = ["FORMAT_VERSION", "load_file", "pack", "save_file", "tensors_sha256", "unpack"]
