"""Communication layer.

    collectives.py   one function per collective, async handles, a group of one returns at once
    mismatch.py      the cross-rank check that raises instead of hanging
    algorithms.py    ring and hierarchical allreduce (chosen by topology)
    buckets.py       tensor fusion: flat buckets launched in order
    broadcast.py     parameters and optimizer state from one rank to all
    compression/     codecs, error feedback, compressed collectives
    horovod_ops/     Horovod's semantics (named ops, join negotiation, process sets, Adasum, ...)
"""
