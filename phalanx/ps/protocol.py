"""Wire protocol of the parameter server: message tags and framing on c10d point-to-point.

Every message is a *frame* sent with ``torch.distributed`` ``isend``/``irecv``
and a tag per message kind; there is no socket code here. A frame is::

    header  int64[6]   [op, clock, version, meta_len, n_tensors, arg]     tag REQ (to server) / REPLY
    meta    uint8[..]  [mac(32)] JSON {"s": single, "t": [[dtype, shape]…], "c": ctx} tag DATA / REPLY_DATA
                       (left out when it equals the last meta on this link: meta_len = 0)
    tensors ...        the compressor's payload (one or more tensors)     tag DATA / REPLY_DATA

Tags keep request headers (which a server receives from *any* worker) apart
from the payloads that follow them on the same pair of ranks. The meta of a
link (one peer, one direction) rarely changes -- same shard, same compressor --
so each side keeps the last one in a :class:`MetaCache` and a steady-state frame
is two messages, header and payload. Each message costs a post, a wait and on
a busy host a context switch, which is what bounds a server's request rate.

The meta is data only: JSON of numbers, strings, lists, and two tagged forms
(``{"dtype": "float32"}``, ``{"tuple": [...]}``) for what compressor contexts hold;
decoding it cannot run code, unlike the pickle it replaced. With a job key
(``MetaCache(key=...)``, e.g. the job secret) every meta carries an HMAC-SHA256 of
its bytes, checked in constant time *before* anything is decoded: a frame from a
sender without the key is refused unread (:class:`PSAuthError`).

Every wait has a deadline: a peer that died or stopped answering raises
:class:`PSTimeoutError` or :class:`PSPeerError` naming the rank and its role
instead of hanging.

Example::

    from phalanx.ps.protocol import MetaCache, Op, send_frame, recv_frame
    cache = MetaCache()
    send_frame(dst=0, op=Op.PUSH, clock=3, tensor=grad_flat, compressor=c, cache=cache, timeout_s=60)
    header, flat, nbytes = recv_frame(src=1, compressor=c, cache=cache, timeout_s=60, reply=True)
"""

from __future__ import annotations

import datetime
import enum
import hashlib
import hmac
import json

import torch
import torch.distributed as dist

from phalanx.comm.compression.error_feedback import ErrorFeedback

__all__ = [
    "Op",
    "TAG_REQ",
    "TAG_DATA",
    "TAG_REPLY",
    "TAG_REPLY_DATA",
    "HEADER_LEN",
    "PSError",
    "PSTimeoutError",
    "PSPeerError",
    "PSAuthError",
    "send_frame",
    "recv_header",
    "recv_body",
    "recv_frame",
    "wait_work",
    "MetaCache",
    "pack",
    "encode_meta",
    "decode_meta",
    "sign_meta",
]

# Tags well above anything user code is likely to use on the same pairs.
TAG_REQ = 7101
TAG_DATA = 7102
TAG_REPLY = 7103
TAG_REPLY_DATA = 7104
HEADER_LEN = 7  # op, clock, version, meta bytes, tensors, arg, replies read (see Op)


class Op(enum.IntEnum):
    """What a frame asks for (worker -> server) or answers (server -> worker)."""

    PULL = 1  # worker wants the shard; clock = pushes it has done
    PUSH = 2  # gradient for the shard; version = shard version it was computed on;
    #           arg = 1: also a PULL at clock + 1 (saves the worker's next request)
    DONE = 3  # worker leaves; the server stops counting it for sync / SSP
    PARAMS = 4  # server's answer to PULL; version = shard version sent
    # Every worker -> server frame also carries in its last field how many PARAMS replies the
    # worker has read from that server so far: the server then waits on (and frees) the sends of
    # those replies. gloo reports a send complete only once it is waited on, so without this the
    # server could not tell a delivered reply from one in flight and kept every one alive.


class PSError(RuntimeError):
    """A parameter-server protocol failure (bad message, dead or silent peer)."""


class PSTimeoutError(PSError):
    """A peer did not answer within the timeout."""


class PSPeerError(PSError):
    """The transport reported the peer gone (connection closed: it crashed or exited)."""


class PSAuthError(PSError):
    """A frame's meta did not carry a valid HMAC under the link's key; it was refused undecoded."""


_MAC_BYTES = 32


def _to_data(v):
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, torch.dtype):
        return {"dtype": str(v).replace("torch.", "")}
    if isinstance(v, tuple):
        return {"tuple": [_to_data(x) for x in v]}
    if isinstance(v, list):
        return [_to_data(x) for x in v]
    if isinstance(v, torch.Size):
        return {"tuple": list(v)}
    raise TypeError(f"parameter-server frame meta: cannot encode a {type(v).__name__} (a compressor context may "
                    "hold numbers, strings, None, dtypes and tuples/lists of them)")


