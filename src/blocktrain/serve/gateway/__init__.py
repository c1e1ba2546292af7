"""The HTTP gateway over a pipeline: :mod:`~blocktrain.serve.gateway.app` (the routes),
:mod:`~blocktrain.serve.gateway.protocol` (the request models), :mod:`~blocktrain.serve.gateway.responses` (the
answer and error models), :mod:`~blocktrain.serve.gateway.checks` (the requests' field checks),
:mod:`~blocktrain.serve.gateway.generation` (a request settled against the pipeline),
:mod:`~blocktrain.serve.gateway.serving` (a request served from the pipeline) and
:mod:`~blocktrain.serve.gateway.logprobs` (bytes as tokens). Imports ``client`` and ``wire`` only."""
