"""The job's secret key, read where strategies can reach it (the launcher writes it; ``launcher/secret.py``).

``phalanx run`` (and the multi-host agent, the Ray executor) put a random per-job secret in a
0600 file and export its path as ``PHALANX_SECRET_FILE``. Whatever signs or checks messages
from peers below the launcher floor (the parameter server's frames) reads it here.

Example::

    from phalanx.runtime.jobkey import job_key
    key = job_key()        # bytes under `phalanx run`, None in a plain `python x.py`
"""

from __future__ import annotations

import os

from phalanx.settings import RuntimeSettings, var

__all__ = ["SECRET_FILE_ENV", "job_key"]

SECRET_FILE_ENV = var("runtime.secret_file")


def job_key(env=None, error: type[Exception] = PermissionError) -> bytes | None:
    """This job's secret from the file named by PHALANX_SECRET_FILE, or None outside a job.

    Raises ``error`` when the file is readable by others (the secret would not be one).
    """
    path = RuntimeSettings.one("secret_file", env)
    if not path:
        return None
    mode = os.stat(path).st_mode & 0o777
    if mode & 0o077:
        raise error(f"{SECRET_FILE_ENV}={path} is readable by others (mode {oct(mode)}); chmod 600 it")
    with open(path, "rb") as f:
        return f.read().strip() or None
