"""Pipelined serving of the block stack (and of the E2E baseline) over TCP.

Modules:

* :mod:`~blocktrain.serve.wire` - frames: magic, lengths, JSON header, safetensors payload;
* :mod:`~blocktrain.serve.compute` - what a stage computes (a span of blocks, or of E2E layers
  with a KV cache per request);
* :mod:`~blocktrain.serve.loading` - building a span from a run directory or with random weights;
* :mod:`~blocktrain.serve.links` - connections, and the custody-keeping link to the next stage;
* :mod:`~blocktrain.serve.stage` - the asyncio stage server (batching, forwarding, replicas,
  acks, deadlines);
* :mod:`~blocktrain.serve.client` - the client (score, sweep, ar, baseline) and ``generate_remote``;
* :mod:`~blocktrain.serve.netns` - network namespaces joined by veth for the benchmark;
* :mod:`~blocktrain.serve.bench` and :mod:`~blocktrain.serve.benchclient` - ``blocktrain bench serve``.
"""
