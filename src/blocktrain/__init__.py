"""BlockTrain: a byte-level LM cut into independently trained denoiser blocks."""

__version__ = "0.1.0"
