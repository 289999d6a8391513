"""``import phalanx.horovod.torch as hvd`` — the same facade under Horovod's module path."""

from phalanx.horovod import *  # noqa: F401,F403
from phalanx.horovod import __all__  # noqa: F401
