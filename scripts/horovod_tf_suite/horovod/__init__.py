"""Shim for running Horovod's own test files against phalanx (by hand, not part of phalanx)."""
import importlib
import sys
import types

import phalanx.tensorflow as _tf

_keras = importlib.import_module("phalanx.tensorflow.keras")
sys.modules["horovod.tensorflow"] = _tf
sys.modules["horovod.tensorflow.keras"] = _keras
sys.modules["horovod.keras"] = _keras
_util = types.ModuleType("horovod.tensorflow.util")
_util._executing_eagerly = lambda: __import__("tensorflow").executing_eagerly()
sys.modules["horovod.tensorflow.util"] = _util
_common = types.ModuleType("horovod.common")
_cutil = types.ModuleType("horovod.common.util")
def is_version_greater_equal_than(ver, target):
    from packaging import version
    return version.parse(ver) >= version.parse(target)
_cutil.is_version_greater_equal_than = is_version_greater_equal_than
sys.modules["horovod.common"] = _common
sys.modules["horovod.common.util"] = _cutil
