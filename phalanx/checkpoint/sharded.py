"""Sharded checkpoints: every rank writes in parallel, replicated state once; the manifest is written last.

Layout of one checkpoint directory (N = world size at save time)::

    step-000000120/
      model.safetensors       a piece every rank holds alike (the data-parallel model), written once,
                              by one rank, under its state-dict keys: load_file() gives a state dict
      optim.part00001.safetensors  the optimizer's state, spread tensor by tensor over the ranks
                              (each writes about its share; the model's piece stays one file)
      rank00001.safetensors   what only rank 1 holds (its RNG state, its Shards), by full path
      rank00001.json          rank 1's skeleton: the tree structure, plain values, tensor records
      ...                     one skeleton per rank, tensor files per writer, written concurrently
      manifest.json           written by rank 0 after every rank reported its files through the
                              job's c10d store: world size, checksum of every file, and where each
                              rank's tensors are (file, name, shape, dtype, sharding)

Who writes what (:mod:`phalanx.checkpoint.plan`): every rank sends rank 0 a description
of its tensors (path, shape, dtype, placement, digest of the bytes) through the store;
tensors equal on several ranks are written by one of them (the least loaded), as
DCP does for replicated state; rank 0 answers each rank with its plan. Large tensors
are merged by description and their bytes checked after the write: the writer
publishes each file's checksum, every other holder compares it with the checksum of
its own copy (computed while it writes its own files) and, if they differ, writes
its copy to ``rankNNNNN.diverged.*`` (nothing is lost, and no hashing pass delays the
plan). Nothing polls the file system. A checkpoint without ``manifest.json`` is incomplete and is never
loaded, so a crash at any point of a save leaves the previous checkpoint as the newest
loadable one. Loading checks every file it reads against the manifest's checksum (XXH3-128 by
default where ``xxhash`` is installed, else CRC-32; ``PHALANX_CHECKPOINT_CHECKSUM`` picks crc32 or
sha256; see :mod:`phalanx.checkpoint.io`).

Resharding: a tensor split across ranks is saved as a :class:`Shard` (local
piece + global shape + offsets). A loader at another world size passes a state
whose Shards have the new offsets; each is filled from every saved piece that
overlaps it. Other values (replicated model weights, per-rank RNG) come from
the same rank's view, or rank 0's for ranks that did not exist at save time.

Example::

    state = {"model": model, "optim": opt, "sched": sched, "rng": RNGState(), "step": step}
    ckpt.save(f"ckpts/step-{step:09d}", state, async_=True)   # returns after the CPU copy
    ...
    ckpt.load_latest("ckpts", state)                          # newest intact one (manager.py)
"""

from __future__ import annotations

import json
import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import torch

from phalanx.checkpoint import io
from phalanx.checkpoint._tree import encode
from phalanx.checkpoint.async_save import default_writer
from phalanx.checkpoint.manifest import MANIFEST, VERSION, meta_file, read_manifest
from phalanx.checkpoint.pieces import Job, RNGState, job_of, to_tree
from phalanx.checkpoint.plan import describe, make_plans
from phalanx.checkpoint.reader import SharedFileError, apply_state, read_state
from phalanx.comm.collectives import allgather_object, barrier, broadcast_object
from phalanx.log import get_logger
from phalanx.settings import CheckpointSettings

__all__ = ["save", "load", "read_manifest", "wait", "RNGState", "MANIFEST"]

log = get_logger(__name__)
_staging: dict = {}  # CPU snapshot buffers of the last async save, reused by the next one


# ----------------------------------------------------------------------------- save


def _plan(path: str, job: Job, store, nonce: str, desc: dict) -> dict:
    """This rank's plan (tid -> [file, name, writes]): rank 0 makes every rank's from their descriptions."""
    fmt = "torch" if CheckpointSettings.one("format") == "torch" else None
    if job.world == 1:
        return make_plans([desc], fmt)[0]
    store.set(f"{nonce}/desc/{job.rank}", json.dumps(desc))
    if job.rank == 0:
        keys = [f"{nonce}/desc/{r}" for r in range(job.world)]
        job.wait_keys(store, keys, f"checkpoint {path}: rank 0 collecting what every rank holds")
        plans = make_plans([json.loads(store.get(k)) for k in keys], fmt)
        for k in keys:
            store.delete_key(k)
        for r, plan in enumerate(plans):
            store.set(f"{nonce}/plan/{r}", json.dumps(plan))
    key = f"{nonce}/plan/{job.rank}"
    job.wait_keys(store, [key], f"checkpoint {path}: rank {job.rank} waiting for rank 0's write plan")
    plan = json.loads(store.get(key))
    store.delete_key(key)
    return plan


