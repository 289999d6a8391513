"""Optimizers that do their own (compressed) communication, or keep their state in 8 bits.

Example::

    from phalanx.optim import OneBitAdam
    opt = OneBitAdam(model.parameters(), lr=1e-3, freeze_step=100)
"""

from phalanx.optim.adam8bit import STATE_BITS, Adam8bit
from phalanx.optim.named_state import load_named_optimizer_state, named_optimizer_state
from phalanx.optim.onebit_adam import OneBitAdam

__all__ = ["OneBitAdam", "Adam8bit", "STATE_BITS", "named_optimizer_state", "load_named_optimizer_state"]
