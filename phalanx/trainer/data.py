"""How the Trainer reads data: tensors, any Dataset or IterableDataset, or a DataLoader, sharded by rank.

Every input becomes a ``DataLoader`` that yields this rank's batches:

    (inputs, targets) tensors   TensorDataset, DistributedSampler, whole batches by fancy indexing
    map-style Dataset           DistributedSampler (seed + epoch, as a single process would shuffle),
                                torch's default_collate (tuples, dicts, numbers, arrays)
    IterableDataset             every size-th item from this rank's offset (and split again across
                                the loader's workers); the ranks stop together at the shortest
    DataLoader                  re-sharded with a DistributedSampler, keeping its batch size, workers,
                                pinned memory, collate_fn, ...; one already sharded by a
                                DistributedSampler is used as it is

With a DistributedSampler the union of the ranks' ``b``-th batches is the ``b``-th slice of one
permutation of the data: the global batch a single process with ``batch_size × size`` would draw.
Evaluation shards without padding (``rank::size``), so no sample is counted twice.

Input the Trainer cannot train on is refused with one line saying why (:class:`DataError`).

Example::

    loader = DataLoader(dataset, batch_size=32, shuffle=True, num_workers=2, pin_memory=True)
    Trainer(model, opt, loss_fn, loader).fit(3)     # each rank reads its shard, set_epoch per epoch
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Mapping

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    TensorDataset,
    default_collate,
    get_worker_info,
)

from phalanx.settings import SettingsError

__all__ = ["DataError", "EpochData", "make_epoch_data", "split_batch", "to_device", "batch_len", "check_shapes"]

TARGET_KEYS = ("y", "target", "targets", "label", "labels")
# DataLoader settings a re-sharded loader keeps (the sampler and batching are the Trainer's).
_KEPT = ("num_workers", "collate_fn", "pin_memory", "timeout", "worker_init_fn", "multiprocessing_context",
         "generator", "persistent_workers", "pin_memory_device", "in_order")


class DataError(SettingsError):
    """``train_data`` / ``val_data`` the Trainer cannot train on; the message says why and what to pass."""


class _RankShard(IterableDataset):
    """Every ``size``-th item of an iterable from offset ``rank``, split again across loader workers."""

    def __init__(self, dataset: IterableDataset, rank: int, size: int) -> None:
        self.dataset, self.rank, self.size = dataset, rank, size

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    def __iter__(self):
        worker = get_worker_info()
        step, offset = self.size, self.rank
        if worker is not None:
            step, offset = self.size * worker.num_workers, self.rank + self.size * worker.id
        return itertools.islice(iter(self.dataset), offset, None, step)


class EpochData:
    """This rank's batches, epoch by epoch (``set_epoch`` first); ``steps`` is None for an iterable."""

    def __init__(self, loader: DataLoader, *, uneven: bool) -> None:
        self.loader = loader
        self.uneven = uneven  # ranks may run out at different batches: the loop agrees per step
        sampler = _inner_sampler(loader)
        self._epoch_setters = [x for x in (sampler, loader.dataset) if hasattr(x, "set_epoch")]

    @property
    def dataset(self):
        return self.loader.dataset

    def steps(self) -> int | None:
        try:
            return len(self.loader)
        except TypeError:
            return None

    def epoch(self, epoch: int):
        for x in self._epoch_setters:
            x.set_epoch(epoch)
        return iter(self.loader)


def _inner_sampler(loader: DataLoader):
    sampler = loader.batch_sampler if loader.batch_sampler is not None else loader.sampler
    while isinstance(sampler, BatchSampler):
        sampler = sampler.sampler
    return sampler


