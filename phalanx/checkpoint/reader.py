"""Loading a checkpoint: each rank reads its view (at any world size), verified, straight into place.

A loading rank reads the skeleton of the saved rank with its own number (rank 0's
when the job grew), then fetches each tensor from the file the manifest names.
A tensor the loader holds as a :class:`Shard` is assembled from every saved piece
that overlaps it (resharding); a gathered piece (ZeRO's optimizer) gets every saved
rank's part and reshards itself. Module parameters and buffers are read from the
file straight into their storage. Every file is checked against the manifest's
checksum before anything read from it is used.

Example::

    tree = read_state("ckpts/step-000000120", state)   # verified, not yet applied
    apply_state(state, tree)                           # into modules, optimizers, …
"""

from __future__ import annotations

import os
import zlib
from typing import Any

import torch

from phalanx.checkpoint import io
from phalanx.checkpoint._tree import Shard, copy_overlap, decode, path_str
from phalanx.checkpoint.manifest import read_manifest
from phalanx.checkpoint.pieces import is_gathered, is_stateful, job_of, to_tree

__all__ = ["Reader", "SharedFileError", "read_state", "apply_state", "read_meta", "shared_files", "checker_of"]


class SharedFileError(io.CorruptCheckpointError):
    """A file that every loading rank reads failed the check this rank ran for all of them."""


class Reader:
    """Reads (and checksums) each file of one checkpoint at most once.

    ``unchecked``: files this rank reads without hashing them, because another rank
    checks them for everyone (see :func:`read_state`).
    """

    def __init__(self, path: str, manifest: dict, into: dict[str, dict[str, torch.Tensor]] | None = None,
                 unchecked: frozenset[str] = frozenset()) -> None:
        self.path, self.manifest, self.cache, self.into = path, manifest, {}, into or {}
        self.unchecked = unchecked

    def file(self, name: str) -> dict[str, torch.Tensor]:
        """Every tensor of file ``name`` (verified, unless another rank verifies it), by its name in the file."""
        if name not in self.cache:
            info = self.manifest["files"][name]
            self.cache[name] = io.read_tensors(os.path.join(self.path, name),
                                               checksum=None if name in self.unchecked else info["checksum"],
                                               into=self.into.get(name))
        return self.cache[name]

    def tensor(self, rec: dict) -> torch.Tensor:
        """The tensor a manifest record points at."""
        got = self.file(rec["file"]).get(rec["name"])
        if got is None:
            raise io.CorruptCheckpointError(f"checkpoint {self.path}: {rec['file']} has no tensor "
                                            f"{rec['name']!r} (for '{rec['path']}')")
        return got

    def tensors(self, r: int) -> dict[str, torch.Tensor]:
        """Saved rank ``r``'s tensors, by their ids in its skeleton."""
        return {tid: self.tensor(rec) for tid, rec in self.manifest["ranks"][r]["tensors"].items()}

    def pieces(self, pstr: str):
        """Every saved (rank, record) at this tree path."""
        for r, entry in enumerate(self.manifest["ranks"]):
            for rec in entry["tensors"].values():
                if rec["path"] == pstr:
                    yield r, rec

    def assemble(self, pstr: str, shape, offsets, dtype) -> torch.Tensor:
        """A tensor of ``shape`` at ``offsets`` of the global tensor at ``pstr``, from every overlapping piece."""
        dst = torch.empty(shape, dtype=dtype)
        covered = torch.zeros(shape, dtype=torch.bool)
        for _, rec in self.pieces(pstr):
            src_off = rec.get("offsets", [0] * len(rec["shape"]))
            if not _overlaps(shape, offsets, rec["shape"], src_off):
                continue  # do not even read that file
            copy_overlap(dst, offsets, self.tensor(rec), src_off)
            copy_overlap(covered, offsets, torch.ones((), dtype=torch.bool).expand(rec["shape"]), src_off)
        if not bool(covered.all()):
            raise io.CorruptCheckpointError(
                f"checkpoint {self.path}: the saved pieces of '{pstr}' do not cover the region at offsets "
                f"{list(offsets)} of shape {list(shape)}")
        return dst


def _overlaps(a_shape, a_off, b_shape, b_off) -> bool:
    return all(max(ao, bo) < min(ao + an, bo + bn) for an, ao, bn, bo in zip(a_shape, a_off, b_shape, b_off))


