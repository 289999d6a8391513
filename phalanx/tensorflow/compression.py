"""``hvd.Compression`` for TensorFlow: ``compress``/``decompress`` take TF tensors (and torch ones).

Horovod's user code calls the compressor on TF tensors itself (``compress(t) -> (t16, ctx)``);
phalanx's gradient paths call the same object on torch tensors after the DLPack crossing,
so each member answers both.

Example::

    t16, ctx = hvd.Compression.fp16.compress(tf.constant([1.5]))   # float16
    back = hvd.Compression.fp16.decompress(t16, ctx)                # float32 again
"""

from __future__ import annotations

import tensorflow as tf
import torch

from phalanx.comm.compression.codecs import CastCompressor, NoneCompressor

__all__ = ["Compression", "TFNoneCompressor", "TFCastCompressor"]


class TFNoneCompressor(NoneCompressor):
    """No compression, for TF and torch tensors alike."""


class TFCastCompressor(CastCompressor):
    """Floating tensors travel as ``tf_dtype`` (others as they are), for TF and torch tensors alike."""

    def __init__(self, dtype: torch.dtype, tf_dtype, name: str) -> None:
        super().__init__(dtype, name)
        self.tf_dtype = tf_dtype

    def compress(self, tensor):
        if isinstance(tensor, torch.Tensor):
            return super().compress(tensor)
        tensor = tf.convert_to_tensor(tensor)
        if not tensor.dtype.is_floating or tensor.dtype == self.tf_dtype:
            return tensor, None
        return tf.cast(tensor, self.tf_dtype), tensor.dtype

    def decompress(self, payload, ctx):
        if isinstance(payload, torch.Tensor):
            return super().decompress(payload, ctx)
        return payload if ctx is None else tf.cast(payload, ctx)


class Compression:
    """Horovod's ``hvd.Compression``: ``none`` and ``fp16`` (plus ``bf16``)."""

    none = TFNoneCompressor()
    fp16 = TFCastCompressor(torch.float16, tf.float16, "fp16")
    bf16 = TFCastCompressor(torch.bfloat16, tf.bfloat16, "bf16")
