"""The manifest of a checkpoint: read, validated (nothing malformed gets past it), and normalised.

``manifest.json`` (version 3) lists every file and every rank's view::

    {"version": 3, "nonce": "…", "world_size": 4, "created": …, "meta": {"step": 120},
     "files": {"model.safetensors": {"checksum": "crc32:…", "writer": 0, "bytes": 4096}, …},
     "ranks": [{"meta_file": "rank00000.json", "meta_checksum": "crc32:…",
                "tensors": {"t0": {"path": "model/0.weight", "shape": [5, 6], "dtype": "float32",
                                   "file": "model.safetensors", "name": "0.weight"}, …}}, …]}

Versions 1 and 2 (one tensor file per rank, tensors named ``t0…tN``) are still read:
:func:`read_manifest` turns them into the same shape (each record's ``file`` is its
rank's tensor file, ``name`` its ``tN``).

Everything a reader later trusts is checked here: types, one entry per saved rank,
and file names that are plain names inside the checkpoint directory (no ``..``, no
separator, not absolute). A manifest that fails is a :class:`CorruptCheckpointError`,
so ``load_latest`` falls back to the older checkpoint.

Example::

    m = read_manifest("ckpts/step-000000120")
    m["world_size"], sorted(m["files"])
"""

from __future__ import annotations

import os

from phalanx.checkpoint import io
from phalanx.checkpoint.plan import file_name_ok

__all__ = ["MANIFEST", "VERSION", "read_manifest", "validate", "meta_file"]

MANIFEST = "manifest.json"
VERSION = 3  # 3: files named by content, tensors by real name, replicated ones once; 2: "algo:hex" checksums


def meta_file(rank: int) -> str:
    """Rank ``rank``'s skeleton file (tree structure, plain values, tensor records)."""
    return f"rank{rank:05d}.json"


def _checksum(entry: dict, kind: str) -> str:
    """``"algo:hex"`` of a version 1-2 entry's tensor or meta file (version 1 stored bare sha256 hex)."""
    if f"{kind}_checksum" in entry:
        return entry[f"{kind}_checksum"]
    return "sha256:" + entry[f"{kind}_sha256"]


def _fail(path: str, what: str) -> io.CorruptCheckpointError:
    return io.CorruptCheckpointError(f"checkpoint {path}: malformed {MANIFEST}: {what}; "
                                     "load_latest() falls back to an older checkpoint")


def _check_record(path: str, r: int, tid: object, rec: object, files: dict | None) -> None:
    where = f"ranks[{r}].tensors[{tid!r}]"
    if not isinstance(rec, dict):
        raise _fail(path, f"{where} is a {type(rec).__name__}, not an object")
    if not isinstance(rec.get("path"), str) or not isinstance(rec.get("dtype"), str):
        raise _fail(path, f"{where} needs a string 'path' and 'dtype'")
    for key in ("shape",) + (("global_shape", "offsets") if "offsets" in rec or "global_shape" in rec else ()):
        v = rec.get(key)
        if not isinstance(v, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in v):
            raise _fail(path, f"{where}.{key} must be a list of non-negative integers, got {v!r}")
    if "offsets" in rec and not (len(rec["offsets"]) == len(rec["global_shape"]) == len(rec["shape"])):
        raise _fail(path, f"{where}: shape, global_shape and offsets differ in length")
    if files is not None:
        if rec.get("file") not in files or not isinstance(rec.get("name"), str):
            raise _fail(path, f"{where} names file {rec.get('file')!r}, which the manifest does not list")


def validate(manifest: object, path: str) -> dict:
    """Check a parsed manifest's shape; return it normalised to version 3's (see the module docstring)."""
    if not isinstance(manifest, dict):
        raise _fail(path, f"the top level is a {type(manifest).__name__}, not an object")
    version = manifest.get("version")
    if version not in (1, 2, VERSION):
        raise io.CorruptCheckpointError(f"checkpoint {path}: manifest version {version!r} is not one this "
                                        f"phalanx reads (1-{VERSION})")
    world, ranks = manifest.get("world_size"), manifest.get("ranks")
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise _fail(path, f"world_size must be a positive integer, got {world!r}")
    if not isinstance(ranks, list) or len(ranks) != world:
        got = len(ranks) if isinstance(ranks, list) else repr(ranks)
        raise _fail(path, f"'ranks' must list one entry per saved rank ({world}), got {got}")
    if not isinstance(manifest.get("meta", {}), dict):
        raise _fail(path, "'meta' must be an object")
    files = manifest.get("files") if version == VERSION else {}
    if not isinstance(files, dict):
        raise _fail(path, "'files' must be an object of file name -> {checksum}")
    for name, info in files.items():
        if not file_name_ok(name):
            raise _fail(path, f"file name {name!r} is not a plain name inside the checkpoint directory")
        if not isinstance(info, dict) or not isinstance(info.get("checksum"), str):
            raise _fail(path, f"files[{name!r}] needs a string 'checksum'")
    out_ranks = []
    for r, entry in enumerate(ranks):
        if not isinstance(entry, dict):
            raise _fail(path, f"ranks[{r}] is a {type(entry).__name__}, not an object")
        names = [entry.get("meta_file")] + ([entry.get("tensor_file")] if version < VERSION else [])
        for name in names:
            if not file_name_ok(name):
                raise _fail(path, f"ranks[{r}] names file {name!r}, not a plain name inside the checkpoint "
                                  "directory")
        tensors = entry.get("tensors")
        if not isinstance(tensors, dict):
            raise _fail(path, f"ranks[{r}].tensors must be an object")
        try:
            if version < VERSION:  # one file per rank, tensors under their tN names
                files[entry["tensor_file"]] = {"checksum": _checksum(entry, "tensor")}
                tensors = {tid: {**rec, "file": entry["tensor_file"], "name": tid} if isinstance(rec, dict) else rec
                           for tid, rec in tensors.items()}
                meta_checksum = _checksum(entry, "meta")
            else:
                meta_checksum = entry["meta_checksum"]
        except KeyError as err:
            raise _fail(path, f"ranks[{r}] has no {err.args[0]!r}") from None
        if not isinstance(meta_checksum, str):
            raise _fail(path, f"ranks[{r}].meta_checksum must be a string")
        for tid, rec in tensors.items():
            _check_record(path, r, tid, rec, files)
        out_ranks.append({"meta_file": entry["meta_file"], "meta_checksum": meta_checksum, "tensors": tensors})
    return {**manifest, "files": files, "ranks": out_ranks}


def read_manifest(path: str) -> dict:
    """The validated, normalised manifest of checkpoint ``path`` (raises :class:`CorruptCheckpointError`)."""
    mpath = os.path.join(path, MANIFEST)
    if not os.path.exists(mpath):
        raise io.CorruptCheckpointError(f"checkpoint {path} has no {MANIFEST}: it is incomplete "
                                        "(a save was interrupted) or not a phalanx checkpoint")
    return validate(io.read_json(mpath), path)
