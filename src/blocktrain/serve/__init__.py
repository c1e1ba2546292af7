"""Pipelined serving of the block stack (and of the E2E baseline) over TCP.

Modules:

* :mod:`~blocktrain.serve.wire` - frames: magic, lengths, JSON header, safetensors payload;
* :mod:`~blocktrain.serve.compute` - what a stage computes (a span of blocks, or of E2E layers
  with a KV cache per request);
* :mod:`~blocktrain.serve.loading` - building a span from a run directory or with random weights;
* :mod:`~blocktrain.serve.links` - connections, and the custody-keeping link to the next stage;
* :mod:`~blocktrain.serve.limits` - the wire's size limits;
* :mod:`~blocktrain.serve.stage` - the asyncio stage server: lifecycle and batching, built of
  :mod:`~blocktrain.serve.stage_options` (its options), :mod:`~blocktrain.serve.stage_core` (its state),
  :mod:`~blocktrain.serve.entry` (the entry's pending requests, deadlines, retries),
  :mod:`~blocktrain.serve.custody` (routing, forwarding with custody, replicas) and
  :mod:`~blocktrain.serve.admission` (inbound connections and their limits);
* :mod:`~blocktrain.serve.client` - the client (score, sweep, ar, baseline) and ``generate_remote``.

The benchmark harness (``blocktrain bench serve``, network namespaces) lives in :mod:`blocktrain.bench`:
:mod:`~blocktrain.bench.serve` and the ``serve_*`` modules beside it, and :mod:`~blocktrain.bench.netns`.
"""