def make_epoch_data(data, *, what: str, rank: int, size: int, batch_size: int | None, shuffle: bool,
                    seed: int, train: bool) -> tuple[EpochData, int]:
    """Wrap ``data`` as this rank's :class:`EpochData`; also return the per-rank batch size used."""
    if isinstance(data, DataLoader):
        return _reshard(data, what=what, rank=rank, size=size, batch_size=batch_size, seed=seed, train=train)
    batch_size = batch_size or 32
    if isinstance(data, list) and len(data) == 2 and all(torch.is_tensor(t) and t.dim() > 0 for t in data) \
            and len(data[0]) == len(data[1]) and len(data[0]) != 2:
        raise DataError(f"{what} is a list of two tensors, which reads as a dataset of 2 samples; pass a tuple "
                        "(inputs, targets) or torch.utils.data.TensorDataset(inputs, targets)")
    if isinstance(data, tuple):
        return _tensor_pair(data, what=what, rank=rank, size=size, batch_size=batch_size, shuffle=shuffle,
                            seed=seed, train=train), batch_size
    if isinstance(data, IterableDataset):
        loader = DataLoader(_RankShard(data, rank, size), batch_size=batch_size, drop_last=train)
        return EpochData(loader, uneven=True), batch_size
    if not (isinstance(data, Dataset) or (hasattr(data, "__getitem__") and hasattr(data, "__len__"))):
        raise DataError(f"{what} is a {type(data).__name__}; pass a tuple (inputs, targets) of tensors, a "
                        "torch Dataset or IterableDataset, or a DataLoader")
    _check_size(len(data), what=what, size=size, batch_size=batch_size, train=train)
    loader = DataLoader(data, batch_size=batch_size, sampler=_sampler(data, rank, size, shuffle, seed, train),
                        drop_last=train, collate_fn=default_collate)
    return EpochData(loader, uneven=False), batch_size


def _tensor_pair(data: tuple, *, what, rank, size, batch_size, shuffle, seed, train) -> EpochData:
    if len(data) != 2 or not all(torch.is_tensor(t) for t in data):
        kinds = ", ".join(type(t).__name__ for t in data)
        raise DataError(f"{what} is a tuple of ({kinds}); a tuple must be (inputs, targets), two tensors "
                        "with one row per sample (or pass a Dataset)")
    x, y = data
    if x.dim() == 0 or y.dim() == 0 or len(x) != len(y):
        raise DataError(f"{what}: inputs of shape {list(x.shape)} and targets of shape {list(y.shape)} do not "
                        "have the same number of samples (first dimension)")
    dataset = TensorDataset(x, y)
    _check_size(len(dataset), what=what, size=size, batch_size=batch_size, train=train)
    # TensorDataset indexes with a whole list of indices: one gather per batch, no per-sample collate.
    batches = BatchSampler(_sampler(dataset, rank, size, shuffle, seed, train), batch_size, drop_last=train)
    return EpochData(DataLoader(dataset, sampler=batches, batch_size=None), uneven=False)


def _sampler(dataset, rank: int, size: int, shuffle: bool, seed: int, train: bool):
    if train:
        return DistributedSampler(dataset, num_replicas=size, rank=rank, shuffle=shuffle, seed=seed,
                                  drop_last=True)
    return range(rank, len(dataset), size)  # evaluation: every sample once, no padding


def _check_size(length: int, *, what: str, size: int, batch_size: int, train: bool) -> None:
    if train and length < batch_size * size:
        raise DataError(f"{what} has {length} samples, fewer than one global batch ({batch_size} per rank x "
                        f"{size} ranks = {batch_size * size}): nothing to train on; lower batch_size or use more data")


