"""Crash-safe files: atomic writes, checksums, and tensor (de)serialisation that runs no code.

Every file of a checkpoint is written as ``temp file -> fsync -> rename -> fsync(dir)``,
so a reader sees either the old file or the whole new one, never half of it.
Tensors are written in the safetensors layout (a JSON header plus raw bytes;
the files load with the ``safetensors`` package too) by a small streaming
writer here, so the package is not needed and no extra copy is made; dtypes
safetensors cannot name (complex) fall back to ``torch.save``. Loading never
executes code from a file (JSON + raw bytes, or ``torch.load(weights_only=True)``),
and every file's checksum is checked against the manifest. Checksums are written as
``"xxh3:<32 hex>"`` (the default where the ``xxhash`` package is installed: XXH3-128, a
non-cryptographic hash that passes SMHasher; random damage goes unnoticed with probability
2**-128), ``"crc32:1a2b3c4d"`` (zlib's CRC-32, as in zip/gzip/PNG: catches any burst of up to
32 flipped bits, misses random damage with probability 2**-32; the default without ``xxhash``)
or ``"sha256:<hex>"`` (cryptographic); ``PHALANX_CHECKPOINT_CHECKSUM`` picks one. The speed is
the reason for the default: on the 2-core benchmark machine, in one process at the same load,
XXH3-128 ran at 2.9 GB/s, CRC-32 at 0.75 and sha256 at 0.32, so a CRC-32 pass over every byte
written and read cost more than DCP's whole save or load (which checks nothing). All three
release the GIL, so they run on a second thread beside the file I/O. A loader reads every
algorithm: the manifest records it per file.

Example::

    from phalanx.checkpoint import io
    digest = io.write_tensors("/tmp/x.st", {"w": torch.ones(3)})   # "xxh3:…"
    tensors = io.read_tensors("/tmp/x.st", checksum=digest)
"""

from __future__ import annotations

import hashlib
import io as _io
import json
import os
import struct
import tempfile
import zlib
from concurrent.futures import ThreadPoolExecutor

import torch

from phalanx.settings import CheckpointSettings

