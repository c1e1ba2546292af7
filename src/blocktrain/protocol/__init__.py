"""The coordinator-worker wire protocol, shared by both sides.

* :mod:`.delta`: encodings of a worker's delta (``none``, ``bf16``, ``int8``),
  their exact tensor schema, and the safetensors payload a worker pushes;
* :mod:`.weights`: the trainable parameters that travel, and the published
  step ``W_{v+1} = W_v + float32(step)`` both sides apply bit-identically.

Neither the coordinator (:mod:`blocktrain.coordinator`) nor the worker
(:mod:`blocktrain.worker`) is imported from here.
"""
