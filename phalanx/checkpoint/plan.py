"""Who writes which tensor, into which file, under which name: replicated state is written once.

Every rank describes its tensors (tree path, shape, dtype, where a :class:`Shard`
sits, and a digest of the bytes); rank 0 groups equal descriptions across ranks
and answers each rank with its plan. As in torch.distributed.checkpoint
(``dedup_save_plans``), a tensor that several ranks hold is written by one of them,
the least loaded so far; unlike DCP, "the same" is checked, not assumed from
the name: two ranks share a tensor only when path, shape, dtype and placement agree
and the bytes are equal. Small tensors (up to :data:`EAGER_DIGEST_BYTES`: RNG states,
counters, scalars) carry a digest of their bytes in the description (CRC-32 and
Adler-32, 64 bits), so a per-rank RNG state is never merged. Large ones are merged
by description and checked after the write, off the critical path: every holder
that does not write a file computes the checksum that file must have
(:func:`phalanx.checkpoint.io.content_checksum`) while the writer writes it, and
compares it with the writer's; a holder whose copy differs writes its own
(``rank00001.diverged.safetensors``) and its records point there (see
:mod:`phalanx.checkpoint.sharded`). No extra pass over the bytes before the plan.

Files are named by what they hold, and tensors by their real names, so standard
tools read them::

    model.safetensors            the piece "model", held by every rank: its state-dict keys
                                 ("0.weight", …): model.load_state_dict(load_file(...)) works
    optim.part00001.safetensors  the optimizer's state, held by every rank, spread tensor by tensor
                                 over the ranks (the part a rank writes: "state/0/exp_avg", …), so
                                 the bytes written per rank stay balanced as in DCP
    model.group00001.safetensors a piece held alike by some ranks only (e.g. one pipeline stage's)
    rank00003.safetensors        what only rank 3 holds (its RNG state, its Shards), named by
                                 full path ("rng/torch", "shard")

Example::

    desc = describe(tensors, records)              # on every rank
    plans = make_plans([desc_rank0, desc_rank1])   # on rank 0: one plan per rank
    plans[1]["t0"]                                 # ["model.safetensors", "0.weight", False]: rank 0 writes it
"""

from __future__ import annotations

import re
import zlib

import torch

from phalanx.checkpoint import io

__all__ = ["describe", "make_plans", "piece_of", "file_name_ok", "EAGER_DIGEST_BYTES"]

_SAFE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,99}$")


def file_name_ok(name: object) -> bool:
    """A plain file name inside the checkpoint directory: no separator, no ``..``, not absolute."""
    return (isinstance(name, str) and bool(name) and name not in (".", "..") and "/" not in name
            and "\\" not in name and "\0" not in name and not name.startswith(".."))


EAGER_DIGEST_BYTES = 64 << 10
"""Tensors up to this size are digested before the plan; larger ones are checked after the write.

The digest is on every save's critical path (before the plan, on every rank), the check after the
write is not (a thread beside the rank's own writes), so the bound only has to cover the state that
is per-rank by design and small: RNG states (torch's CPU state is 5,056 bytes, numpy's 2,500,
CUDA's 16 per device), counters, scalars. It was 1 MiB: a 4-rank sharded save of 192 MiB of state
(1 MiB Shards) then spent 90-160 ms per rank digesting 48 MiB, about a third of the save
(``benchmarks/checkpoint_sync_phases.py``, benchmarks/LOG.md ``#ckpt-sync-phases``). A tensor
above the bound that differs between ranks under the same description still ends up on disk as
each rank's own (the check after the write; ``rankNNNNN.diverged.*``), at the cost of that extra file.
"""


def _digest(t: torch.Tensor) -> str:
    data = io.tensor_bytes(t)
    return f"{zlib.crc32(data):08x}{zlib.adler32(data):08x}"


def piece_of(path: str) -> tuple[str, str]:
    """``"model/0.weight"`` -> ``("model", "0.weight")``; a piece that is itself a tensor keeps its name."""
    head, _, rest = path.partition("/")
    return head, (rest or head)


def describe(tensors: dict[str, torch.Tensor], records: dict[str, dict], *, digest: bool) -> dict[str, list]:
    """This rank's tensors for the planner: ``tid -> [path, shape, dtype, placement, digest, nbytes]``.

    The digest is set for tensors of at most :data:`EAGER_DIGEST_BYTES` (``""`` for
    larger ones: checked after the write). ``digest=False`` (a world of one: there is
    nobody to share with) skips hashing.
    """
    out = {}
    for tid, rec in records.items():
        t = tensors[tid]
        place = [rec.get("global_shape"), rec.get("offsets")]
        nbytes = t.numel() * t.element_size()
        out[tid] = [rec["path"], rec["shape"], rec["dtype"], place,
                    _digest(t) if digest and nbytes <= EAGER_DIGEST_BYTES else "", nbytes]
    return out


