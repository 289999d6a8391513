"""Elastic training: commit/restore/sync state, a retry loop on TorchElastic restarts, a resumable sampler.

Example (run with ``phalanx run -np 4 --max-restarts 3 python train.py``)::

    import phalanx as px
    from phalanx import elastic

    px.init()
    sampler = elastic.ElasticSampler(len(ds), seed=0)
    state = elastic.TorchState(model, opt, sampler=sampler, step=0)

    @elastic.run
    def train(state):
        while state.step < 100:
            ...                                   # one step on sampler's batch
            state.sampler.record_batch(local_bs)
            state.step += 1
            if state.step % 10 == 0:
                state.commit()

    train(state)
"""

from phalanx.elastic.commit_dir import default_commit_dir
from phalanx.elastic.interrupts import HostsUpdatedInterrupt, MembershipChanged
from phalanx.elastic.run import restart_count, run
from phalanx.elastic.sampler import ElasticSampler
from phalanx.elastic.scaling import keep_global_batch, scale_lr
from phalanx.elastic.state import State, TorchState

__all__ = ["run", "State", "TorchState", "ElasticSampler", "HostsUpdatedInterrupt", "MembershipChanged", "restart_count",
           "default_commit_dir", "scale_lr", "keep_global_batch"]
