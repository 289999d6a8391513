"""What a gradient engine learned while training, kept and agreed across an elastic re-form.

An engine learns its bucket size (the autotuner's result, or ``set_bucket_mb``) on the job's
first steps. A re-form must not reset it, and a newcomer, whose engine is fresh, must bucket
as the old ranks do, or their collectives no longer match. So at the re-form rank 0 of the
new generation (its oldest member: the launcher lists old members first) sends what each of
its engines learned, in one broadcast for all engines, and every rank adopts it::

    rank 0 (old):   engine A: 16 MB, autotune done (16 MB, flat)   ─┐ broadcast_object
    rank 3 (new):   engine A: 25 MB (default), autotune searching  ─┴→ 16 MB, autotune done (16 MB, flat)

Engines are matched by their parameters' shapes and dtypes in order, not by position, so
a rank holding an extra, stale engine (a newcomer's leftovers) still gets the right value.
An autotuner that rank 0 had not finished restarts its search on every rank, in step.

Example::

    agree_learned(engines)     # every rank, right after the new group is made (reform_engines does it)
"""

from __future__ import annotations

import torch.distributed as dist

from phalanx.comm.collectives import broadcast_object

__all__ = ["agree_learned", "layout_of", "learned_by"]


def layout_of(engine) -> tuple:
    """The engine's identity across processes: its parameters' shapes and dtypes, in order."""
    return tuple((tuple(p.shape), str(p.dtype)) for p in engine.buckets.params)


def learned_by(engine) -> dict:
    tuner = getattr(engine, "autotuner", None)
    return {"bucket_bytes": engine.buckets.bucket_bytes, "tuned": tuner.best if tuner is not None else None}


def agree_learned(engines) -> None:
    """Every rank: adopt rank 0's learned settings for each engine (a collective on the default group)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    theirs = broadcast_object({layout_of(e): learned_by(e) for e in engines} if dist.get_rank() == 0 else None)
    for engine in engines:
        learned = theirs.get(layout_of(engine))
        if learned is None:
            continue  # rank 0 has no such engine: nothing to agree with
        engine.buckets.bucket_bytes = learned["bucket_bytes"]  # the re-form rebuilds the buckets at this size
        tuner = getattr(engine, "autotuner", None)
        if tuner is not None:
            tuner.reformed(learned["tuned"])
