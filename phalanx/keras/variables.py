"""Broadcast Keras (or TensorFlow) variables from one rank to all, coalesced per dtype.

On the torch backend a Keras variable's value is a torch tensor: it is broadcast in
place. Other backends' variables are read once into torch tensors (DLPack where
possible), broadcast, and assigned back.

Example::

    hvd.broadcast_variables(model.variables, root_rank=0)
"""

from __future__ import annotations

import torch

import phalanx.runtime as runtime
from phalanx.comm.broadcast import broadcast_parameters
from phalanx.keras.tensors import kind, to_torch

__all__ = ["broadcast_variables"]


def broadcast_variables(variables, root_rank: int = 0) -> None:
    """Give every rank ``root_rank``'s values of ``variables`` (Keras or TensorFlow variables), in place."""
    variables = list(variables)
    if runtime.size() == 1 or not variables:
        return
    if not 0 <= root_rank < runtime.size():
        raise ValueError(f"broadcast_variables: root_rank {root_rank} is outside 0..{runtime.size() - 1}")
    tensors, assign_back = [], []
    for v in variables:
        value = v.value if kind(v) == "keras" else v
        if isinstance(value, torch.Tensor):
            tensors.append(value)
        else:
            t = to_torch(value).clone()  # a variable's read is a snapshot: assign the result back
            tensors.append(t)
            assign_back.append((v, t))
    broadcast_parameters([(f"{i:06d}", t) for i, t in enumerate(tensors)], root_rank=root_rank)
    for v, t in assign_back:
        v.assign(t.numpy())