def _from_data(v):
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, list):
        return [_from_data(x) for x in v]
    if isinstance(v, dict) and len(v) == 1:
        if isinstance(v.get("tuple"), list):
            return tuple(_from_data(x) for x in v["tuple"])
        dtype = getattr(torch, v["dtype"], None) if isinstance(v.get("dtype"), str) else None
        if isinstance(dtype, torch.dtype):
            return dtype
    raise PSError(f"frame meta: unexpected value {str(v)[:80]!r}")


def encode_meta(single: bool, tensors: list[torch.Tensor], ctx, key: bytes | None = None) -> bytes:
    """The frame meta as data-only JSON bytes, prefixed by its HMAC-SHA256 under ``key`` when there is one."""
    body = json.dumps({"s": bool(single), "t": [[str(t.dtype).replace("torch.", ""), list(t.shape)] for t in tensors],
                       "c": _to_data(ctx)}, separators=(",", ":")).encode()
    return sign_meta(body, key) if key else body


def sign_meta(body: bytes, key: bytes) -> bytes:
    """``HMAC-SHA256(key, body) + body``."""
    return hmac.new(key, body, hashlib.sha256).digest() + body


def decode_meta(blob: bytes, key: bytes | None = None, what: str = "frame") -> tuple:
    """``(single, [(dtype, shape)…], ctx)`` from :func:`encode_meta`'s bytes.

    With ``key``, the HMAC is checked (constant time) before a byte is decoded; a
    missing or wrong one raises :class:`PSAuthError`.
    """
    if key:
        mac, blob = blob[:_MAC_BYTES], blob[_MAC_BYTES:]
        if len(mac) != _MAC_BYTES or not hmac.compare_digest(hmac.new(key, blob, hashlib.sha256).digest(), mac):
            raise PSAuthError(f"{what}: refused a frame with a bad or missing HMAC (the sender does not hold "
                              "this link's key)")
    try:
        raw = json.loads(blob)
        specs = [(_from_data({"dtype": d}), tuple(int(x) for x in shape)) for d, shape in raw["t"]]
        return bool(raw["s"]), specs, _from_data(raw["c"])
    except (ValueError, KeyError, TypeError) as err:
        raise PSError(f"{what}: malformed frame meta ({err})") from None


def _translate(err: RuntimeError, timeout_s: float, what: str) -> PSError:
    text = str(err)
    if "timed out" in text.lower() or "timeout" in text.lower():
        return PSTimeoutError(
            f"{what}: no answer within {timeout_s:g}s — the peer is dead, stuck, or much slower "
            "than the timeout (raise timeout= or PHALANX_TIMEOUT if it is merely slow)"
        )
    if "closed" in text.lower() or "reset" in text.lower() or "crash" in text.lower():
        return PSPeerError(f"{what}: the peer is gone — it crashed or exited ({text.splitlines()[0][:160]})")
    return PSError(f"{what}: {text[:300]}")


def wait_work(work, timeout_s: float, what: str) -> None:
    """Wait for one c10d work with a deadline; translate transport errors into PS errors."""
    try:
        work.wait(timeout=datetime.timedelta(seconds=timeout_s))
    except RuntimeError as err:
        raise _translate(err, timeout_s, what) from err


def _post(fn, tensor: torch.Tensor, peer: int | None, tag: int, timeout_s: float, what: str):
    """``dist.isend`` / ``dist.irecv`` that reports a dead peer as a PS error (posting can fail too)."""
    try:
        return fn(tensor, peer, tag=tag)
    except RuntimeError as err:
        raise _translate(err, timeout_s, what) from err


class MetaCache:
    """The last meta sent to and received from each peer, so an unchanged one is not resent.

    Both ends of a link must use one cache for the life of the link (one session).
    ``key``: bytes both ends hold (e.g. the job secret); metas are then signed and
    checked (:func:`decode_meta`). ``None``: unsigned (still data only).
    """

    def __init__(self, key: bytes | None = None) -> None:
        self.key = key
        self.sent: dict[int, bytes] = {}
        self.received: dict[int, tuple] = {}


def pack(tensor: torch.Tensor, compressor, key: str = "default") -> tuple[list[torch.Tensor], bytes]:
    """Compress ``tensor`` into the payload tensors and the data-only meta of a frame (signed when sent)."""
    # error feedback keeps one residual per key: one per link, never shared by two shards
    payload, ctx = (compressor.compress(tensor, key) if isinstance(compressor, ErrorFeedback)
                    else compressor.compress(tensor))
    single = isinstance(payload, torch.Tensor)
    tensors = [payload] if single else list(payload)
    tensors = [t.contiguous() for t in tensors]
    return tensors, encode_meta(single, tensors, ctx)


