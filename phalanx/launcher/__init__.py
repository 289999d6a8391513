"""Launching: ``phalanx run`` (TorchElastic agent per host) and ``phalanx.run(fn, np=…)``."""

from phalanx.launcher.spawn import RankError, RankTimeoutError, free_port, run

__all__ = ["run", "RankError", "RankTimeoutError", "free_port"]
