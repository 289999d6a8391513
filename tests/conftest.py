"""Suite-wide settings: spawned ranks fork from a server that already imported what most tests use."""

import importlib.util
import os

if importlib.util.find_spec("sklearn") is not None:
    os.environ.setdefault("PHALANX_SPAWN_PRELOAD", "sklearn.datasets")
