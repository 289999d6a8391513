"""A state tree (nested dicts/lists/tuples of tensors and plain values) <-> JSON skeleton + flat tensors.

The skeleton is plain JSON with tags, so reading it can never run code:

    {"__d__": [[key, value], ...]}          dict (keys may be int/str/tuple: optimizer state uses ints)
    {"__t__": [...]}                         tuple
    {"__tensor__": "t3"}                     a tensor, stored under name "t3" in the rank's tensor file
    {"__shard__": "t4", "global_shape": [..], "offsets": [..]}   a piece of a larger tensor
    {"__ndarray__": "t5"}                    a numpy array (numpy's RNG state holds one)
    {"__dtype__": "float32"}                 a torch.dtype
"""

from __future__ import annotations

import ctypes
import dataclasses
from typing import Any

import torch

__all__ = ["Shard", "encode", "decode", "copy_overlap", "path_str", "snapshot_into"]

_PLAIN = (str, int, float, bool, type(None))


@dataclasses.dataclass
class Shard:
    """This rank's piece of a tensor that is split across ranks.

    ``tensor`` is the local piece; it sits at ``offsets`` inside a tensor of
    ``global_shape``. A checkpoint saved by N ranks holding Shards can be loaded
    by M ranks whose templates hold Shards with other offsets: the loader
    copies every overlapping region from the files that hold it.

    Example (ZeRO-style flat split of a length-10 vector over 3 ranks)::

        start = [0, 4, 7][rank]; stop = [4, 7, 10][rank]
        state = {"momentum": Shard(m_flat[start:stop], global_shape=(10,), offsets=(start,))}
    """

    tensor: torch.Tensor
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]

    def __post_init__(self) -> None:
        self.global_shape = tuple(int(s) for s in self.global_shape)
        self.offsets = tuple(int(o) for o in self.offsets)
        if len(self.global_shape) != self.tensor.dim() or len(self.offsets) != self.tensor.dim():
            raise ValueError(f"Shard: global_shape {self.global_shape} and offsets {self.offsets} must "
                             f"have one entry per dimension of the local tensor {tuple(self.tensor.shape)}")
        for d, (o, n, g) in enumerate(zip(self.offsets, self.tensor.shape, self.global_shape)):
            if o < 0 or o + n > g:
                raise ValueError(f"Shard: dimension {d} covers [{o}, {o + n}) outside global size {g}")


