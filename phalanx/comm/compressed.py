"""Old home of the compressed allreduce, kept for code that imports it (``docs/compression.md``).

The entry point and its path selection are in :mod:`phalanx.comm.compressed_allreduce`,
the paths and the :data:`wire` counter in :mod:`phalanx.comm.compressed_paths`.

Example::

    from phalanx.comm.compressed import allreduce_compressed, wire
"""

from phalanx.comm.compressed_allreduce import allreduce_compressed, choose_path
from phalanx.comm.compressed_paths import PIECE_NUMEL, WireCounter, choose_algorithm, wire

__all__ = ["allreduce_compressed", "choose_path", "WireCounter", "wire", "choose_algorithm", "PIECE_NUMEL"]
