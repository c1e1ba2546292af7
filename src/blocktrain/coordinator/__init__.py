"""The coordinator: one front (:mod:`.service`) that owns the lock and the run's state, and parts it calls under it.

* :mod:`.app`: the HTTP routes (FastAPI) over :class:`.service.Coordinator`;
* :mod:`.roster`, :mod:`.uploads`, :mod:`.rounds`, :mod:`.intake`, :mod:`.audit`, :mod:`.conduct`: registration and
  leases, pushes, the rounds and their outer step (:mod:`.aggregate`), the checks on a push, audits, quarantine;
* :mod:`.db`, :mod:`.tables`, :mod:`.rows`, :mod:`.store`, :mod:`.blobs`, :mod:`.checkpoints`: the SQLite state and its typed rows,
  content-addressed blobs, the published versions;
* :mod:`.simulate`: the same round in one process, for studies and tests; :mod:`.hostile`: what a hostile replica
  of it overrides.
"""
