"""Crash-safe files: atomic writes, checksums, and tensor (de)serialisation that runs no code.

Every file of a checkpoint is written as ``temp file -> fsync -> rename -> fsync(dir)``,
so a reader sees either the old file or the whole new one, never half of it.
Tensors are written in the safetensors layout (a JSON header plus raw bytes;
the files load with the ``safetensors`` package too) by a small streaming
writer here, so the package is not needed and no extra copy is made; dtypes
safetensors cannot name (complex) fall back to ``torch.save``. Loading never
executes code from a file (JSON + raw bytes, or ``torch.load(weights_only=True)``),
and every file's sha256 is checked against the manifest.

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
import struct
import tempfile
from concurrent.futures import ThreadPoolExecutor

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


# safetensors' dtype names (https://github.com/huggingface/safetensors, format spec in its README)
_ST_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
              torch.uint8: "U8", torch.bool: "BOOL"}
for _name, _code in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2"), ("uint16", "U16"),
                     ("uint32", "U32"), ("uint64", "U64")):
    if hasattr(torch, _name):
        _ST_DTYPES[getattr(torch, _name)] = _code
_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}


def tensor_format(tensors: dict[str, torch.Tensor] | None = None) -> str:
    """``"safetensors"`` unless a dtype has no safetensors code (complex) or
    ``PHALANX_CHECKPOINT_FORMAT=torch``; then ``"torch"`` (torch.save, loaded with weights_only)."""
    if os.environ.get("PHALANX_CHECKPOINT_FORMAT", "") == "torch":
        return "torch"
    if tensors and any(t.dtype not in _ST_DTYPES for t in tensors.values()):
        return "torch"
    return "safetensors"


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


def _atomic(path: str, fill, fsync: bool) -> str:
    """Write through ``fill(file) -> sha256 hex`` into a temp file, fsync, rename over ``path``."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            digest = fill(f)
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


def atomic_write(path: str, data: bytes | memoryview, *, fsync: bool = True) -> str:
    """Write ``data`` to ``path`` atomically; return its sha256 hex digest."""

    def fill(f) -> str:
        f.write(data)
        return hashlib.sha256(data).hexdigest()

    return _atomic(path, fill, fsync)


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _bytes_of(t: torch.Tensor) -> memoryview:
    t = t.detach().contiguous()
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


def _write_safetensors(f, tensors: dict[str, torch.Tensor]) -> str:
    """Stream the safetensors layout (u64 header size, JSON header, raw bytes) with no extra copy.

    Largest element size first, so every tensor starts aligned to its own
    element size and the loader can view the bytes in place.
    """
    items = sorted(tensors.items(), key=lambda kv: (-kv[1].element_size(), kv[0]))
    header, offset = {}, 0
    for name, t in items:
        n = t.numel() * t.element_size()
        header[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    h = hashlib.sha256()
    # hashing runs on a second thread (hashlib drops the GIL) while this one writes
    with ThreadPoolExecutor(1) as hasher:
        for chunk in [struct.pack("<Q", len(head)) + head] + [_bytes_of(t) for _, t in items]:
            pending = hasher.submit(h.update, chunk)
            f.write(chunk)
            pending.result()
    return h.hexdigest()


def write_tensors(path: str, tensors: dict[str, torch.Tensor], *, fmt: str | None = None,
                  fsync: bool = True) -> str:
    """Atomically write a flat ``{name: CPU tensor}`` dict; return the file's sha256."""
    fmt = fmt or tensor_format(tensors)
    if fmt == "safetensors":
        return _atomic(path, lambda f: _write_safetensors(f, tensors), fsync)
    buf = _io.BytesIO()
    torch.save(tensors, buf)
    return atomic_write(path, buf.getbuffer(), fsync=fsync)


def _read_file(path: str) -> bytearray:
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            data = bytearray(size)
            got = f.readinto(data)
    except FileNotFoundError as err:
        raise CorruptCheckpointError(f"checkpoint file {path} is missing") from err
    if got != size:
        raise CorruptCheckpointError(f"checkpoint file {path}: read {got} of {size} bytes")
    return data


def _check(path: str, got: str, sha256: str | None) -> None:
    if sha256 is not None and got != sha256:
        raise CorruptCheckpointError(
            f"checkpoint file {path} is corrupt: sha256 {got[:12]}… does not match the "
            f"manifest's {sha256[:12]}… (truncated or overwritten); use load_latest() to fall "
            "back to an older checkpoint")


def _read_verified(path: str, sha256: str | None) -> bytearray:
    data = _read_file(path)
    _check(path, hashlib.sha256(data).hexdigest(), sha256)
    return data


def _parse_safetensors(data: bytearray) -> dict[str, torch.Tensor]:
    (n,) = struct.unpack("<Q", bytes(data[:8]))
    header = json.loads(bytes(data[8:8 + n]))
    base, out = 8 + n, {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype, (begin, end) = _ST_NAMES[info["dtype"]], info["data_offsets"]
        if not 0 <= begin <= end <= len(data) - base:
            raise ValueError(f"tensor {name}: data_offsets {begin}..{end} outside the file")
        if end == begin:
            out[name] = torch.empty(info["shape"], dtype=dtype)
            continue
        raw = torch.frombuffer(data, dtype=torch.uint8, count=end - begin, offset=base + begin)
        out[name] = raw.view(dtype).reshape(info["shape"])  # a view of the buffer: no copy
    return out


def read_tensors(path: str, *, sha256: str | None = None, fmt: str | None = None) -> dict[str, torch.Tensor]:
    """Read a file written by :func:`write_tensors`, checking its checksum. Runs no code from the file."""
    data = _read_file(path)
    fmt = fmt or ("safetensors" if path.endswith(".safetensors") else "torch")
    with ThreadPoolExecutor(1) as hasher:  # hash while parsing; nothing is returned unverified
        digest = hasher.submit(lambda: hashlib.sha256(data).hexdigest())
        try:
            if fmt == "safetensors":
                tensors, err = _parse_safetensors(data), None
            else:
                tensors, err = torch.load(_io.BytesIO(data), map_location="cpu", weights_only=True), None
        except Exception as e:  # a parse error is corruption too, but report a bad checksum first
            tensors, err = None, e
        _check(path, digest.result(), sha256)
    if err is not None:
        raise CorruptCheckpointError(f"checkpoint file {path} could not be parsed: {err}") from err
    return tensors


def write_json(path: str, obj, *, fsync: bool = True) -> str:
    return atomic_write(path, json.dumps(obj, indent=1, allow_nan=True).encode(), fsync=fsync)


def read_json(path: str, *, sha256: str | None = None):
    data = _read_verified(path, sha256)
    try:
        return json.loads(data)
    except ValueError as err:
        raise CorruptCheckpointError(f"checkpoint file {path} is not valid JSON: {err}") from err
