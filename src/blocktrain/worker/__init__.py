"""A volunteer worker: it registers with a coordinator, trains its block's rounds and pushes their deltas.

* :mod:`.loop`: the worker's rounds (:class:`.loop.Worker`), told what to do by :mod:`.options`;
* :mod:`.engines`: how a round's delta reaches the coordinator, directly or averaged with peers on hivemind;
* :mod:`.client`: its HTTP calls to the coordinator, with retries and bounded answers;
* :mod:`.frozen`: the finished blocks a stack block reads, downloaded once and hash-checked.
"""
