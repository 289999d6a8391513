"""Crash-safe sharded checkpoints: parallel per-rank files, manifest last, async save, resharding load.

Example::

    import phalanx.checkpoint as ckpt

    state = {"model": model, "optim": opt, "sched": sched, "scaler": scaler,
             "sampler": sampler, "rng": ckpt.RNGState(), "step": 0}
    mgr = ckpt.CheckpointManager("ckpts", keep=3)
    mgr.load_latest(state)                    # resume if there is something to resume
    for step in range(state["step"], 1000):
        ...
        state["step"] = step + 1
        if (step + 1) % 100 == 0:
            mgr.save(step + 1, state, async_=True)   # blocks only for the CPU copy

Any tool reads the result: pieces every rank holds alike are written once, under their
state-dict keys (``safetensors.torch.load_file("step-…/model.safetensors")`` loads into a
fresh model), and ``export(dir, "model.safetensors")`` / ``phalanx checkpoint export``
writes one consolidated file. See docs/fault_tolerance.md for the layout and what
happens on each failure.
"""

from phalanx.checkpoint._tree import Shard
from phalanx.checkpoint.async_save import AsyncWriter, CheckpointWriteError
from phalanx.checkpoint.experts import ExpertCheckpoint
from phalanx.checkpoint.export import ExportError, export
from phalanx.checkpoint.io import CorruptCheckpointError
from phalanx.checkpoint.manager import CheckpointManager, list_checkpoints, load_latest, resume
from phalanx.checkpoint.manifest import MANIFEST, read_manifest
from phalanx.checkpoint.pieces import RNGState
from phalanx.checkpoint.sharded import load, save, wait

__all__ = [
    "save",
    "load",
    "load_latest",
    "resume",
    "list_checkpoints",
    "read_manifest",
    "wait",
    "Shard",
    "ExpertCheckpoint",
    "RNGState",
    "CheckpointManager",
    "CorruptCheckpointError",
    "CheckpointWriteError",
    "AsyncWriter",
    "MANIFEST",
    "export",
    "ExportError",
]
