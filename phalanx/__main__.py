"""``python -m phalanx …`` is the same as the ``phalanx`` command."""

import sys

from phalanx.launcher.cli import main

sys.exit(main())
