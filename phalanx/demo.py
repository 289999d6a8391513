"""The digits demo's data, model and training function, where scripts have imported them from.

The ``phalanx demo`` command lives in :mod:`phalanx.cli.demo`; this name stays for
``from phalanx.demo import load_digits, make_model, train`` (examples, benchmarks).
"""

from phalanx.cli.demo import load_digits, make_model, train

__all__ = ["load_digits", "make_model", "train"]
