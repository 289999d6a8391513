"""``hvd.elastic.ElasticSampler`` (Horovod's ``horovod.torch.elastic.sampler``):
``from phalanx.horovod.torch.elastic.sampler import ElasticSampler``.

Example::

    sampler = ElasticSampler(dataset, shuffle=True)
    loader = torch.utils.data.DataLoader(dataset, batch_size=32, sampler=sampler)
"""

from __future__ import annotations

from phalanx import elastic as _elastic

__all__ = ["ElasticSampler"]


class ElasticSampler(_elastic.ElasticSampler):
    """Horovod's ``ElasticSampler(dataset, shuffle=True, seed=0)``: shards the unprocessed rest of
    the epoch over the current ranks and re-shards it after a reset.

    ``record_batch(batch_idx, batch_size)`` counts one step of ``batch_size`` samples on every
    rank; call ``set_epoch`` at the end of each epoch. Unlike Horovod, an epoch whose rest does
    not split evenly drops its last few samples instead of repeating some.
    """

    def __init__(self, dataset, shuffle: bool = True, seed: int = 0) -> None:
        if not hasattr(dataset, "__len__"):
            raise TypeError(f"ElasticSampler needs a dataset with a length, got {type(dataset).__name__}")
        self.dataset = dataset
        super().__init__(len(dataset), shuffle=shuffle, seed=seed)

    def record_batch(self, batch_idx: int, batch_size: int) -> None:  # type: ignore[override]
        super().record_batch(batch_size)