def _file_stem(piece: str, taken: dict[str, str]) -> str:
    """A file-name stem for ``piece`` that is a plain name and no other piece's (nor a rank file's)."""
    if piece in taken:
        return taken[piece]
    stem = piece if _SAFE.match(piece) and not re.match(r"^(rank\d|manifest)", piece) else f"piece{len(taken)}"
    while stem in taken.values():
        stem += "_"
    taken[piece] = stem
    return stem


def _splittable(key: tuple[str, tuple[int, ...]], entries: list) -> bool:
    """Whether a group's tensors may be spread over its holders, one file part each.

    Only optimizer state (a torch optimizer's ``state/<param>/<name>`` tensors): no standard tool
    loads an optimizer from one safetensors file, so ``optim.part00001.safetensors`` costs nothing,
    and it is the largest piece (Adam: twice the model), the one that would leave a single writer
    busy while the others wait. A model's piece stays one file (``load_file`` gives its state dict).
    """
    return len(key[1]) > 1 and len(entries) > 1 and all(e[1].startswith("state/") for e in entries)


def make_plans(descs: list[dict[str, list]], fmt: str | None = None) -> list[dict[str, list]]:
    """Rank 0: every rank's plan, ``tid -> [file, name in the file, this rank writes it]``.

    ``descs[r]`` is rank r's :func:`describe`. Deterministic: the same descriptions
    always give the same plan. ``fmt`` forces ``"torch"`` files (``.pt``) for all.
    """
    world = len(descs)
    holders: dict[tuple, list[tuple[int, str]]] = {}
    for r, desc in enumerate(descs):
        for tid, (path, shape, dtype, place, dig, _) in desc.items():
            sig = (path, tuple(shape), dtype, repr(place), dig)
            holders.setdefault(sig, []).append((r, tid))
    # (piece, holder ranks) -> [(tid per holder, inner name, nbytes, dtype)]
    groups: dict[tuple[str, tuple[int, ...]], list] = {}
    for held in holders.values():
        r0, t0 = held[0]
        path, _, dtype, _, _, nbytes = descs[r0][t0]
        piece, inner = piece_of(path)
        ranks = tuple(sorted({r for r, _ in held}))
        if len(ranks) < len(held):  # one rank holds the same bytes twice (two paths print alike): keep apart
            for r, tid in held:
                groups.setdefault((piece, (r,)), []).append(({r: tid}, path, descs[r][tid][5], dtype))
            continue
        groups.setdefault((piece, ranks), []).append(({r: tid for r, tid in held}, inner, nbytes, dtype))
    plans: list[dict[str, list]] = [{} for _ in range(world)]
    load = [0] * world
    stems: dict[str, str] = {}
    partial: dict[str, int] = {}
    used: dict[str, set[str]] = {}  # file -> names taken in it (several groups share a rank's own file)
    # biggest groups first, each to its least loaded holder (ties: the lowest rank): the bytes
    # written per rank stay balanced, as in DCP's dedup. Groups of optimizer state (split, below)
    # go last and fill in around the others, tensor by tensor.
    order = sorted(groups.items(), key=lambda kv: (_splittable(kv[0], kv[1]), -sum(e[2] for e in kv[1]),
                                                   kv[0][0], kv[0][1]))
    for (piece, ranks), entries in order:
        split = _splittable((piece, ranks), entries)
        if len(ranks) == 1 and world > 1:
            writer, base, full_names = ranks[0], f"rank{ranks[0]:05d}", True
        else:
            writer = min(ranks, key=lambda r: (load[r], r))
            stem = _file_stem(piece, stems)
            if len(ranks) == world:
                base = stem
            else:
                partial[stem] = partial.get(stem, 0) + 1
                base = f"{stem}.group{partial[stem]:05d}"
            full_names = False
        ext = "pt" if fmt == "torch" or not all(io.safetensors_dtype(e[3]) for e in entries) else "safetensors"
        for tids, name, nbytes, _ in sorted(entries, key=lambda e: -e[2]) if split else entries:
            if split:  # each tensor to the least loaded holder, in that holder's part of the piece
                writer = min(ranks, key=lambda r: (load[r], r))
                fname = f"{base}.part{writer:05d}.{ext}"
            else:
                fname = f"{base}.{ext}"
            taken = used.setdefault(fname, set())
            if full_names:
                name = descs[writer][tids[writer]][0]
            while name in taken:  # two paths that print alike: keep both
                name += "'"
            taken.add(name)
            load[writer] += nbytes
            for r, tid in tids.items():
                plans[r][tid] = [fname, name, r == writer]
    return plans
