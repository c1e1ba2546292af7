"""The stage server: a span (:mod:`blocktrain.serve.runtime`) behind a TCP listener, in a ring of stages.

:mod:`~blocktrain.serve.stage.server` holds the parts and runs the batching loop; its options are in
:mod:`~blocktrain.serve.stage.options`. Imports ``wire`` and ``runtime``, never ``client`` or ``gateway``.
"""
