"""The ``phalanx`` command: one module per subcommand (a front; it may import any layer).

``phalanx.cli:main`` is the console script; ``python -m phalanx`` runs the same.
"""

from phalanx.cli.main import build_parser, main

__all__ = ["main", "build_parser"]
