"""Old home of the codec registry, kept for code that imports it: see :mod:`phalanx.comm.codecs`.

Example::

    from phalanx.comm.compression import get_compressor   # same as phalanx.comm.codecs
"""

from phalanx.comm.codecs import (
    CastCompressor,
    Compressor,
    NoneCompressor,
    available_compressors,
    get_compressor,
    register_compressor,
)

__all__ = ["Compressor", "NoneCompressor", "CastCompressor", "register_compressor", "get_compressor",
           "available_compressors"]
