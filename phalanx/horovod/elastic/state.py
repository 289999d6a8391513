"""``horovod.torch.elastic.state``: ``from phalanx.horovod.torch.elastic.state import TorchState``.

Example::

    from phalanx.horovod.torch.elastic.state import TorchState
    state = TorchState(model, optimizer, epoch=0)
"""

from phalanx.horovod.elastic import ObjectState, TorchState

__all__ = ["TorchState", "ObjectState"]
