"""Sharded checkpoints: every rank writes its own file in parallel; the manifest is written last.

Layout of one checkpoint directory (N = world size at save time)::

    step-000000120/
      rank00000.safetensors   rank 0's tensors (torch.save + weights_only load without safetensors)
      rank00000.json          rank 0's skeleton: the tree structure, plain values, tensor records
      ...                     one pair per rank, written concurrently
      manifest.json           written by rank 0 only after every rank's pair exists: world size,
                              format, checksum of every file, shape/dtype/sharding of every tensor

A checkpoint without ``manifest.json`` is incomplete and is never loaded, so a
crash at any point of a save leaves the previous checkpoint as the newest
loadable one. Loading checks every file it reads against the manifest's checksum (CRC-32 by
default, sha256 with ``PHALANX_CHECKPOINT_CHECKSUM=sha256``; see :mod:`phalanx.checkpoint.io`).

Resharding: a tensor split across ranks is saved as a :class:`Shard` (local
piece + global shape + offsets). A loader at another world size passes a state
whose Shards have the new offsets; each is filled from every saved piece that
overlaps it. Other values (replicated model weights, per-rank RNG) come from
the same rank's file, or rank 0's for ranks that did not exist at save time.

Example::

    state = {"model": model, "optim": opt, "sched": sched, "rng": RNGState(), "step": step}
    ckpt.save(f"ckpts/step-{step:09d}", state, async_=True)   # returns after the CPU copy
    ...
    ckpt.load_latest("ckpts", state)                          # newest intact one (manager.py)
"""

from __future__ import annotations

import os
import time
import uuid
from typing import Any

import torch

from phalanx.checkpoint import io
from phalanx.checkpoint._tree import Shard, _path_str, copy_overlap, decode, encode
from phalanx.checkpoint.async_save import default_writer
from phalanx.log import get_logger

__all__ = ["save", "load", "read_manifest", "wait", "RNGState", "MANIFEST"]

log = get_logger(__name__)
MANIFEST = "manifest.json"
_staging: dict = {}  # CPU snapshot buffers of the last async save, reused by the next one
_VERSION = 2  # 2: "algo:hex" checksums (1: bare sha256 hex, still read)


def _world() -> tuple[int, int]:
    from phalanx import runtime

    if runtime.is_initialized():
        return runtime.rank(), runtime.size()
    return 0, 1


def _timeout_s() -> float:
    return float(os.environ.get("PHALANX_TIMEOUT", "300"))


def _is_gathered(v: Any) -> bool:
    """A piece whose state is split across ranks in its own format (ZeRO's optimizer): it saves
    ``sharded_state_dict()`` per rank and loads from every saved rank's at once, at any world size."""
    return hasattr(v, "sharded_state_dict") and hasattr(v, "load_sharded_state_dict")


def _is_stateful(v: Any) -> bool:
    return hasattr(v, "state_dict") and hasattr(v, "load_state_dict") and not isinstance(v, torch.Tensor)


def _to_tree(state: dict) -> dict:
    if not isinstance(state, dict):
        raise TypeError(f"checkpoint state must be a dict of name -> piece, got {type(state).__name__}")
    return {k: (v.sharded_state_dict() if _is_gathered(v) else v.state_dict() if _is_stateful(v) else v)
            for k, v in state.items()}


class RNGState:
    """Every random generator of this process as one state piece: torch CPU (and CUDA), Python, numpy.

    Example::

        state = {"rng": RNGState(), ...}; ckpt.save(path, state)   # later load() restores the streams
    """

    def state_dict(self) -> dict:
        import random

        import numpy as np

        out = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            out["cuda"] = torch.cuda.get_rng_state_all()
        return out

    def load_state_dict(self, sd: dict) -> None:
        import random

        import numpy as np

        torch.set_rng_state(sd["torch"])
        random.setstate(sd["python"])
        np.random.set_state(sd["numpy"])
        if "cuda" in sd and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(sd["cuda"])


# ----------------------------------------------------------------------------- save


def _rank_files(rank: int, fmt: str) -> tuple[str, str]:
    ext = "safetensors" if fmt == "safetensors" else "pt"
    return f"rank{rank:05d}.{ext}", f"rank{rank:05d}.json"