def read_meta(path: str, manifest: dict, r: int) -> dict:
    """Saved rank ``r``'s skeleton file, verified."""
    entry = manifest["ranks"][r]
    info = io.read_json(os.path.join(path, entry["meta_file"]), checksum=entry["meta_checksum"])
    if not isinstance(info, dict) or not isinstance(info.get("skeleton"), dict):
        raise io.CorruptCheckpointError(f"checkpoint {path}: {entry['meta_file']} holds no skeleton")
    return info


def _nodes(tree: Any, keep, path: tuple = (), out: dict | None = None) -> dict[str, Any]:
    """tree path -> node, for every node of ``tree`` that ``keep(node)`` accepts (not looking inside it)."""
    out = {} if out is None else out
    if keep(tree):
        out[path_str(path)] = tree
    elif isinstance(tree, dict):
        for k, v in tree.items():
            _nodes(v, keep, path + (k,), out)
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            _nodes(v, keep, path + (i,), out)
    return out


def _template_shards(tree: Any) -> dict[str, Shard]:
    return _nodes(tree, lambda node: isinstance(node, Shard))


def _live_devices(tree: Any) -> dict[str, torch.device]:
    """tree path -> the device of the live tensor (or Shard) there: where its loaded value goes."""
    live = _nodes(tree, lambda node: isinstance(node, (Shard, torch.Tensor)))
    return {p: (n.tensor if isinstance(n, Shard) else n).device for p, n in live.items()}


def _same_piece(rec: dict, want: Shard) -> bool:
    """Whether saved record ``rec`` is exactly the piece the Shard ``want`` asks for (no resharding)."""
    return (rec.get("offsets") == list(want.offsets) and rec.get("global_shape") == list(want.global_shape)
            and rec["shape"] == list(want.tensor.shape) and rec["dtype"] == str(want.tensor.dtype).replace("torch.", ""))


def _in_place(t: torch.Tensor) -> bool:
    # the storage really holds the tensor (ZeRO-3 frees parameter storage between uses)
    return (t.device.type == "cpu" and t.is_contiguous()
            and t.untyped_storage().nbytes() >= (t.storage_offset() + t.numel()) * t.element_size())


def _destinations(tree: Any, records: dict[str, dict]) -> dict[str, dict[str, torch.Tensor]]:
    """file -> {name in file -> the live CPU tensor at the same tree path, same shape and dtype}.

    Module state dicts hold the parameters' own storage, so their bytes can be read
    from the file straight into the model: one pass, no intermediate copy. A Shard the
    loader holds at the same offsets as a saved piece (same world size, same split) is
    read straight into its tensor too.
    """
    live: dict[str, torch.Tensor | None] = {}

    def walk(node: Any, path: tuple) -> None:
        if isinstance(node, torch.Tensor):
            key = path_str(path)
            live[key] = None if key in live else node  # two nodes print the same path: ambiguous, skip
        elif isinstance(node, dict):
            for k, v in node.items():
                walk(v, path + (k,))
        elif isinstance(node, (list, tuple)):
            for i, v in enumerate(node):
                walk(v, path + (i,))

    walk(tree, ())
    shards = _template_shards(tree)
    out: dict[str, dict[str, torch.Tensor]] = {}
    for rec in records.values():
        if "offsets" in rec:
            want = shards.get(rec["path"])
            if want is not None and _same_piece(rec, want) and _in_place(want.tensor):
                out.setdefault(rec["file"], {})[rec["name"]] = want.tensor
            continue
        t = live.get(rec["path"])
        if (t is not None and list(t.shape) == rec["shape"]
                and str(t.dtype).replace("torch.", "") == rec["dtype"] and _in_place(t)):
            out.setdefault(rec["file"], {})[rec["name"]] = t
    return out


def shared_files(manifest: dict) -> list[str]:
    """Files every saved rank's view names for a whole tensor: every loading rank reads them all.

    Replicated state (the data-parallel model and optimizer) sits in such files, and at
    N ranks each of them would otherwise be hashed N times over the same bytes.
    """
    views = [{rec["file"] for rec in e["tensors"].values() if "offsets" not in rec} for e in manifest["ranks"]]
    return sorted(set.intersection(*views)) if views else []


def checker_of(name: str, world: int) -> int:
    """The loading rank that verifies shared file ``name`` for all (spread by name, the same on every rank)."""
    return zlib.crc32(name.encode()) % world