def _raw_copyable(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Whether ``src``'s bytes are its values as they are (no lazy conjugate/negation, dense,
    contiguous, on the CPU) and ``dst`` is a buffer of the same layout."""
    return (src.device.type == "cpu" and dst.device.type == "cpu" and src.layout == torch.strided
            and dst.layout == torch.strided and src.dtype == dst.dtype and src.shape == dst.shape
            and src.is_contiguous() and dst.is_contiguous() and not src.is_conj() and not src.is_neg()
            and not dst.is_conj() and not dst.is_neg() and type(src) is torch.Tensor)


def snapshot_into(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """Copy ``src`` into the staging buffer ``dst`` (same shape and dtype); return ``dst``.

    Contiguous CPU tensors are copied with the C library's ``memmove`` (ctypes drops the GIL for
    the call; glibc picks its copy routine for the CPU and the block size): on the 2-core
    benchmark machine it took a median 0.93x the time of ``Tensor.copy_`` for 48 x 4 MiB (21
    interleaved repeats, under the bench lock; 0.89x in a run outside it; benchmarks/LOG.md
    ``#ckpt-handoff-copy``). Anything else (another
    device, a strided view, a lazy conjugate) goes through ``copy_``.
    """
    if _raw_copyable(dst, src):
        n = src.numel() * src.element_size()
        if n:
            ctypes.memmove(dst.data_ptr(), src.data_ptr(), n)
        return dst
    return dst.copy_(src)


def path_str(path: tuple) -> str:
    return "/".join(str(p) for p in path) or "<root>"


def encode(obj: Any, tensors: dict[str, torch.Tensor], records: dict[str, dict], path: tuple = (),
           *, copy: bool = False, staging: dict | None = None) -> Any:
    """Return the JSON skeleton of ``obj``; tensors go into ``tensors`` (detached, on CPU).

    ``records`` receives one entry per tensor: path, shape, dtype and for Shards
    the global shape and offsets (this is what the manifest lists). With
    ``copy=True`` tensors are snapshotted, into the buffers of ``staging`` when
    the previous snapshot had a tensor of the same name, path, shape and dtype
    (copying into memory already mapped is about twice as fast as a fresh clone).
    """

    def put(t: torch.Tensor, extra: dict) -> str:
        name = f"t{len(tensors)}"
        t = t.detach()
        key = (name, path_str(path), tuple(t.shape), t.dtype)
        if copy and staging is not None and key in staging:
            t = snapshot_into(staging[key], t)
        elif copy or t.device.type != "cpu":
            t = t.to("cpu", copy=True)
            if staging is not None:
                staging[key] = t
        tensors[name] = t
        records[name] = {"path": path_str(path), "shape": list(t.shape),
                         "dtype": str(t.dtype).replace("torch.", ""), **extra}
        return name

    if isinstance(obj, Shard):
        name = put(obj.tensor, {"global_shape": list(obj.global_shape), "offsets": list(obj.offsets)})
        return {"__shard__": name, "global_shape": list(obj.global_shape), "offsets": list(obj.offsets)}
    if isinstance(obj, torch.Tensor):
        return {"__tensor__": put(obj, {})}
    if isinstance(obj, torch.dtype):
        return {"__dtype__": str(obj).replace("torch.", "")}
    if isinstance(obj, _PLAIN):
        return obj
    if isinstance(obj, dict):
        return {"__d__": [[encode(k, tensors, records, path), encode(v, tensors, records, path + (k,), copy=copy, staging=staging)]
                          for k, v in obj.items()]}
    if isinstance(obj, list):
        return [encode(v, tensors, records, path + (i,), copy=copy, staging=staging) for i, v in enumerate(obj)]
    if isinstance(obj, tuple):
        return {"__t__": [encode(v, tensors, records, path + (i,), copy=copy, staging=staging) for i, v in enumerate(obj)]}
    try:
        import numpy as np
    except ImportError:  # pragma: no cover
        np = None
    if np is not None and isinstance(obj, np.ndarray):
        return {"__ndarray__": put(torch.from_numpy(obj.copy()), {})}
    if np is not None and isinstance(obj, np.generic):
        return obj.item()
    raise TypeError(f"checkpoint: cannot save the {type(obj).__name__} at '{path_str(path)}'; "
                    "a state may hold tensors, Shards, numbers, strings, None and dicts/lists/tuples "
                    "of them (give objects a state_dict() that returns those)")


def decode(skel: Any, fetch, path: tuple = ()) -> Any:
    """Rebuild the tree; ``fetch(name, skel_node, path)`` returns the tensor (or Shard) for a tensor node."""
    if isinstance(skel, list):
        return [decode(v, fetch, path + (i,)) for i, v in enumerate(skel)]
    if not isinstance(skel, dict):
        return skel
    if "__d__" in skel:
        out = {}
        for k, v in skel["__d__"]:
            key = decode(k, fetch, path)
            out[key] = decode(v, fetch, path + (key,))
        return out
    if "__t__" in skel:
        return tuple(decode(v, fetch, path + (i,)) for i, v in enumerate(skel["__t__"]))
    if "__dtype__" in skel:
        return getattr(torch, skel["__dtype__"])
    if "__ndarray__" in skel:
        return fetch(skel["__ndarray__"], skel, path).numpy()
    if "__tensor__" in skel:
        return fetch(skel["__tensor__"], skel, path)
    if "__shard__" in skel:
        return fetch(skel["__shard__"], skel, path)
    raise ValueError(f"checkpoint skeleton: unknown node at '{path_str(path)}': {sorted(skel)}")


def copy_overlap(dst: torch.Tensor, dst_offsets, src: torch.Tensor, src_offsets) -> int:
    """Copy the region where ``src`` (at ``src_offsets``) and ``dst`` (at ``dst_offsets``) overlap.

    Returns the number of elements copied (0 when they do not overlap).
    """
    dst_idx, src_idx = [], []
    for d_off, d_len, s_off, s_len in zip(dst_offsets, dst.shape, src_offsets, src.shape):
        lo, hi = max(d_off, s_off), min(d_off + d_len, s_off + s_len)
        if hi <= lo:
            return 0
        dst_idx.append(slice(lo - d_off, hi - d_off))
        src_idx.append(slice(lo - s_off, hi - s_off))
    region = dst[tuple(dst_idx)]
    region.copy_(src[tuple(src_idx)])
    return region.numel()