def _write_rank(path: str, rank: int, world: int, nonce: str, skeleton, tensors, records, fmt: str,
                meta: dict, fsync: bool) -> None:
    tfile, mfile = _rank_files(rank, fmt)
    digest = io.write_tensors(os.path.join(path, tfile), tensors, fmt=fmt, fsync=fsync)
    _test_hook("after_tensors", rank)
    io.write_json(os.path.join(path, mfile), {
        "nonce": nonce, "rank": rank, "world_size": world, "format": fmt, "tensor_file": tfile,
        "tensor_checksum": digest, "records": records, "skeleton": skeleton, "meta": meta}, fsync=fsync)
    if rank == 0:
        _write_manifest(path, world, nonce, fmt, meta, fsync)


def _write_manifest(path: str, world: int, nonce: str, fmt: str, meta: dict, fsync: bool) -> None:
    """Rank 0: wait until every rank's files of this save exist, then write the manifest (last)."""
    deadline = time.monotonic() + _timeout_s()
    ranks = []
    for r in range(world):
        _, mfile = _rank_files(r, fmt)
        mpath = os.path.join(path, mfile)
        while True:
            try:
                info = io.read_json(mpath)
                if info.get("nonce") == nonce:
                    break
            except (io.CorruptCheckpointError, OSError):
                pass  # not written yet (or an older attempt's file): keep polling
            if time.monotonic() > deadline:
                raise TimeoutError(f"checkpoint {path}: rank {r} did not write its shard within "
                                   f"{_timeout_s():.0f}s (PHALANX_TIMEOUT); the manifest was not written, "
                                   "so the previous checkpoint stays the newest")
            time.sleep(0.005)
        ranks.append({"tensor_file": info["tensor_file"], "tensor_checksum": info["tensor_checksum"],
                      "meta_file": mfile, "meta_checksum": io.checksum_file(mpath), "tensors": info["records"]})
    _test_hook("before_manifest", 0)
    io.write_json(os.path.join(path, MANIFEST), {
        "version": _VERSION, "nonce": nonce, "world_size": world, "format": fmt,
        "created": time.time(), "meta": meta, "ranks": ranks}, fsync=fsync)


def _test_hook(where: str, rank: int) -> None:
    # Tests kill the process here to prove a crash mid-save is harmless.
    if os.environ.get("PHALANX_CKPT_CRASH") == f"{where}:{rank}":
        os.kill(os.getpid(), 9)


_save_ids: dict = {}


def _next_save_id(world: int) -> str:
    """The same fresh id on every rank, without a collective per save.

    A random token is broadcast once per process group; then every rank counts
    its saves (all ranks call save() in the same order). A rank file left by a
    crashed earlier process carries another token, so rank 0 never takes it.
    """
    from phalanx import runtime

    topo = runtime.topology() if runtime.is_initialized() else None
    entry = _save_ids.get("current")
    if entry is None or entry[0] is not topo:  # identity (a strong ref: no id reuse) of this init()
        token = uuid.uuid4().hex
        if world > 1:
            from phalanx.comm.collectives import broadcast_object

            token = broadcast_object(token, root_rank=0)
        entry = _save_ids["current"] = [topo, token, 0]
    entry[2] += 1
    return f"{entry[1]}-{entry[2]}"


def save(path: str, state: dict, *, async_: bool = False, meta: dict | None = None,
         fsync: bool = True, on_done=None) -> None:
    """Save ``state`` (name -> module/optimizer/…/tensor/plain value) to directory ``path``.

    Every rank calls it. ``async_=True`` returns once the state is copied to CPU
    memory; the files are written on a background thread (at most one save in
    flight; an error is raised by the next ``save``/``wait``). ``meta`` is a small
    JSON dict stored in the manifest (e.g. ``{"step": 120}``). ``on_done`` runs on
    rank 0 after the manifest is written (used to prune old checkpoints).
    """
    writer = default_writer()
    writer.wait()  # at most one in flight; raises the previous save's error here
    rank, world = _world()
    if os.path.exists(os.path.join(path, MANIFEST)):
        raise FileExistsError(f"checkpoint {path} already exists and is complete; save each step to a "
                              "new directory (CheckpointManager does) or delete it first")
    nonce = _next_save_id(world)
    tensors: dict[str, torch.Tensor] = {}
    records: dict[str, dict] = {}
    # the previous save is done (waited above), so its snapshot buffers can be reused
    skeleton = encode(_to_tree(state), tensors, records, copy=async_, staging=_staging if async_ else None)
    fmt = io.tensor_format(tensors)
    meta = dict(meta or {})
    os.makedirs(path, exist_ok=True)

    def write() -> None:
        _write_rank(path, rank, world, nonce, skeleton, tensors, records, fmt, meta, fsync)
        if rank == 0 and on_done is not None:
            on_done()

    if async_:
        writer.submit(write, what=path)
        return
    write()
    if world > 1:
        from phalanx.comm.collectives import barrier

        barrier()  # a sync save returns on every rank only when the manifest exists


