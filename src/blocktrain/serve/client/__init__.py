"""Clients of a pipeline: :mod:`~blocktrain.serve.client.pipeline` (one connection to the entry stage, the modes)
and :mod:`~blocktrain.serve.client.decoding` (the byte-at-a-time and speculative loops). Imports only ``wire``."""
