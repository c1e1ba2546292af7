"""Pipelined serving of the block stack (and of the E2E baseline) over TCP, in five subpackages that import only
downward (``tests/test_layering.py`` checks it)::

    wire  <-  runtime  <-  stage          frames, limits, links, spec maths; what a stage computes; the stage server
    wire  <-  client   <-  gateway        the pipeline client and decoding loops; the HTTP gateway

The benchmark harness (``blocktrain bench serve``) lives in :mod:`blocktrain.bench`.
"""
