"""Dynamic load balancing, a service: faster ranks get more of a fixed global batch.

It attaches to the data-parallel engine through the engine's public hook seam
(:class:`phalanx.parallel.data.hooks.StepObserver`: forward begins, backward begins,
compute ends, wait ends); no strategy imports it. ``balance=<int>`` of ``DataParallel`` /
``DistributedOptimizer`` builds a :class:`Balancer` through the factory registered here.
See ``docs/load_balancing.md``::

    balancer.py   Balancer (measure, exchange, re-split), StragglerReport, load_sigma
    sampler.py    BalancedSampler (each rank's variable share, every sample once), split_sizes
    batches.py    the Trainer's side: balance=True, balanced epochs

Example::

    import phalanx as px
    balancer = px.balance.Balancer(global_batch=256)
    model = px.DataParallel(net, balance=balancer)
    sampler = px.balance.BalancedSampler(len(dataset), balancer, seed=0)
"""

from phalanx.balance.balancer import Balancer, StragglerReport, load_sigma
from phalanx.balance.batches import as_balancer, epoch_batches
from phalanx.balance.sampler import BalancedSampler, split_sizes
from phalanx.parallel.data.hooks import register_balance_factory

__all__ = ["Balancer", "BalancedSampler", "StragglerReport", "split_sizes", "load_sigma", "as_balancer",
           "epoch_batches"]

register_balance_factory(lambda global_batch, group: Balancer(global_batch=global_batch, group=group))
