"""Backend tensors to and from torch, without copies where the backend allows it.

phalanx's collectives run on torch tensors (c10d). What each Keras backend costs
to cross (measured by ``benchmarks/keras.py``, docs/keras.md):

* torch: the tensor itself, nothing to do;
* tensorflow, jax: DLPack both ways (no copy on CPU; ~4 µs a round trip, whatever
  the size, against ~1.2 ms for a 4 MB tensor through NumPy);
* jax inside ``jax.jit`` (Keras's compiled train step): one ``io_callback``; the host
  function gets NumPy arrays (read as torch tensors without a copy) and its results
  are copied back into the computation by JAX;
* NumPy arrays and Python numbers: ``torch.as_tensor`` (shares NumPy's memory).

Example::

    t = to_torch(tf_tensor)            # shares tf_tensor's buffer
    back = from_torch(t * 2, like=tf_tensor)
"""

from __future__ import annotations

import sys

import numpy as np
import torch

__all__ = ["kind", "to_torch", "from_torch", "over_torch", "TF_ALIGN_BYTES"]

TF_ALIGN_BYTES = 64
"""TensorFlow's kernels check that a tensor's buffer starts on a 64-byte boundary (Eigen)."""


def kind(x) -> str:
    """``"torch"``, ``"tensorflow"``, ``"jax"``, ``"keras"`` (a keras.Variable) or ``"numpy"``."""
    if isinstance(x, torch.Tensor):
        return "torch"
    keras = sys.modules.get("keras")
    if keras is not None and isinstance(x, keras.Variable):
        return "keras"
    tf = sys.modules.get("tensorflow")
    if tf is not None and isinstance(x, (tf.Tensor, tf.Variable)):
        return "tensorflow"
    jax = sys.modules.get("jax")
    if jax is not None and isinstance(x, jax.Array):
        return "jax"
    return "numpy"


def to_torch(x) -> torch.Tensor:
    """A torch tensor over ``x``'s memory (a copy only for non-contiguous or unsupported inputs)."""
    which = kind(x)
    if which == "torch":
        return x
    if which == "keras":
        return to_torch(x.value)
    if which == "tensorflow":
        tf = sys.modules["tensorflow"]
        if isinstance(x, tf.Variable):
            x = x.read_value()
        if x.dtype == tf.bool:  # DLPack has no bool in TF
            return torch.from_numpy(x.numpy())
        return torch.from_dlpack(tf.experimental.dlpack.to_dlpack(x))
    if which == "jax":
        return torch.from_dlpack(x)
    return torch.as_tensor(np.asarray(x))


def from_torch(t: torch.Tensor, like):
    """``t`` as the same kind of tensor as ``like`` (shares ``t``'s memory where the backend allows)."""
    which = kind(like)
    if which == "keras":
        which = kind(like.value)
    if which == "torch":
        return t
    t = t.detach().contiguous()
    if which == "tensorflow":
        tf = sys.modules["tensorflow"]
        if t.dtype == torch.bool:
            return tf.convert_to_tensor(t.numpy())
        if t.data_ptr() % TF_ALIGN_BYTES:  # a view into a bucket: TF would abort on it
            t = t.clone()
        return tf.experimental.dlpack.from_dlpack(torch.utils.dlpack.to_dlpack(t))
    if which == "jax":
        import jax.dlpack

        return jax.dlpack.from_dlpack(t)
    if isinstance(like, np.ndarray) or np.isscalar(like):
        return t.cpu().numpy() if t.dim() else t.item()
    return t.cpu().numpy()


def over_torch(fn, values, *, same_shape: bool = True):
    """``fn(torch_tensors, align_bytes) -> torch_tensors`` applied to backend tensors; ``None`` passes through.

    Torch tensors go in as they are. TensorFlow tensors cross by DLPack; inside a
    ``tf.function`` the call becomes one ``tf.py_function`` (TensorFlow cannot trace a
    c10d collective), whose outputs keep the inputs' static shapes. ``align_bytes`` tells
    ``fn`` how its outputs must be aligned to come back without a copy. ``same_shape=False``:
    the outputs' first dimension is unknown while tracing (allgather).
    """
    values = list(values)
    tf = sys.modules.get("tensorflow")
    if tf is not None:
        values = [tf.convert_to_tensor(v) if isinstance(v, tf.IndexedSlices) else v for v in values]
    present = [v for v in values if v is not None]
    if not present:
        return values
    which = kind(present[0])
    if which == "torch":
        return fn(values, 0)
    align = TF_ALIGN_BYTES if which == "tensorflow" else 0

    def host(*xs):
        reduced = fn([to_torch(x) for x in xs], align)
        return [from_torch(r, x) for r, x in zip(reduced, xs)]

    if which == "jax":
        jax = sys.modules["jax"]
        if any(isinstance(v, jax.core.Tracer) for v in present):
            return _through_io_callback(fn, values, present, same_shape)
    if which == "tensorflow" and not tf.executing_eagerly():
        outs = tf.py_function(host, present, Tout=[v.dtype for v in present], name="phalanx_collective")
        for o, v in zip(outs, present):
            o.set_shape(v.shape if same_shape else [None] + list(v.shape[1:]))
    else:
        outs = host(*present)
    it = iter(outs)
    return [None if v is None else next(it) for v in values]


def _through_io_callback(fn, values, present, same_shape: bool):
    """``over_torch`` inside ``jax.jit``: one ordered ``io_callback`` (collectives must keep their order)."""
    import warnings

    import jax
    from jax.experimental import io_callback

    if not same_shape:
        raise ValueError("phalanx.keras: allgather inside jax.jit is not supported (its result's shape is not "
                         "known while tracing); call it outside the jitted function")
    shapes = [jax.ShapeDtypeStruct(v.shape, v.dtype) for v in present]

    def host(*xs):
        with warnings.catch_warnings():  # JAX hands read-only arrays; the collectives never write to them
            warnings.simplefilter("ignore", UserWarning)
            tensors = [torch.from_numpy(np.asarray(x)) for x in xs]
        reduced = fn(tensors, 0)
        return [np.asarray(r.detach().cpu().numpy(), dtype=s.dtype) for r, s in zip(reduced, shapes)]

    outs = io_callback(host, shapes, *present, ordered=True)
    it = iter(outs)
    return [None if v is None else next(it) for v in values]
