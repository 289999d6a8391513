"""The job secret: who may talk to a phalanx job.

``phalanx run`` makes a random 256-bit secret per job (as Horovod's driver does)
and hands it to each host's agent on the SSH session's standard input, never on
a command line. The agent writes it to a 0600 file and tells its workers where
(``PHALANX_SECRET_FILE``); nothing logs it. Before phalanx accepts a control
message or unpickles anything a peer wrote, it checks an HMAC-SHA256 of the bytes
under that secret, in constant time, and refuses the message otherwise.

What this does not cover: PyTorch's own TCPStore and c10d rendezvous accept any
client that can reach their port. Keep that port behind the chosen interface and
a firewall (see docs/multihost.md).

Example::

    from phalanx.launcher import secret
    key = secret.new_secret()
    blob = secret.dumps({"cmd": "stop"}, key)
    secret.loads(blob, key)            # {'cmd': 'stop'}
    secret.loads(blob, b"wrong")       # raises AuthenticationError, nothing unpickled
"""

from __future__ import annotations

import hashlib
import hmac
import os
import pickle
import secrets
import tempfile

from phalanx.runtime.jobkey import SECRET_FILE_ENV, job_key

__all__ = [
    "AuthenticationError",
    "AuthenticatedStore",
    "new_secret",
    "sign",
    "verify",
    "dumps",
    "loads",
    "write_secret_file",
    "load_secret",
    "SECRET_FILE_ENV",
]

_MAC_BYTES = 32


class AuthenticationError(PermissionError):
    """A message did not carry a valid HMAC under this job's secret; it was refused unread."""


def new_secret() -> bytes:
    """A fresh random 32-byte secret, as hex bytes (safe to put in a file or on a pipe)."""
    return secrets.token_hex(32).encode()


def sign(key: bytes, data: bytes) -> bytes:
    return hmac.new(key, data, hashlib.sha256).digest()


def verify(key: bytes, data: bytes, mac: bytes) -> bool:
    return hmac.compare_digest(sign(key, data), mac)


def dumps(obj, key: bytes) -> bytes:
    """Pickle ``obj`` and prefix the HMAC of the pickle."""
    data = pickle.dumps(obj)
    return sign(key, data) + data


def loads(blob: bytes, key: bytes | None, what: str = "message"):
    """Check the HMAC of ``blob`` under ``key``, then unpickle; raise before unpickling if it fails."""
    if not key:
        raise AuthenticationError(f"refused {what}: this process has no job secret "
                                  f"(set {SECRET_FILE_ENV} or run under `phalanx run`)")
    mac, data = blob[:_MAC_BYTES], blob[_MAC_BYTES:]
    if len(mac) != _MAC_BYTES or not verify(key, data, mac):
        raise AuthenticationError(f"refused {what}: bad or missing HMAC (sender does not hold the job secret)")
    return pickle.loads(data)


def write_secret_file(key: bytes, directory: str | None = None) -> str:
    """Write ``key`` to a new file only this user can read; return its path."""
    fd, path = tempfile.mkstemp(prefix="phalanx-secret-", dir=directory)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, key)
    finally:
        os.close(fd)
    return path


def load_secret(env=None) -> bytes | None:
    """This job's secret from the file named by PHALANX_SECRET_FILE, or None outside a job."""
    return job_key(env, AuthenticationError)


class AuthenticatedStore:
    """A c10d store wrapper whose values carry an HMAC; ``get`` refuses values without a valid one.

    Example::

        store = AuthenticatedStore(dist.TCPStore(host, port, is_master=False), load_secret())
        store.set("ctl/stop", {"reason": "rank 3 failed"})
        store.get("ctl/stop")     # verified, then unpickled
    """

    def __init__(self, store, key: bytes | None) -> None:
        self._store = store
        self._key = key

    def set(self, name: str, obj) -> None:
        if not self._key:
            raise AuthenticationError("cannot sign a control message without the job secret")
        self._store.set(name, dumps((name, obj), self._key))

    def get(self, name: str):
        key_name, obj = loads(self._store.get(name), self._key, what=f"control message {name!r}")
        if key_name != name:  # a valid message replayed under another key
            raise AuthenticationError(f"refused control message {name!r}: it was signed for {key_name!r}")
        return obj
