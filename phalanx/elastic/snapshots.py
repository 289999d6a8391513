"""Rank 0's snapshots of a live-recovering elastic state: one file a commit, written in the background.

``TorchState(recover="live")`` keeps no copy in memory: the survivors of a lost worker go on from
the live state. A file is still wanted for a group restart (every worker lost, a re-form that
fails), every ``snapshot_every``-th commit. The state is replicated (live recovery refuses sharded
pieces), so one rank's copy is the whole state: rank 0 copies it (the only part on the training
thread) and a writer thread (one per Snapshots, started at its first write) writes it, with no
cross-rank wait that a lost peer could hold up, and none of the job's collective checkpoint machinery
(whose saves every rank makes together)::

    commit 30 (rank 0):  pack: every tensor of the tree copied into one flat buffer per (dtype, device),
                         the tree kept as a skeleton of Slots ─ thread: the pickled skeleton, then each
                         buffer's raw bytes (_dump) to
                         commit-000000030.pt.tmp ─ fsync (not under /dev/shm) ─ rename ─ prune to `keep`
    restart:             every rank reads the newest commit-*.pt (a file of this job's own commit dir)

The copy is what the training thread pays. A ``copy.deepcopy`` of the state dicts (Python's
``Tensor.__deepcopy__`` per tensor) took 1.5-2.0 ms for the benchmark's 2-layer transformer and its
momentum (52 tensors; one process on cpu2, under load); :func:`pack` takes 0.5 ms. The writer then
pickles only the skeleton and writes each buffer's bytes as they are (:func:`_dump`), so it holds the
GIL, which the training thread needs, for 0.2 ms a snapshot (``torch.save`` of the same: 0.8 ms).

Example::

    files = Snapshots("/dev/shm/phalanx-elastic-x", keep=2)
    files.write(30, {"model": model.state_dict(), "step": 30})   # returns once copied
    files.wait(); files.latest()                                 # (30, {...}) or None
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import copy
import glob
import os
import pickle
import queue
import re
import threading
from typing import Any, NamedTuple

import torch

from phalanx.log import get_logger

__all__ = ["Snapshots", "Slot", "pack", "unpack"]

log = get_logger(__name__)
_NAME = re.compile(r"commit-(\d+)\.pt$")


class Slot(NamedTuple):
    """Where a packed tensor lives: ``buffers[buffer][offset:offset + numel].view(shape)``."""

    buffer: int
    offset: int
    numel: int
    shape: tuple[int, ...]


def _plain(value: Any) -> bool:
    """A dense tensor of its own (not a subclass, not sparse): the kind one flat buffer holds."""
    return type(value) is torch.Tensor and value.layout == torch.strided


def pack(tree: Any) -> tuple[Any, list[torch.Tensor]]:
    """A copy of ``tree`` as ``(skeleton, buffers)``: every plain tensor copied into one flat buffer
    per (dtype, device) and replaced by its :class:`Slot`; dicts, lists and tuples rebuilt (a state
    dict's ``_metadata`` kept); any other value deep-copied (small: counters, param groups' numbers,
    a sampler's position).

    >>> skeleton, buffers = pack({"w": torch.ones(2, 2), "step": 3})
    >>> unpack(skeleton, buffers)["w"].shape
    torch.Size([2, 2])
    """
    groups: dict[tuple, tuple[int, list[torch.Tensor], list[int]]] = {}  # (dtype, device) -> index, tensors, size

    def walk(value: Any) -> Any:
        if _plain(value):
            key = (value.dtype, value.device)
            if key not in groups:
                groups[key] = (len(groups), [], [0])
            index, group, size = groups[key]
            group.append(value)
            numel = value.numel()
            size[0] += numel
            return Slot(index, size[0] - numel, numel, tuple(value.shape))
        return _rebuilt(value, walk)

    skeleton = walk(tree)
    return skeleton, [torch.cat([t.detach().reshape(-1) for t in group]) for _, group, _ in groups.values()]


_ATOMS = (int, float, bool, str, bytes, type(None))  # immutable: shared, not copied


def _rebuilt(value: Any, each) -> Any:
    """``value`` with ``each`` applied to every entry of its dicts, lists and tuples; other values deep-copied."""
    if type(value) in _ATOMS:
        return value
    if type(value) in (dict, collections.OrderedDict):
        out = type(value)((k, each(v)) for k, v in value.items())
        if hasattr(value, "_metadata"):  # a module's state dict: load_state_dict reads its versions
            out._metadata = copy.deepcopy(value._metadata)
        return out
    if type(value) in (list, tuple):
        return type(value)(each(v) for v in value)
    return copy.deepcopy(value)


def unpack(skeleton: Any, buffers: list[torch.Tensor]) -> Any:
    """The tree :func:`pack` copied: each :class:`Slot` a tensor of its own again."""
    if type(skeleton) is Slot:
        flat = buffers[skeleton.buffer]
        return flat[skeleton.offset:skeleton.offset + skeleton.numel].view(skeleton.shape).clone()
    return _rebuilt(skeleton, lambda v: unpack(v, buffers))


class Snapshots:
    """Numbered snapshot files under ``root``, at most one write in flight, ``keep`` newest kept."""

    def __init__(self, root: str, keep: int = 2) -> None:
        self.root, self.keep = root, max(1, keep)
        # one writer thread for the life of this object, not one per snapshot: a thread's start() returns
        # only once the new thread has run, and it ran (making the file, pickling) for up to a GIL switch
        # interval (5 ms) before the training thread got the GIL back, inside its commit()
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def path(self, number: int) -> str:
        return os.path.join(self.root, f"commit-{number:09d}.pt")

    def write(self, number: int, tree: dict[str, Any], *, background: bool = True) -> str:
        """Copy ``tree`` now, write it as snapshot ``number`` (by the writer thread when ``background``)."""
        self.wait()
        snapshot = pack(tree)  # a copy: training may change the tensors from the next step
        path = self.path(number)
        if not background:
            self._write(path, snapshot)
            return path
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="phalanx-elastic-snapshot", daemon=True)
            self._thread.start()
            atexit.register(self.close)
        self._queue.put((path, snapshot))
        return path

    def wait(self) -> None:
        """Wait for the write in flight; a failed one is logged (a snapshot is a fallback, not the state)."""
        if self._thread is not None:
            self._queue.join()
        if self._error is not None:
            err, self._error = self._error, None
            log.warning("elastic snapshot not written (%s: %s)", type(err).__name__, err)

    def close(self) -> None:
        """Finish the write in flight and end the writer thread (at interpreter exit, from atexit)."""
        if self._thread is not None and self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(30.0)
        self._thread = None

    def latest(self) -> tuple[int, dict[str, Any]] | None:
        """The newest complete snapshot, ``(number, tree)``, or None when there is none."""
        self.wait()
        found = sorted((int(m.group(1)), p) for p in glob.glob(os.path.join(self.root, "commit-*.pt"))
                       if (m := _NAME.search(p)))
        if not found:
            return None
        number, path = found[-1]
        # this job's own commit dir: its extras may be any picklable value, as a commit's memory copy is
        return number, unpack(*_read(path))

    def _loop(self) -> None:
        while (job := self._queue.get()) is not None:
            try:
                self._write(*job)
            except BaseException as err:  # noqa: BLE001 - reported by the next wait()
                self._error = err
            finally:
                self._queue.task_done()
        self._queue.task_done()

    def _write(self, path: str, snapshot: tuple) -> None:
        os.makedirs(self.root, exist_ok=True)
        tmp = f"{path}.tmp"
        with open(tmp, "wb") as f:
            _dump(snapshot, f)
            if not self.root.startswith("/dev/shm"):
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
        numbered = sorted(p for p in glob.glob(os.path.join(self.root, "commit-*.pt")) if _NAME.search(p))
        for old in numbered[:-self.keep]:
            with contextlib.suppress(OSError):
                os.unlink(old)


_MAGIC = b"PXSNAP1\n"


def _dump(snapshot: tuple[Any, list[torch.Tensor]], f) -> None:
    """``(skeleton, buffers)`` to the open file ``f``: a magic line, the pickled skeleton and the buffers'
    (dtype, numel) behind its 8-byte length, then each buffer's raw bytes. Not ``torch.save``: its zip
    container and per-storage pickling held the GIL, which the training thread needs, 0.8 ms a snapshot
    for the benchmark's 2-layer transformer against 0.2 ms here (cpu2); a plain ``write`` of a buffer
    releases it."""
    skeleton, buffers = snapshot
    buffers = [b.detach().cpu().contiguous() for b in buffers]
    head = pickle.dumps((skeleton, [(b.dtype, b.numel()) for b in buffers]), protocol=pickle.HIGHEST_PROTOCOL)
    f.write(_MAGIC + len(head).to_bytes(8, "little") + head)
    for b in buffers:
        f.write(memoryview(b.view(torch.uint8).numpy()))


def _read(path: str) -> tuple[Any, list[torch.Tensor]]:
    """What :func:`_dump` wrote to ``path``: ``(skeleton, buffers)``."""
    with open(path, "rb") as f:
        if f.read(len(_MAGIC)) != _MAGIC:
            raise ValueError(f"{path} is not an elastic snapshot of this phalanx version (no {_MAGIC!r} at its start)")
        head = pickle.loads(f.read(int.from_bytes(f.read(8), "little")))
        skeleton, metas = head
        buffers = []
        for dtype, numel in metas:
            raw = bytearray(numel * torch.empty((), dtype=dtype).element_size())
            if f.readinto(raw) != len(raw):
                raise ValueError(f"{path} is cut short (a buffer of {numel} {dtype} missing)")
            buffers.append(torch.frombuffer(raw, dtype=torch.uint8).view(dtype) if raw else torch.empty(0, dtype=dtype))
        return skeleton, buffers
