"""The serving wire, shared by stages and clients: frames (:mod:`~blocktrain.serve.wire.frames`), their size limits
(:mod:`~blocktrain.serve.wire.limits`), connections and the custody-keeping link (:mod:`~blocktrain.serve.wire.links`),
and the spec frame's parameters with the speculative-sampling maths both ends apply
(:mod:`~blocktrain.serve.wire.speculative`). Imports nothing else of ``serve``."""
