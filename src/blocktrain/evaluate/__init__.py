"""Assembling a run into a model, scoring splits and generating bytes."""

from blocktrain.evaluate.assembled import AssembledModel, E2EModel, load_model_from_run
from blocktrain.evaluate.scoring import ScoreResult, score_split

__all__ = ["AssembledModel", "E2EModel", "ScoreResult", "load_model_from_run", "score_split"]