def _write_rank(path: str, job: Job, store, nonce: str, skeleton, tensors, records, meta: dict,
                fsync: bool) -> None:
    plan = _plan(path, job, store, nonce, describe(tensors, records, digest=job.world > 1))
    mine: dict[str, dict[str, torch.Tensor]] = {}
    theirs: dict[str, dict[str, str]] = {}  # files another rank writes with tensors this rank holds: name -> tid
    for tid, (fname, name, writes) in plan.items():
        records[tid] = {**records[tid], "file": fname, "name": name}
        if writes:
            mine.setdefault(fname, {})[name] = tensors[tid]
        else:
            theirs.setdefault(fname, {})[name] = tid
    files = {}
    with ThreadPoolExecutor(1) as pool:
        # the checksum each shared file must have if this rank's copy is the one on disk, computed
        # while this rank writes its own files (zlib and hashlib release the GIL)
        expect = {f: pool.submit(io.content_checksum, {n: tensors[t] for n, t in named.items()}, _fmt(f))
                  for f, named in theirs.items()}
        for fname, named in mine.items():
            fpath = os.path.join(path, fname)
            digest = io.write_tensors(fpath, named, fmt=_fmt(fname), fsync=fsync, dir_sync=False)
            files[fname] = {"checksum": digest, "writer": job.rank, "bytes": os.path.getsize(fpath)}
            if job.world > 1:
                content = digest if _fmt(fname) == "safetensors" else io.content_checksum(named, "torch")
                store.set(f"{nonce}/sum/{fname}", content)
        files.update(_check_shared(path, job, store, nonce, tensors, records, theirs, expect, fsync))
    _test_hook("after_tensors", job.rank)
    mfile = meta_file(job.rank)
    mdigest = io.write_json(os.path.join(path, mfile), {
        "nonce": nonce, "rank": job.rank, "world_size": job.world, "records": records, "skeleton": skeleton,
        "meta": meta}, fsync=fsync, dir_sync=False)
    if fsync:  # one directory fsync for this rank's renames, before it reports them (the manifest comes after)
        io.sync_dir(path)
    entry = {"meta_file": mfile, "meta_checksum": mdigest, "tensors": records, "files": files}
    if job.world == 1:
        _write_manifest(path, nonce, 1, meta, [entry], fsync)
        return
    store.set(f"{nonce}/done/{job.rank}", json.dumps(entry))
    if job.rank == 0:
        keys = [f"{nonce}/done/{r}" for r in range(job.world)]
        job.wait_keys(store, keys, f"checkpoint {path}: a rank did not write its files (the manifest was not "
                                   "written, so the previous checkpoint stays the newest)")
        entries = [json.loads(store.get(k)) for k in keys]
        for k in keys:
            store.delete_key(k)
        for e in entries:  # every rank has compared its copies: the writers' checksums are no longer needed
            for fname in e["files"]:
                store.delete_key(f"{nonce}/sum/{fname}")
        _write_manifest(path, nonce, job.world, meta, entries, fsync)


def _fmt(fname: str) -> str:
    return "torch" if fname.endswith(".pt") else "safetensors"


def _check_shared(path: str, job: Job, store, nonce: str, tensors, records, theirs: dict, expect: dict,
                  fsync: bool) -> dict:
    """Compare this rank's copies of the files other ranks wrote with what they wrote.

    The plan merged large tensors by path, shape, dtype and placement; here the bytes
    are checked. A file whose writer's checksum differs from this rank's content
    checksum holds another rank's bytes: this rank writes its own copies of that
    file's tensors to ``rankNNNNN.diverged.*`` and its records point there, so every
    rank loads back exactly what it saved. Returns the files written (for the manifest).
    """
    if not theirs:
        return {}
    keys = [f"{nonce}/sum/{f}" for f in theirs]
    job.wait_keys(store, keys, f"checkpoint {path}: rank {job.rank} waiting for the writers of the files it "
                               "shares with them")
    diverged: dict[str, torch.Tensor] = {}
    for fname, named in theirs.items():
        if store.get(f"{nonce}/sum/{fname}").decode() == expect[fname].result():
            continue
        for tid in named.values():
            diverged[records[tid]["path"]] = tid
        log.info("checkpoint %s: rank %d's copy of %s differs from the one written; saving its own",
                 path, job.rank, fname)
    if not diverged:
        return {}
    named = {p: tensors[tid] for p, tid in diverged.items()}
    fmt = io.tensor_format(named)
    fname = f"rank{job.rank:05d}.diverged.{'pt' if fmt == 'torch' else 'safetensors'}"
    fpath = os.path.join(path, fname)
    digest = io.write_tensors(fpath, named, fmt=fmt, fsync=fsync, dir_sync=False)
    for p, tid in diverged.items():
        records[tid] = {**records[tid], "file": fname, "name": p}
    return {fname: {"checksum": digest, "writer": job.rank, "bytes": os.path.getsize(fpath)}}