__all__ = [
    "CorruptCheckpointError",
    "atomic_write",
    "write_tensors",
    "read_tensors",
    "write_json",
    "read_json",
    "checksum_file",
    "sync_dir",
    "content_checksum",
    "checksum_algorithm",
    "tensor_format",
    "tensor_bytes",
    "safetensors_dtype",
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


class _Crc32:
    """hashlib-like CRC-32 (zlib releases the GIL on large buffers, so it runs beside file I/O)."""

    name = "crc32"

    def __init__(self) -> None:
        self.value = 0

    def update(self, data) -> None:
        self.value = zlib.crc32(data, self.value)

    def hexdigest(self) -> str:
        return f"{self.value:08x}"


try:  # optional: the fast default checksum (a small C extension, no dependencies)
    import xxhash as _xxhash
except ImportError:  # pragma: no cover - exercised where xxhash is not installed
    _xxhash = None


class _Xxh3:
    """hashlib-like XXH3-128 (https://github.com/Cyan4973/xxHash; python-xxhash releases the GIL)."""

    name = "xxh3"

    def __init__(self) -> None:
        if _xxhash is None:
            raise RuntimeError("this checkpoint's files carry xxh3 checksums, which need the xxhash package: "
                               "pip install xxhash")
        self._h = _xxhash.xxh3_128()

    def update(self, data) -> None:
        self._h.update(data)

    def hexdigest(self) -> str:
        return self._h.hexdigest()


_ALGORITHMS = {"xxh3": _Xxh3, "crc32": _Crc32, "sha256": hashlib.sha256}


def checksum_algorithm() -> str:
    """``$PHALANX_CHECKPOINT_CHECKSUM`` (``xxh3``, ``crc32`` or ``sha256``, checked by the settings);
    unset: ``xxh3`` where the ``xxhash`` package is installed, else ``crc32``."""
    return CheckpointSettings.one("checksum") or ("xxh3" if _xxhash is not None else "crc32")


def _hasher(expected: str | None = None):
    """A fresh hasher for writing (default algorithm) or for checking ``expected`` ("algo:hex"; bare hex is sha256)."""
    if expected is None:
        algo = checksum_algorithm()
    else:
        algo = expected.split(":", 1)[0] if ":" in expected else "sha256"
        if algo not in _ALGORITHMS:
            raise CorruptCheckpointError(f"checksum {expected[:20]!r} uses an unknown algorithm {algo!r}")
    return _ALGORITHMS[algo]()


def _digest(h) -> str:
    return f"{h.name}:{h.hexdigest()}"


def safetensors_dtype(name: str) -> bool:
    """Whether the safetensors format has a code for torch dtype ``name`` (``"float32"``; not complex)."""
    return isinstance(getattr(torch, name, None), torch.dtype) and getattr(torch, name) in _ST_DTYPES


def tensor_format(tensors: dict[str, torch.Tensor] | None = None) -> str:
    """``"safetensors"`` unless a dtype has no safetensors code (complex) or
    ``PHALANX_CHECKPOINT_FORMAT=torch``; then ``"torch"`` (torch.save, loaded with weights_only)."""
    if CheckpointSettings.one("format") == "torch":
        return "torch"
    if tensors and any(t.dtype not in _ST_DTYPES for t in tensors.values()):
        return "torch"
    return "safetensors"


def sync_dir(path: str) -> None:
    """fsync directory ``path``: the renames into it are durable once this returns.

    A writer of several files renames them all with ``sync_dir=False`` and calls this once
    (one journal commit instead of one per file)."""
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


def _atomic(path: str, fill, fsync: bool, dir_sync: bool = True) -> str:
    """Write through ``fill(file) -> "algo:hex" checksum`` into a temp file, fsync, rename over ``path``
    (then fsync the directory, unless ``dir_sync`` is False: the caller does it once for several files)."""
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
    if fsync and dir_sync:
        sync_dir(directory)
    return digest


def atomic_write(path: str, data: bytes | memoryview, *, fsync: bool = True, dir_sync: bool = True) -> str:
    """Write ``data`` to ``path`` atomically; return its checksum (``"xxh3:…"``)."""

    def fill(f) -> str:
        f.write(data)
        h = _hasher()
        h.update(data)
        return _digest(h)

    return _atomic(path, fill, fsync, dir_sync)


def checksum_file(path: str, like: str | None = None) -> str:
    """The file's ``"algo:hex"`` checksum, with the algorithm of ``like`` (default: the current one)."""
    h = _hasher(like)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return _digest(h)


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The tensor's bytes (a view when it is contiguous on CPU)."""
    t = t.detach().contiguous()
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


def _safetensors_chunks(tensors: dict[str, torch.Tensor]) -> list:
    """The safetensors layout as a list of byte chunks (u64 header size + JSON header, then raw bytes).

    Largest element size first, so every tensor starts aligned to its own
    element size and the loader can view the bytes in place. Deterministic: the same
    names, shapes, dtypes and bytes always give the same stream.
    """
    items = sorted(tensors.items(), key=lambda kv: (-kv[1].element_size(), kv[0]))
    header, offset = {}, 0
    for name, t in items:
        n = t.numel() * t.element_size()
        header[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    return [struct.pack("<Q", len(head)) + head] + [tensor_bytes(t) for _, t in items]


def _write_safetensors(f, tensors: dict[str, torch.Tensor]) -> str:
    """Stream the safetensors layout with no extra copy; return the file's checksum."""
    h = _hasher()
    # hashing runs on a second thread (hashlib and zlib drop the GIL) while this one writes
    with ThreadPoolExecutor(1) as hasher:
        for chunk in _safetensors_chunks(tensors):
            pending = hasher.submit(h.update, chunk)
            f.write(chunk)
            pending.result()
    return _digest(h)


def content_checksum(tensors: dict[str, torch.Tensor], fmt: str) -> str:
    """What :func:`write_tensors` would record for these tensors, computed without writing.

    For ``"safetensors"`` it equals the checksum of the file ``write_tensors`` writes
    (the byte stream is deterministic), so a rank holding the same tensors as a file's
    writer can check that its copy is the one on disk from the writer's checksum alone.
    ``torch.save`` output is not hashed (its bytes are not promised stable): for
    ``"torch"`` this is a checksum of the names and raw bytes in name order, and the
    writer computes it too.
    """
    h = _hasher()
    if fmt == "safetensors":
        for chunk in _safetensors_chunks(tensors):
            h.update(chunk)
    else:
        for name in sorted(tensors):
            t = tensors[name]
            h.update(f"{name}\0{t.dtype}\0{list(t.shape)}\0".encode())
            h.update(tensor_bytes(t))
    return _digest(h)


def write_tensors(path: str, tensors: dict[str, torch.Tensor], *, fmt: str | None = None,
                  fsync: bool = True, dir_sync: bool = True) -> str:
    """Atomically write a flat ``{name: CPU tensor}`` dict; return the file's checksum (``"xxh3:…"``)."""
    fmt = fmt or tensor_format(tensors)
    if fmt == "safetensors":
        return _atomic(path, lambda f: _write_safetensors(f, tensors), fsync, dir_sync)
    buf = _io.BytesIO()
    torch.save(tensors, buf)
    return atomic_write(path, buf.getbuffer(), fsync=fsync, dir_sync=dir_sync)


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


def _check(path: str, h, expected: str | None) -> None:
    if expected is None:
        return
    got, want = h.hexdigest(), expected.split(":", 1)[-1]
    if got != want:
        raise CorruptCheckpointError(
            f"checkpoint file {path} is corrupt: its {h.name} checksum {got[:16]} does not match the "
            f"manifest's {want[:16]} (truncated or overwritten); use load_latest() to fall "
            "back to an older checkpoint")


def _read_verified(path: str, checksum: str | None) -> bytearray:
    data = _read_file(path)
    h = _hasher(checksum)
    h.update(data)
    _check(path, h, checksum)
    return data


_CHUNK = 8 << 20  # read and hash in pieces this large, so hashing overlaps the next read


def _safetensors_regions(header: dict, base: int, size: int, path: str) -> list[tuple[int, int, str | None]]:
    """(begin, end, tensor name or None for filler) covering every byte of the file in order."""
    spans = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(info, dict) or info.get("dtype") not in _ST_NAMES:
            raise CorruptCheckpointError(f"checkpoint file {path}: tensor {name} has an unknown dtype")
        begin, end = info["data_offsets"]
        n = _ST_NAMES[info["dtype"]].itemsize
        for d in info["shape"]:
            n *= d
        if not 0 <= begin <= end <= size - base or end - begin != n:
            raise CorruptCheckpointError(f"checkpoint file {path}: tensor {name}: data_offsets {begin}..{end} "
                                         f"do not fit its shape or the file ({size} bytes)")
        spans.append((base + begin, base + end, name))
    spans.sort()
    regions, pos = [], base
    for begin, end, name in spans:
        if begin < pos:
            raise CorruptCheckpointError(f"checkpoint file {path}: tensor {name} overlaps another")
        if begin > pos:
            regions.append((pos, begin, None))
        regions.append((begin, end, name))
        pos = end
    if pos < size:
        regions.append((pos, size, None))
    return regions


def _read_safetensors(path: str, checksum: str | None, into: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One pass over the file: read each tensor's bytes straight into its destination
    (``into[name]`` when shape and dtype match, else a new tensor) while a second
    thread hashes what was read (hashlib and file reads both release the GIL).

    Nothing is returned before the whole file's checksum matched. Destinations from
    ``into`` are written before the check, so after a :class:`CorruptCheckpointError`
    they hold undefined data (``load_latest`` then loads an older checkpoint over them).
    """
    try:
        f = open(path, "rb", buffering=0)
    except FileNotFoundError as err:
        raise CorruptCheckpointError(f"checkpoint file {path} is missing") from err
    h = _hasher(checksum)
    with f, ThreadPoolExecutor(1) as hasher:
        size = os.fstat(f.fileno()).st_size
        pos = 0

        def take(buf: memoryview) -> None:
            nonlocal pos
            got = 0
            while got < len(buf):
                n = f.readinto(buf[got:])
                if not n:
                    raise CorruptCheckpointError(f"checkpoint file {path}: truncated at byte {pos + got} "
                                                 f"of {size}")
                got += n
            pos += got
            hasher.submit(h.update, buf)  # one thread: the updates run in file order

        def rest_then_check(err: Exception) -> None:
            # a malformed header is corruption too, but a checksum mismatch is the clearer report
            for block in iter(lambda: f.read(_CHUNK), b""):
                hasher.submit(h.update, block)
            hasher.shutdown(wait=True)
            _check(path, h, checksum)
            raise CorruptCheckpointError(f"checkpoint file {path} could not be parsed: {err}") from err

        try:
            head = bytearray(8)
            take(memoryview(head))
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                raise ValueError(f"header of {n} bytes is longer than the file ({size} bytes)")
            text = bytearray(n)
            take(memoryview(text))
            header = json.loads(bytes(text))
            regions = _safetensors_regions(header, 8 + n, size, path)
        except (ValueError, KeyError, TypeError, AttributeError, CorruptCheckpointError) as err:
            rest_then_check(err)
        out: dict[str, torch.Tensor] = {}
        for begin, end, name in regions:
            if name is None:  # filler bytes: hashed, not kept (a fresh buffer each: hashing is behind)
                for lo in range(begin, end, _CHUNK):
                    take(memoryview(bytearray(min(_CHUNK, end - lo))))
                continue
            info = header[name]
            dtype, shape = _ST_NAMES[info["dtype"]], tuple(info["shape"])
            dst = into.get(name)
            if not (isinstance(dst, torch.Tensor) and dst.dtype == dtype and tuple(dst.shape) == shape
                    and dst.device.type == "cpu" and dst.is_contiguous()):
                dst = torch.empty(shape, dtype=dtype)
            out[name] = dst
            if end > begin:
                raw = memoryview(dst.detach().reshape(-1).view(torch.uint8).numpy())
                for lo in range(0, end - begin, _CHUNK):
                    take(raw[lo: lo + _CHUNK])
    _check(path, h, checksum)
    return out


def read_tensors(path: str, *, checksum: str | None = None, fmt: str | None = None,
                 into: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Read a file written by :func:`write_tensors`, checking its checksum. Runs no code from the file.

    ``into`` maps tensor names to CPU tensors to read straight into (no extra copy);
    tensors that do not match in shape/dtype get fresh memory.
    """
    fmt = fmt or ("safetensors" if path.endswith(".safetensors") else "torch")
    if fmt == "safetensors":
        return _read_safetensors(path, checksum, into or {})
    data = _read_verified(path, checksum)
    try:
        return torch.load(_io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as err:
        raise CorruptCheckpointError(f"checkpoint file {path} could not be parsed: {err}") from err


def write_json(path: str, obj, *, fsync: bool = True, dir_sync: bool = True) -> str:
    # compact: json's C encoder runs only without indent (indent=1 took 74 ms for one manifest of
    # a few hundred records on rank 0, inside every save's critical path)
    return atomic_write(path, json.dumps(obj, separators=(",", ":"), allow_nan=True).encode(), fsync=fsync,
                        dir_sync=dir_sync)


def read_json(path: str, *, checksum: str | None = None):
    data = _read_verified(path, checksum)
    try:
        return json.loads(data)
    except ValueError as err:
        raise CorruptCheckpointError(f"checkpoint file {path} is not valid JSON: {err}") from err
