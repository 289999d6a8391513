"""Gradient compression: codecs, error feedback, and the collectives that send compressed payloads.

The modules, lowest first::

    abilities.py       the Compressor protocol and the optional abilities a codec has (isinstance)
    kernels.py         fused GPU kernels of the hot loops (torch.compile on CUDA, eager elsewhere)
    quantize.py        int8 / int4 / 2-bit per-chunk quantisation
    sparsify.py        top-k and threshold
    onebit.py          sign with per-chunk magnitudes (1-bit SGD / signSGD with scale)
    powersgd.py        PowerSGD: rank-r factors, reduced by the codec itself
    error_feedback.py  residual memory: what compression dropped goes into the next step
    codecs.py          the registry by name: get_compressor("int8"), register_compressor(...)
    paths.py           the wire paths (allreduce of summable payloads, allgather of the others)
    allreduce.py       allreduce_compressed: the entry point, choosing a path per codec

Example::

    from phalanx.comm.compression import allreduce_compressed, get_compressor
    avg = allreduce_compressed(grad, get_compressor("int8"), name="layer1.weight")
"""

from phalanx.comm.compression.abilities import Compressor
from phalanx.comm.compression.allreduce import allreduce_compressed
from phalanx.comm.compression.codecs import (
    CastCompressor,
    NoneCompressor,
    available_compressors,
    get_compressor,
    register_compressor,
)
from phalanx.comm.compression.error_feedback import ErrorFeedback

__all__ = ["Compressor", "NoneCompressor", "CastCompressor", "ErrorFeedback", "available_compressors",
           "get_compressor", "register_compressor", "allreduce_compressed"]
