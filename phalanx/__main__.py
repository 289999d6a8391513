"""``python -m phalanx …`` is the same as the ``phalanx`` command."""

import sys

from phalanx.cli import main

sys.exit(main())
