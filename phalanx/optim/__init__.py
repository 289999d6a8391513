"""Optimizers that do their own (compressed) communication.

Example::

    from phalanx.optim import OneBitAdam
    opt = OneBitAdam(model.parameters(), lr=1e-3, freeze_step=100)
"""

from phalanx.optim.onebit_adam import OneBitAdam

__all__ = ["OneBitAdam"]