def _reshard(loader: DataLoader, *, what, rank, size, batch_size, seed, train) -> tuple[EpochData, int]:
    dataset = loader.dataset
    sampler = _inner_sampler(loader)
    own = loader.batch_size
    if batch_size is not None and own is not None and batch_size != own:
        raise DataError(f"Trainer(batch_size={batch_size}) differs from the DataLoader's batch_size {own}; "
                        "give the per-rank batch size in one place")
    if isinstance(sampler, DistributedSampler):  # sharded by the user: used as it is, set_epoch per epoch
        return EpochData(loader, uneven=False), own or batch_size or 0
    kept = {k: getattr(loader, k) for k in _KEPT if hasattr(loader, k)}
    if loader.num_workers > 0:
        kept["prefetch_factor"] = loader.prefetch_factor
    if isinstance(dataset, IterableDataset):
        if own is None:
            raise DataError(f"{what}: a DataLoader over an IterableDataset with batch_size=None cannot be split "
                            "into per-rank batches; give it a batch_size")
        shard = DataLoader(_RankShard(dataset, rank, size), batch_size=own, drop_last=loader.drop_last, **kept)
        return EpochData(shard, uneven=True), own
    if own is None:
        raise DataError(f"{what}: this DataLoader batches with its own batch_sampler, which the Trainer cannot "
                        "shard across ranks; pass its dataset and a batch_size, or shard it yourself with a "
                        "torch.utils.data.DistributedSampler")
    shuffle = isinstance(sampler, RandomSampler)
    shard = DataLoader(dataset, batch_size=own, sampler=_sampler(dataset, rank, size, shuffle, seed, train),
                       drop_last=loader.drop_last, **kept)
    if train and len(shard) == 0:  # per rank: len // size samples, then the loader's own drop_last
        _check_size(len(dataset), what=what, size=size, batch_size=own if loader.drop_last else 1, train=True)
    return EpochData(shard, uneven=False), own


def split_batch(batch):
    """``(inputs, targets)`` of a batch: a pair, or a dict with one target key (y, target(s), label(s)).

    A dict's other entries are the inputs: the value itself when there is one, else a dict that
    the Trainer passes to the model as keyword arguments. Pass ``Trainer(split_batch=...)`` for
    anything else.
    """
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    if isinstance(batch, Mapping):
        keys = [k for k in batch if k in TARGET_KEYS]
        if len(keys) == 1 and len(batch) > 1:
            inputs = {k: v for k, v in batch.items() if k != keys[0]}
            return (next(iter(inputs.values())) if len(inputs) == 1 else inputs), batch[keys[0]]
        shown = f"a dict with keys {sorted(map(str, batch))}"
    else:
        shown = f"a {type(batch).__name__}" + (f" of {len(batch)}" if isinstance(batch, (tuple, list)) else "")
    raise DataError(f"a batch is {shown}; the Trainer needs (inputs, targets) or a dict with exactly one target "
                    f"key ({', '.join(TARGET_KEYS)}); pass Trainer(split_batch=lambda batch: (inputs, targets))")


def to_device(obj, device: torch.device, non_blocking: bool = False):
    """Move the tensors of a batch (tensors, or tuples/lists/dicts of them) to ``device``."""
    if torch.is_tensor(obj):
        return obj.to(device, non_blocking=non_blocking)
    if isinstance(obj, Mapping):
        return {k: to_device(v, device, non_blocking) for k, v in obj.items()}
    if isinstance(obj, (tuple, list)):
        return type(obj)(to_device(v, device, non_blocking) for v in obj)
    return obj


def batch_len(obj) -> int:
    """The number of samples in a batch's targets (or inputs)."""
    if torch.is_tensor(obj):
        return len(obj) if obj.dim() else 1
    if isinstance(obj, Mapping):
        return batch_len(next(iter(obj.values())))
    return len(obj)


def check_shapes(out, y) -> None:
    """Warn when a loss on ``out`` and ``y`` would broadcast them to a shape larger than both."""
    if not (torch.is_tensor(out) and torch.is_tensor(y)) or out.shape == y.shape or not y.is_floating_point():
        return
    try:
        shape = torch.broadcast_shapes(out.shape, y.shape)
    except RuntimeError:
        return  # the loss raises its own error
    if shape.numel() > max(out.numel(), y.numel()):
        warnings.warn(f"Trainer: the model's output has shape {list(out.shape)} and the targets {list(y.shape)}; "
                      f"a loss on them broadcasts to {list(shape)}, which is almost never meant; reshape the "
                      f"targets (e.g. y.view({', '.join(map(str, out.shape))})) or the output",
                      stacklevel=3)
