"""The HTTP gateway over a pipeline: :mod:`~blocktrain.serve.gateway.app` (routes), :mod:`~blocktrain.serve.gateway.backend`
(request validation, modes, UTF-8) and :mod:`~blocktrain.serve.gateway.logprobs`. Imports ``client`` and ``wire`` only."""
