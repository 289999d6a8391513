"""Crash-safe files: atomic writes, checksums, and tensor (de)serialisation that runs no code.

Every file of a checkpoint is written as ``temp file -> fsync -> rename -> fsync(dir)``,
so a reader sees either the old file or the whole new one, never half of it.
Tensors go through safetensors when it is installed (a flat header plus raw
bytes) and otherwise through ``torch.save``; either way loading never executes
code from the file (``torch.load(weights_only=True)``), and the caller checks
the file's sha256 against the manifest before parsing it.

Example::

    from phalanx.checkpoint import io
    digest = io.write_tensors("/tmp/x.st", {"w": torch.ones(3)})
    tensors = io.read_tensors("/tmp/x.st", sha256=digest)
"""

from __future__ import annotations

import hashlib
import io as _io
import json
import os
import tempfile

import torch

__all__ = [
    "CorruptCheckpointError",
    "atomic_write",
    "write_tensors",
    "read_tensors",
    "write_json",
    "read_json",
    "sha256_file",
    "tensor_format",
]


class CorruptCheckpointError(RuntimeError):
    """A checkpoint file is missing, truncated or does not match its recorded checksum."""


def _have_safetensors() -> bool:
    if os.environ.get("PHALANX_CHECKPOINT_FORMAT", "") == "torch":
        return False
    try:
        import safetensors.torch  # noqa: F401
    except ImportError:
        return False
    return True


def tensor_format() -> str:
    """``"safetensors"`` when the package is importable, else ``"torch"``."""
    return "safetensors" if _have_safetensors() else "torch"


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems (tmpfs on old kernels) refuse; the rename is still atomic
        pass
    finally:
        os.close(fd)


def atomic_write(path: str, data: bytes | memoryview, *, fsync: bool = True) -> str:
    """Write ``data`` to ``path`` atomically; return its sha256 hex digest."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    digest = hashlib.sha256(data).hexdigest()
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    if fsync:
        _fsync_dir(directory)
    return digest


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _serialise(tensors: dict[str, torch.Tensor], fmt: str) -> bytes:
    if fmt == "safetensors":
        from safetensors.torch import save

        # safetensors refuses tensors that share storage (tied weights, views): copy those
        seen: set[int] = set()
        flat = {}
        for k, t in tensors.items():
            ptr = t.untyped_storage().data_ptr() if t.numel() else -1
            shared = ptr in seen or not t.is_contiguous() or t.numel() != t.untyped_storage().nbytes() // max(t.element_size(), 1)
            flat[k] = t.clone() if shared else t
            if ptr != -1:
                seen.add(ptr)
        return save(flat)
    buf = _io.BytesIO()
    torch.save(tensors, buf)
    return buf.getvalue()


def write_tensors(path: str, tensors: dict[str, torch.Tensor], *, fmt: str | None = None,
                  fsync: bool = True) -> str:
    """Atomically write a flat ``{name: CPU tensor}`` dict; return the file's sha256."""
    fmt = fmt or tensor_format()
    return atomic_write(path, _serialise(tensors, fmt), fsync=fsync)


def _read_verified(path: str, sha256: str | None) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError as err:
        raise CorruptCheckpointError(f"checkpoint file {path} is missing") from err
    if sha256 is not None:
        got = hashlib.sha256(data).hexdigest()
        if got != sha256:
            raise CorruptCheckpointError(
                f"checkpoint file {path} is corrupt: sha256 {got[:12]}… does not match the "
                f"manifest's {sha256[:12]}… (truncated or overwritten); use load_latest() to fall "
                "back to an older checkpoint")
    return data


def read_tensors(path: str, *, sha256: str | None = None, fmt: str | None = None) -> dict[str, torch.Tensor]:
    """Read a file written by :func:`write_tensors`, after checking its checksum. Runs no code."""
    data = _read_verified(path, sha256)
    fmt = fmt or ("safetensors" if path.endswith(".safetensors") else "torch")
    try:
        if fmt == "safetensors":
            from safetensors.torch import load

            return load(data)
        return torch.load(_io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as err:  # a parse error is corruption too
        raise CorruptCheckpointError(f"checkpoint file {path} could not be parsed: {err}") from err


def write_json(path: str, obj, *, fsync: bool = True) -> str:
    return atomic_write(path, json.dumps(obj, indent=1, allow_nan=True).encode(), fsync=fsync)


def read_json(path: str, *, sha256: str | None = None):
    data = _read_verified(path, sha256)
    try:
        return json.loads(data)
    except ValueError as err:
        raise CorruptCheckpointError(f"checkpoint file {path} is not valid JSON: {err}") from err