def wait() -> None:
    """Block until the asynchronous save in flight is complete on every rank (manifest included).

    Every rank calls it (it ends with a barrier when the world is larger than one);
    raises :class:`CheckpointWriteError` if this rank's write failed.
    """
    default_writer().wait()
    _, world = _world()
    if world > 1:
        from phalanx.comm.collectives import barrier

        barrier()  # rank 0 returns from its wait only after writing the manifest


# ----------------------------------------------------------------------------- load


def _template_shards(tree: Any, path: tuple = (), out: dict | None = None) -> dict[str, Shard]:
    out = {} if out is None else out
    if isinstance(tree, Shard):
        out[_path_str(path)] = tree
    elif isinstance(tree, dict):
        for k, v in tree.items():
            _template_shards(v, path + (k,), out)
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            _template_shards(v, path + (i,), out)
    return out


class _Reader:
    """Reads (and checksums) each rank file of one checkpoint at most once."""

    def __init__(self, path: str, manifest: dict, into: dict[int, dict[str, torch.Tensor]] | None = None) -> None:
        self.path, self.manifest, self.cache, self.into = path, manifest, {}, into or {}

    def tensors(self, r: int) -> dict[str, torch.Tensor]:
        if r not in self.cache:
            entry = self.manifest["ranks"][r]
            self.cache[r] = io.read_tensors(os.path.join(self.path, entry["tensor_file"]),
                                            checksum=_checksum(entry, "tensor"), into=self.into.get(r))
        return self.cache[r]

    def pieces(self, pstr: str):
        """Every saved (rank, name, record) at this tree path."""
        for r, entry in enumerate(self.manifest["ranks"]):
            for name, rec in entry["tensors"].items():
                if rec["path"] == pstr:
                    yield r, name, rec

    def assemble(self, pstr: str, shape, offsets, dtype) -> torch.Tensor:
        """A tensor of ``shape`` at ``offsets`` of the global tensor at ``pstr``, from every overlapping piece."""
        dst = torch.empty(shape, dtype=dtype)
        covered = torch.zeros(shape, dtype=torch.bool)
        for r, name, rec in self.pieces(pstr):
            src_off = rec.get("offsets", [0] * len(rec["shape"]))
            if not _overlaps(shape, offsets, rec["shape"], src_off):
                continue  # do not even read that rank's file
            copy_overlap(dst, offsets, self.tensors(r)[name], src_off)
            copy_overlap(covered, offsets, torch.ones((), dtype=torch.bool).expand(rec["shape"]), src_off)
        if not bool(covered.all()):
            raise io.CorruptCheckpointError(
                f"checkpoint {self.path}: the saved pieces of '{pstr}' do not cover the region at offsets "
                f"{list(offsets)} of shape {list(shape)}")
        return dst


def _overlaps(a_shape, a_off, b_shape, b_off) -> bool:
    return all(max(ao, bo) < min(ao + an, bo + bn) for an, ao, bn, bo in zip(a_shape, a_off, b_shape, b_off))


def _checksum(entry: dict, kind: str) -> str:
    """``"algo:hex"`` of a manifest entry's tensor or meta file (version 1 stored bare sha256 hex)."""
    if f"{kind}_checksum" in entry:
        return entry[f"{kind}_checksum"]
    return "sha256:" + entry[f"{kind}_sha256"]


def read_manifest(path: str) -> dict:
    mpath = os.path.join(path, MANIFEST)
    if not os.path.exists(mpath):
        raise io.CorruptCheckpointError(f"checkpoint {path} has no {MANIFEST}: it is incomplete "
                                        "(a save was interrupted) or not a phalanx checkpoint")
    manifest = io.read_json(mpath)
    if manifest.get("version") not in (1, _VERSION):
        raise io.CorruptCheckpointError(f"checkpoint {path}: manifest version {manifest.get('version')} "
                                        f"is not the supported {_VERSION}")
    return manifest


