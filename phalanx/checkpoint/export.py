"""One plain, consolidated state dict from a sharded checkpoint: a single safetensors file any tool reads.

Every tensor of the chosen piece is written whole, under its state-dict key:
replicated tensors once, tensors saved as :class:`Shard` pieces reassembled to
their global shape. Runs in one process, no ranks needed, at any saved world size.

Example::

    from phalanx import checkpoint
    checkpoint.export("ckpts/step-000000120", "model.safetensors")       # the piece "model"
    model.load_state_dict(safetensors.torch.load_file("model.safetensors"))

or from a shell: ``phalanx checkpoint export ckpts/step-000000120 model.safetensors``.
"""

from __future__ import annotations

import os

import torch

from phalanx.checkpoint import io
from phalanx.checkpoint.manager import list_checkpoints
from phalanx.checkpoint.manifest import MANIFEST, read_manifest
from phalanx.checkpoint.plan import piece_of
from phalanx.checkpoint.reader import Reader, read_meta

__all__ = ["export", "ExportError"]


class ExportError(ValueError):
    """The checkpoint cannot be exported as asked (no such piece, a piece that is not tensors)."""


def _resolve(path: str) -> str:
    """``path`` itself when it is a checkpoint, else the newest complete one under it."""
    if os.path.exists(os.path.join(path, MANIFEST)):
        return path
    if not os.path.isdir(path):
        raise ExportError(f"{path}: no such checkpoint directory")
    found = list_checkpoints(path)
    if not found:
        raise ExportError(f"{path}: not a checkpoint (no {MANIFEST}) and holds no complete checkpoint")
    return found[0]


def export(path: str, out_path: str, *, piece: str | None = "model", fsync: bool = True) -> dict[str, list[int]]:
    """Write the tensors of ``piece`` in checkpoint ``path`` (or the newest under it) to one safetensors file.

    Keys are the piece's own names (a module's state-dict keys), so the file loads into a
    fresh model. ``piece=None`` exports every piece, keys prefixed ``"<piece>/"``.
    Returns ``{key: shape}`` of what was written. Values that are not tensors (a
    step counter, a sampler position) are not part of a state dict and are left out;
    a ZeRO optimizer's sharded state is refused (use ``ZeroOptimizer.full_state_dict``).
    """
    path = _resolve(path)
    manifest = read_manifest(path)
    reader = Reader(path, manifest)
    skeleton = read_meta(path, manifest, 0)["skeleton"]
    pieces = {str(k): v for k, v in skeleton.get("__d__", [])}
    if piece is not None and piece not in pieces:
        raise ExportError(f"checkpoint {path} has no piece {piece!r}; it has {sorted(pieces)} "
                          "(choose one with --piece, or --all)")
    for name, node in pieces.items():
        if (piece is None or name == piece) and isinstance(node, dict) and "__d__" in node and any(
                k == "format" and isinstance(v, str) and v.startswith("phalanx.zero") for k, v in node["__d__"]):
            raise ExportError(f"piece {name!r} is a ZeRO optimizer's sharded state; consolidate it with "
                              "ZeroOptimizer.full_state_dict() instead")
    out: dict[str, torch.Tensor] = {}
    seen: set[str] = set()
    for r in range(manifest["world_size"]):  # rank 0's view first; Shards from every rank
        for rec in manifest["ranks"][r]["tensors"].values():
            name, inner = piece_of(rec["path"])
            if (piece is not None and name != piece) or rec["path"] in seen:
                continue
            seen.add(rec["path"])
            key = inner if piece is not None else rec["path"]
            if "offsets" in rec:
                shape = rec["global_shape"]
                out[key] = reader.assemble(rec["path"], shape, [0] * len(shape), getattr(torch, rec["dtype"]))
            else:
                out[key] = reader.tensor(rec)
        if r == 0 and piece is not None and not any("offsets" in rec for e in manifest["ranks"]
                                                    for rec in e["tensors"].values()):
            break  # nothing sharded: rank 0's view is the whole piece
    if not out:
        raise ExportError(f"piece {piece!r} of checkpoint {path} holds no tensors")
    io.write_tensors(out_path, {k: t.contiguous() for k, t in out.items()}, fmt="safetensors", fsync=fsync)
    return {k: list(t.shape) for k, t in out.items()}
