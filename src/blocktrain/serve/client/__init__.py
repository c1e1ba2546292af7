"""Clients of a pipeline: :mod:`~blocktrain.serve.client.pipeline` (one connection to the entry stage),
:mod:`~blocktrain.serve.client.decoding` (the decoding loops and ``decode``, the one dispatcher from a mode to its
loop) and :mod:`~blocktrain.serve.client.stage_info` (the entry stage's description). ``pipeline`` imports
``decoding``, never the other way round. Imports only ``wire``."""