def _destinations(tree: Any, records: dict[str, dict]) -> dict[str, torch.Tensor]:
    """Saved tensor name -> the live CPU tensor at the same tree path, same shape and dtype.

    Module state dicts hold the parameters' own storage, so their bytes can be read
    from the file straight into the model: one pass, no intermediate copy.
    """
    live: dict[str, torch.Tensor | None] = {}

    def walk(node: Any, path: tuple) -> None:
        if isinstance(node, torch.Tensor):
            key = _path_str(path)
            live[key] = None if key in live else node  # two nodes print the same path: ambiguous, skip
        elif isinstance(node, dict):
            for k, v in node.items():
                walk(v, path + (k,))
        elif isinstance(node, (list, tuple)):
            for i, v in enumerate(node):
                walk(v, path + (i,))

    walk(tree, ())
    out = {}
    for name, rec in records.items():
        t = live.get(rec["path"])
        if (t is not None and "offsets" not in rec and t.device.type == "cpu" and t.is_contiguous()
                and list(t.shape) == rec["shape"] and str(t.dtype).replace("torch.", "") == rec["dtype"]
                # the storage really holds the tensor (ZeRO-3 frees parameter storage between uses)
                and t.untyped_storage().nbytes() >= (t.storage_offset() + t.numel()) * t.element_size()):
            out[name] = t
    return out


def _read(path: str, state: dict) -> dict:
    """Read this rank's view of checkpoint ``path`` into a tree shaped like ``state``.

    Plain tensors whose place in ``state`` holds a CPU tensor of the same shape and
    dtype (model parameters and buffers) are read straight into it; everything else
    is applied by :func:`_apply`. Every file is verified against the manifest.
    """
    rank, world = _world()
    manifest = read_manifest(path)
    saved_world = manifest["world_size"]
    src = rank if rank < saved_world else 0
    entry = manifest["ranks"][src]
    info = io.read_json(os.path.join(path, entry["meta_file"]), checksum=_checksum(entry, "meta"))
    tree = _to_tree(state)
    reader = _Reader(path, manifest, into={src: _destinations(tree, entry["tensors"])})
    template = _template_shards(tree)
    dtype_of = {n: getattr(torch, rec["dtype"]) for n, rec in entry["tensors"].items()}

    def fetch(name: str, node: dict, path_: tuple):
        pstr = _path_str(path_)
        want = template.get(pstr)
        if want is not None:  # the loader wants its own piece: reshard from every overlapping file
            t = reader.assemble(pstr, tuple(want.tensor.shape), want.offsets, want.tensor.dtype)
            return Shard(t, want.global_shape, want.offsets)
        if "__shard__" in node:  # saved split, wanted whole: gather the full tensor
            shape = node["global_shape"]
            return reader.assemble(pstr, shape, [0] * len(shape), dtype_of[name])
        return reader.tensors(src)[name]

    out = decode(info["skeleton"], fetch)
    for k, v in state.items():
        if _is_gathered(v) and k in out:  # every saved rank's piece: the object reshards itself
            out[k] = [_piece_of_rank(path, manifest, reader, r, k) for r in range(saved_world)]
    return out


def _piece_of_rank(path: str, manifest: dict, reader: _Reader, r: int, key: str):
    """Saved rank ``r``'s subtree ``key`` (its own tensors only)."""
    entry = manifest["ranks"][r]
    info = io.read_json(os.path.join(path, entry["meta_file"]), checksum=_checksum(entry, "meta"))
    for k, v in info["skeleton"]["__d__"]:
        if decode(k, None) == key:
            return decode(v, lambda name, node, p: reader.tensors(r)[name], (key,))
    raise io.CorruptCheckpointError(f"checkpoint {path}: rank {r}'s file has no piece '{key}'")


def _apply(state: dict, tree: dict) -> None:
    for k, v in state.items():
        if k not in tree:
            raise KeyError(f"checkpoint has no piece '{k}' (it has {sorted(map(str, tree))}); "
                           "remove it from the state or load a checkpoint that has it")
        if _is_gathered(v):
            v.load_sharded_state_dict(tree[k])
        elif _is_stateful(v):
            v.load_state_dict(tree[k])
        elif isinstance(v, torch.Tensor):
            with torch.no_grad():
                v.copy_(tree[k])
        else:
            state[k] = tree[k]


def load(path: str, state: dict) -> dict:
    """Load checkpoint ``path`` into ``state`` in place (modules, optimizers, tensors) and return the tree.

    Plain values (``state["step"]``) are replaced in the dict. Every file read is
    checked against the manifest's checksum; a mismatch raises
    :class:`~phalanx.checkpoint.io.CorruptCheckpointError`. Runs no code from the files.
    """
    wait()
    tree = _read(path, state)
    _apply(state, tree)
    return tree