def _write_manifest(path: str, nonce: str, world: int, meta: dict, entries: list[dict], fsync: bool) -> None:
    """Rank 0, once every rank reported its files: the manifest (last: it makes the checkpoint complete)."""
    files = {}
    for e in entries:
        files.update(e.pop("files"))
    _test_hook("before_manifest", 0)
    io.write_json(os.path.join(path, MANIFEST), {
        "version": VERSION, "nonce": nonce, "world_size": world, "created": time.time(), "meta": meta,
        "files": files, "ranks": entries}, fsync=fsync)


def _test_hook(where: str, rank: int) -> None:
    # Tests kill the process here to prove a crash mid-save is harmless.
    if CheckpointSettings.one("crash_at") == f"{where}:{rank}":
        os.kill(os.getpid(), 9)


_save_ids: dict = {}


def _next_save_id(job: Job) -> str:
    """The same fresh id on every rank, without a collective per save.

    A random token is broadcast once per topology (per ``init()``); then every rank
    counts its saves (all ranks call save() in the same order). Store keys and rank
    files of a crashed earlier process carry another token, so nobody takes them.
    """
    entry = _save_ids.get("current")
    if entry is None or entry[0] is not job.topology:  # identity (a strong ref: no id reuse) of this topology
        token = uuid.uuid4().hex
        if job.world > 1:
            token = broadcast_object(token, root_rank=0)
        entry = _save_ids["current"] = [job.topology, token, 0]
    entry[2] += 1
    return f"{entry[1]}-{entry[2]}"


def save(path: str, state: dict, *, async_: bool = False, meta: dict | None = None,
         fsync: bool = True, on_done=None, topology=None) -> None:
    """Save ``state`` (name -> module/optimizer/…/tensor/plain value) to directory ``path``.

    Every rank calls it. ``async_=True`` returns once the state is copied to CPU
    memory; the files are written on a background thread (at most one save in
    flight; an error is raised by the next ``save``/``wait``). ``meta`` is a small
    JSON dict stored in the manifest (e.g. ``{"step": 120}``). ``on_done`` runs on
    rank 0 after the manifest is written (used to prune old checkpoints).
    ``topology``: the job's (default: the one ``phalanx.init()`` made, or one process);
    a rank waits at most its ``timeout_s`` for the others.
    """
    writer = default_writer()
    writer.wait()  # at most one in flight; raises the previous save's error here
    job = job_of(topology)
    if os.path.exists(os.path.join(path, MANIFEST)):
        raise FileExistsError(f"checkpoint {path} already exists and is complete; save each step to a "
                              "new directory (CheckpointManager does) or delete it first")
    nonce = _next_save_id(job)
    tensors: dict[str, torch.Tensor] = {}
    records: dict[str, dict] = {}
    # the previous save is done (waited above), so its snapshot buffers can be reused
    skeleton = encode(to_tree(state), tensors, records, copy=async_, staging=_staging if async_ else None)
    meta = dict(meta or {})
    os.makedirs(path, exist_ok=True)
    store = job.store() if job.world > 1 else None

    def write() -> None:
        _write_rank(path, job, store, nonce, skeleton, tensors, records, meta, fsync)
        if job.rank == 0 and on_done is not None:
            on_done()

    if async_:
        writer.submit(write, what=path)
        return
    write()
    if job.world > 1:
        barrier()  # a sync save returns on every rank only when the manifest exists


def wait(*, topology=None) -> None:
    """Block until the asynchronous save in flight is complete on every rank (manifest included).

    Every rank calls it (it ends with a barrier when the world is larger than one);
    raises :class:`CheckpointWriteError` if this rank's write failed.
    """
    default_writer().wait()
    if job_of(topology).world > 1:
        barrier()  # rank 0 returns from its wait only after writing the manifest


# ----------------------------------------------------------------------------- load


def load(path: str, state: dict, *, topology=None) -> dict:
    """Load checkpoint ``path`` into ``state`` in place (modules, optimizers, tensors) and return the tree.

    Plain values (``state["step"]``) are replaced in the dict. Every file read is
    checked against the manifest's checksum; a mismatch or a malformed manifest raises
    :class:`~phalanx.checkpoint.io.CorruptCheckpointError`. Runs no code from the files.
    A file every rank reads (replicated state) is checked by one of them, and the ranks
    agree before anything is applied: a mismatch raises on every rank.
    Reads checkpoints of every version (``t0…tN`` tensor names included).
    """
    wait(topology=topology)
    if job_of(topology).world == 1:
        tree = read_state(path, state, topology=topology)
    else:
        # a file every rank reads is hashed by one of them (read_state's share_checks); they agree here
        try:
            tree, err = read_state(path, state, topology=topology, share_checks=True), None
        except Exception as e:  # every rank reaches the agreement, whatever happened
            tree, err = None, e
        bad = allgather_object(str(err) if isinstance(err, SharedFileError) else None)
        if err is not None:
            raise err
        bad = [b for b in bad if b is not None]
        if bad:
            raise io.CorruptCheckpointError(f"checkpoint {path}: a file every rank reads failed its check on "
                                            f"the rank that checked it: {bad[0]}")
    apply_state(state, tree)
    return tree
