"""Stand-in for the ``mock`` package Horovod's test utilities import."""

from unittest.mock import *  # noqa: F403
