"""Old home of the gradient engine, kept for code that imports it: see :mod:`phalanx.parallel.data`.

Example::

    from phalanx.parallel.engine import GradientEngine, BucketReduction
"""

from phalanx.comm.buckets import PaddedBucket, PlannedBuckets
from phalanx.parallel.data.config import DEFAULT_BUCKET_MB, VIEW_MIN_NUMEL, job_defaults
from phalanx.parallel.data.gradients import GradientEngine
from phalanx.parallel.data.hooks import register_engine_hook
from phalanx.parallel.data.reduction import AllReduceReduction, BucketReduction

__all__ = ["GradientEngine", "BucketReduction", "AllReduceReduction", "PaddedBucket", "PlannedBuckets",
           "register_engine_hook", "job_defaults", "DEFAULT_BUCKET_MB", "VIEW_MIN_NUMEL"]
