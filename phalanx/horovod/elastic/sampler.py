"""``horovod.torch.elastic.sampler``: ``from phalanx.horovod.torch.elastic.sampler import ElasticSampler``.

Example::

    from phalanx.horovod.torch.elastic.sampler import ElasticSampler
    sampler = ElasticSampler(dataset, shuffle=True)
"""

from phalanx.horovod.elastic import ElasticSampler

__all__ = ["ElasticSampler"]