def send_frame(
    dst: int,
    op: Op,
    *,
    clock: int = 0,
    version: int = 0,
    arg: int = 0,
    tensor: torch.Tensor | None = None,
    compressor=None,
    reply: bool = False,
    cache: MetaCache | None = None,
    packed: tuple[list[torch.Tensor], bytes] | None = None,
    timeout_s: float = 300.0,
    what: str = "send",
    wait: bool = True,
    read: int = 0,
):
    """Send one frame; returns ``(works, bytes_sent)``. With ``wait=False`` the caller
    keeps ``works`` (and so the buffers) alive and waits on them later. ``packed`` is
    the output of :func:`pack` when one payload goes to many peers (compressed once).
    ``read``: replies the sender has read from ``dst`` so far (worker -> server frames)."""
    tag_head, tag_data = (TAG_REPLY, TAG_REPLY_DATA) if reply else (TAG_REQ, TAG_DATA)
    if packed is None and tensor is not None:
        packed = pack(tensor, compressor, f"{'reply' if reply else 'req'}{dst}")
    tensors, meta = packed if packed is not None else ([], b"")
    if meta and cache is not None and cache.key:
        meta = sign_meta(meta, cache.key)
    if cache is not None and tensors and cache.sent.get(dst) == meta:
        meta = b""  # the receiver still has it
    elif cache is not None and tensors:
        cache.sent[dst] = meta
    header = torch.tensor([int(op), clock, version, len(meta), len(tensors), arg, read], dtype=torch.int64)
    bufs = [header]
    if meta:
        bufs.append(torch.frombuffer(bytearray(meta), dtype=torch.uint8))
    bufs.extend(tensors)
    works = []
    for i, buf in enumerate(bufs):
        work = _post(dist.isend, buf, dst, tag_head if i == 0 else tag_data, timeout_s, what)
        works.append((work, buf))
    if wait:
        for work, _ in works:
            wait_work(work, timeout_s, what)
    nbytes = sum(b.numel() * b.element_size() for b in bufs)
    return works, nbytes


def recv_header(src: int | None, *, reply: bool, timeout_s: float, what: str) -> tuple[list[int], int]:
    """Receive a header (from ``src``, or from any rank when ``src`` is None); returns (fields, sender)."""
    header = torch.empty(HEADER_LEN, dtype=torch.int64)
    work = _post(dist.irecv, header, src, TAG_REPLY if reply else TAG_REQ, timeout_s, what)
    wait_work(work, timeout_s, what)
    sender = src if src is not None else work._source_rank()
    return header.tolist(), sender


def recv_body(src: int, header: list[int], compressor, *, reply: bool, timeout_s: float, what: str,
              cache: MetaCache | None = None):
    """Receive the meta and tensors announced by ``header``; returns (tensor or None, bytes)."""
    meta_len, n_tensors = header[3], header[4]
    if n_tensors == 0:
        return None, HEADER_LEN * 8
    tag = TAG_REPLY_DATA if reply else TAG_DATA
    if meta_len:
        meta_buf = torch.empty(meta_len, dtype=torch.uint8)
        wait_work(_post(dist.irecv, meta_buf, src, tag, timeout_s, what), timeout_s, what)
        meta = decode_meta(meta_buf.numpy().tobytes(), cache.key if cache is not None else None, what)
        if cache is not None:
            cache.received[src] = meta
    elif cache is not None and src in cache.received:
        meta = cache.received[src]
    else:
        raise PSError(f"{what}: rank {src} left out the frame's meta but none was received before "
                      "(both ends of a link must use a MetaCache)")
    single, specs, ctx = meta
    if len(specs) != n_tensors:
        raise PSError(f"{what}: header announced {n_tensors} tensors but meta lists {len(specs)}")
    tensors = [torch.empty(shape, dtype=dtype) for dtype, shape in specs]
    works = [_post(dist.irecv, t, src, tag, timeout_s, what) for t in tensors]  # post all, then wait
    for work in works:
        wait_work(work, timeout_s, what)
    payload = tensors[0] if single else tuple(tensors)
    nbytes = HEADER_LEN * 8 + meta_len + sum(t.numel() * t.element_size() for t in tensors)
    return compressor.decompress(payload, ctx), nbytes


def recv_frame(src: int, compressor, *, reply: bool, timeout_s: float, what: str, cache: MetaCache | None = None):
    """Header and body from ``src`` in one call: ``(header, tensor or None, bytes)``."""
    header, _ = recv_header(src, reply=reply, timeout_s=timeout_s, what=what)
    tensor, nbytes = recv_body(src, header, compressor, reply=reply, timeout_s=timeout_s, what=what, cache=cache)
    return header, tensor, nbytes
