"""The argument checks of :class:`phalanx.keras.DistributedOptimizer`, shared by its Keras 3 and
tf-keras forms so that both refuse a bad argument with the same one line.
"""

from __future__ import annotations

import numbers

from phalanx.comm.collectives import Average, ReduceOp
from phalanx.comm.compression.codecs import get_compressor

__all__ = ["LEGACY_ARGS", "check_reduction", "legacy_arguments"]


LEGACY_ARGS = ("name", "device_dense", "device_sparse", "compression", "sparse_as_dense",
                "gradient_predivide_factor", "op", "backward_passes_per_step", "average_aggregated_gradients",
                "num_groups", "groups", "bucket_mb")


def check_reduction(backward_passes_per_step, op, gradient_predivide_factor) -> ReduceOp:
    """One line for a bad reduction argument, on Keras 3 and tf-keras alike; returns ``op`` as a ReduceOp."""
    k = backward_passes_per_step
    if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 1:
        raise ValueError(f"phalanx.keras.DistributedOptimizer: backward_passes_per_step must be an integer >= 1 "
                         f"(the passes summed before each update), got {backward_passes_per_step!r}")
    op = ReduceOp(op)
    if op not in (ReduceOp.AVERAGE, ReduceOp.SUM):
        raise ValueError(f"op must be hvd.Average or hvd.Sum for gradients, got {op.name.title()}")
    if gradient_predivide_factor <= 0 or (gradient_predivide_factor != 1.0 and op is not ReduceOp.AVERAGE):
        raise ValueError("gradient_predivide_factor must be > 0 and needs op=hvd.Average (it splits the "
                         f"averaging into a division before and after the sum); got {gradient_predivide_factor}")
    return op


def legacy_arguments(args, kwargs) -> list:
    """DistributedOptimizer's arguments, positional or named, as the tf-keras form takes them."""
    given = dict(zip(LEGACY_ARGS, args))
    given.update(kwargs)
    if given.pop("process_set", None) is not None:
        raise ValueError("phalanx.keras.DistributedOptimizer: process_set is not supported; every rank takes part")
    unknown = sorted(set(given) - set(LEGACY_ARGS))
    if unknown:
        raise ValueError(f"phalanx.keras.DistributedOptimizer got unknown arguments {unknown}; "
                         "set optimizer options on the optimizer you wrap")
    passes, predivide = given.get("backward_passes_per_step", 1), given.get("gradient_predivide_factor", 1.0)
    op = check_reduction(passes, given.get("op", Average), predivide)
    return [given.get("name"), get_compressor(given.get("compression")), op, passes,
            given.get("average_aggregated_gradients", False), predivide, given.get("bucket_mb")]