def read_state(path: str, state: dict, *, topology=None, share_checks: bool = False) -> dict:
    """Read this rank's view of checkpoint ``path`` into a tree shaped like ``state`` (not applied yet).

    Plain tensors whose place in ``state`` holds a CPU tensor of the same shape and
    dtype (model parameters and buffers) are read straight into it; everything else
    is applied by :func:`apply_state`. Every file is verified against the manifest;
    anything malformed raises :class:`~phalanx.checkpoint.io.CorruptCheckpointError`.

    ``share_checks`` (every rank calls this; the caller then agrees on the outcome, as
    ``load`` and ``load_latest`` do with an allgather of the errors): a file every rank
    reads (:func:`shared_files`) is hashed by one rank only, :func:`checker_of` it, which
    reads it even if its own view does not need it; a mismatch there raises
    :class:`SharedFileError`, which the agreement turns into an error on every rank.
    """
    job = job_of(topology)
    manifest = read_manifest(path)
    saved_world = manifest["world_size"]
    src = job.rank if job.rank < saved_world else 0
    records = manifest["ranks"][src]["tensors"]
    info = read_meta(path, manifest, src)
    tree = to_tree(state)
    shared = shared_files(manifest) if share_checks and job.world > 1 else []
    mine = [f for f in shared if checker_of(f, job.world) == job.rank]
    reader = Reader(path, manifest, into=_destinations(tree, records),
                    unchecked=frozenset(shared) - frozenset(mine))
    for name in mine:  # first: its bytes go in place below without a second read
        try:
            reader.file(name)
        except io.CorruptCheckpointError as err:
            raise SharedFileError(str(err)) from err
    template = _template_shards(tree)
    # A value goes back to the device its live tensor is on (a CUDA Shard or tensor in the state
    # came back on the CPU, and the first step mixed devices); an optimizer's ``step`` stays on the
    # CPU, as torch keeps it.
    devices = _live_devices(tree)

    def fetch(tid: str, node: dict, path_: tuple):
        value = _fetch(tid, node, path_)
        device = devices.get(path_str(path_))
        if device is None or device.type == "cpu":
            return value
        if isinstance(value, Shard):
            return Shard(value.tensor.to(device), value.global_shape, value.offsets)
        return value.to(device) if isinstance(value, torch.Tensor) else value

    def _fetch(tid: str, node: dict, path_: tuple):
        rec = records.get(tid)
        if rec is None:
            raise io.CorruptCheckpointError(f"checkpoint {path}: rank {src}'s skeleton names tensor {tid!r}, "
                                            "which its manifest entry does not list")
        pstr = path_str(path_)
        want = template.get(pstr)
        if want is not None and _same_piece(rec, want):  # saved as wanted: one file, no copy
            return Shard(reader.tensor(rec), want.global_shape, want.offsets)
        if want is not None:  # the loader wants another piece: reshard from every overlapping file
            t = reader.assemble(pstr, tuple(want.tensor.shape), want.offsets, want.tensor.dtype)
            return Shard(t, want.global_shape, want.offsets)
        if "__shard__" in node:  # saved split, wanted whole: gather the full tensor
            shape = node["global_shape"]
            return reader.assemble(pstr, shape, [0] * len(shape), getattr(torch, rec["dtype"]))
        return reader.tensor(rec)

    try:
        out = decode(info["skeleton"], fetch)
        for k, v in state.items():
            if is_gathered(v) and k in out:  # every saved rank's piece: the object reshards itself
                out[k] = [_piece_of_rank(path, manifest, reader, r, k) for r in range(saved_world)]
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as err:
        raise io.CorruptCheckpointError(f"checkpoint {path}: rank {src}'s skeleton is malformed "
                                        f"({type(err).__name__}: {err})") from err
    return out


def _piece_of_rank(path: str, manifest: dict, reader: Reader, r: int, key: str):
    """Saved rank ``r``'s subtree ``key`` (its own tensors only)."""
    records = manifest["ranks"][r]["tensors"]
    for k, v in read_meta(path, manifest, r)["skeleton"]["__d__"]:
        if decode(k, None) == key:
            return decode(v, lambda tid, node, p: reader.tensor(records[tid]), (key,))
    raise io.CorruptCheckpointError(f"checkpoint {path}: rank {r}'s file has no piece '{key}'")


def apply_state(state: dict, tree: dict) -> None:
    """Put a tree from :func:`read_state` into ``state``: load_state_dict, copy_ or replace, per piece."""
    for k, v in state.items():
        if k not in tree:
            raise KeyError(f"checkpoint has no piece '{k}' (it has {sorted(map(str, tree))}); "
                           "remove it from the state or load a checkpoint that has it")
        if is_gathered(v):
            v.load_sharded_state_dict(tree[k])
        elif is_stateful(v):
            v.load_state_dict(tree[k])
        elif isinstance(v, torch.Tensor):
            with torch.no_grad():
                v.copy_(tree[k])
        else:
            state[k] = tree[k]
