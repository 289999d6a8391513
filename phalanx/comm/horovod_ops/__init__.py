"""Horovod's collective semantics, beside (not among) the core collectives of :mod:`phalanx.comm`.

What a Horovod script expects beyond a plain collective, used by the ``phalanx.horovod`` and
``phalanx.keras`` / ``phalanx.tensorflow`` fronts and by ``DistributedOptimizer``'s ``join``::

    ops.py           the collectives with Horovod's rules (join answers, dtypes, Adasum)
    names.py         named submission: pending names started by name, handles, poll, synchronize
    negotiate.py     the rounds that decide what starts next and who still takes part (names, join)
    process_sets.py  named subsets of the ranks with their own collectives
    adasum.py        adaptive summation (Maleki et al., MLSys 2021)
    autograd.py      differentiable collectives (the gradient's collective in backward)
    dtypes.py        dtypes the backends lack carried in wider ones; grouped tensors fused

Example::

    from phalanx.comm.horovod_ops import ops
    handle = ops.allreduce_async(tensor, name="loss")
    avg = ops.synchronize(handle)
"""
