"""Old home of ``OptimizerOverlap``, kept for code that imports it: :mod:`phalanx.parallel.data.overlap`.

Example::

    from phalanx.parallel.overlap import OptimizerOverlap
"""

from phalanx.parallel.data.overlap import OptimizerOverlap

__all__ = ["OptimizerOverlap"]
