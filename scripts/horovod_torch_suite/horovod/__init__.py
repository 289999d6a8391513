"""Shim for running Horovod's own test_torch.py against phalanx (by hand, not part of phalanx)."""
import sys

import phalanx.horovod.torch as _torch

sys.modules["horovod.torch"] = _torch
