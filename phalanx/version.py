"""The release of this phalanx (read by ``phalanx --version``, ``-cb`` and ``phalanx.__version__``)."""

__version__ = "0.1.0"
