"""The job's settings: environment variables and ``init()`` arguments, read and checked once.

``init()`` calls :func:`load`, so a bad value stops the job at start-up with one line that
names the variable (or argument), the value and what is accepted, instead of a torch
assertion at the first collective. An uncaught :class:`SettingsError` prints only that line
(no traceback) under ``python script.py`` and ``phalanx run``.

Read by :func:`load` (an ``init()`` argument wins over its variable)::

    PHALANX_BACKEND            init(backend=)   gloo | nccl
    PHALANX_DEVICE             init(device=)    cpu | cuda | cuda:N (N < number of GPUs)
    PHALANX_TIMEOUT            init(timeout=)   seconds > 0 (default 300)
    PHALANX_LOG_LEVEL                           DEBUG | INFO | WARNING | ERROR | CRITICAL
    PHALANX_CHECK_COLLECTIVES                   1/0, true/false, yes/no, on/off
    PHALANX_BUCKET_MB                           megabytes > 0
    PHALANX_ALGORITHM                           auto | ring | hierarchical | flat
    PHALANX_CHECKPOINT_CHECKSUM                 crc32 | sha256
    PHALANX_CHECKPOINT_FORMAT                   safetensors | torch
    PHALANX_COMPILE_CODECS                      1/0, true/false, yes/no, on/off (default on)

The validators are public so that constructors can check their arguments the same way::

    from phalanx import settings
    algorithm = settings.choice("DataParallel(algorithm=)", algorithm, ("flat", "ring", "hierarchical", "auto"))
    bucket_mb = settings.positive("DataParallel(bucket_mb=)", bucket_mb)
    # -> SettingsError: DataParallel(bucket_mb=)='25' is not a number; accepted: a number > 0
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import sys
from collections.abc import Collection, Mapping

import torch

__all__ = [
    "SettingsError",
    "Settings",
    "load",
    "choice",
    "positive",
    "boolean",
    "DEFAULT_TIMEOUT_S",
    "ALGORITHMS",
    "BACKENDS",
    "LOG_LEVELS",
]

DEFAULT_TIMEOUT_S = 300.0
"""Collective timeout when neither ``init(timeout=…)`` nor PHALANX_TIMEOUT says otherwise."""

BACKENDS = ("gloo", "nccl")
ALGORITHMS = ("auto", "ring", "hierarchical", "flat")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
_LOG_ALIASES = {"TRACE": "DEBUG", "FATAL": "CRITICAL", "WARN": "WARNING"}
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")


class SettingsError(ValueError):
    """A setting (environment variable or argument) has a value phalanx cannot use.

    The message is one line: the name, the value and the accepted values. Uncaught, it is
    printed as that line alone (see :func:`one_line_errors`).
    """

    def __init__(self, message: str) -> None:
        super().__init__(message)
        one_line_errors()


def _fail(name: str, value, accepted: str, why: str = "") -> SettingsError:
    shown = f"{name}={value!r}" if not name.endswith("=)") else f"{name[:-1]}{value!r})"
    return SettingsError(f"{shown} {why or 'is not accepted'}; accepted: {accepted}")


def choice(name: str, value, accepted: Collection, *, case_sensitive: bool = True):
    """``value`` if it is one of ``accepted``, else a :class:`SettingsError` naming ``name``.

    Example::

        op = choice("allreduce(op=)", op, ("sum", "average"))
    """
    probe = value if case_sensitive or not isinstance(value, str) else value.lower()
    pool = accepted if case_sensitive else [a.lower() if isinstance(a, str) else a for a in accepted]
    try:
        if probe in pool:
            return list(accepted)[list(pool).index(probe)]
    except TypeError:  # unhashable or incomparable value: not one of them
        pass
    raise _fail(name, value, " | ".join(str(a) for a in accepted))


def positive(name: str, value, *, integer: bool = False, allow_zero: bool = False) -> float | int:
    """``value`` as a number > 0 (``>= 0`` with ``allow_zero``; a whole number with ``integer``).

    Strings are parsed only when they come from the environment (names that look like
    ``PHALANX_X``); an argument given as ``"25"`` is refused, so a caller's type mistake is
    caught here rather than at a later comparison.

    Example::

        bucket_mb = positive("DataParallel(bucket_mb=)", bucket_mb)
        batch_size = positive("Trainer(batch_size=)", batch_size, integer=True)
    """
    kind = "a whole number" if integer else "a number"
    bound = ">= 0" if allow_zero else "> 0"
    accepted = f"{kind} {bound}"
    number = value
    if isinstance(value, str) and _is_env_name(name):
        try:
            number = int(value) if integer else float(value)
        except ValueError:
            raise _fail(name, value, accepted, f"is not {kind}") from None
    if isinstance(number, bool) or not isinstance(number, (int, float)):
        raise _fail(name, value, accepted, f"is not {kind}")
    if integer and not isinstance(number, int):
        if not float(number).is_integer():
            raise _fail(name, value, accepted, f"is not {kind}")
        number = int(number)
    if number != number or number < 0 or (number == 0 and not allow_zero) or number == float("inf"):
        raise _fail(name, value, accepted)
    return number


def boolean(name: str, value) -> bool:
    """``True``/``False`` from a bool or from ``1/0, true/false, yes/no, on/off`` (any case).

    Example::

        check = boolean("PHALANX_CHECK_COLLECTIVES", os.environ.get("PHALANX_CHECK_COLLECTIVES", "1"))
    """
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
        return value.strip().lower() in _TRUE
    raise _fail(name, value, "1/0, true/false, yes/no, on/off")


def _is_env_name(name: str) -> bool:
    return name.isupper() and "(" not in name


@dataclasses.dataclass(frozen=True)
class Settings:
    """Every job-wide setting, validated. ``None`` means "choose for this machine"."""

    backend: str | None = None
    """gloo or nccl; None: NCCL on a CUDA device, else gloo."""
    device: torch.device | None = None
    """This rank's compute device; None: ``cuda:local_rank`` when CUDA is present, else CPU."""
    timeout_s: float = DEFAULT_TIMEOUT_S
    """Seconds a collective waits for its peers before it raises."""
    log_level: str = "WARNING"
    """The library's log level (lines carry ``[rank N]``)."""
    check_collectives: bool = True
    """Cross-rank metadata check before each collective."""
    bucket_mb: float | None = None
    """Gradient bucket size in MB; None: the engine's default (or HOROVOD_FUSION_THRESHOLD)."""
    algorithm: str | None = None
    """Allreduce algorithm; None: flat (or hierarchical under HOROVOD_HIERARCHICAL_ALLREDUCE=1)."""
    checkpoint_checksum: str = "crc32"
    """Checksum of checkpoint files."""
    checkpoint_format: str | None = None
    """Force a checkpoint file format; None: safetensors where the dtypes allow, else torch."""
    compile_codecs: bool = True
    """Compile the lossy codecs' hot loops on CUDA (torch.compile; the first use in a process
    compiles for seconds, later runs read the kernels from TorchInductor's on-disk cache)."""


def load(
    env: Mapping[str, str] | None = None,
    *,
    backend: str | None = None,
    device: str | torch.device | None = None,
    timeout: float | datetime.timedelta | None = None,
) -> Settings:
    """Read and check every setting; raise :class:`SettingsError` at the first bad one.

    Example::

        s = load({"PHALANX_TIMEOUT": "60"})
        assert s.timeout_s == 60.0
    """
    env = os.environ if env is None else env
    return Settings(
        backend=_backend(env, backend),
        device=_device(env, device),
        timeout_s=_timeout(env, timeout),
        log_level=log_level(env.get("PHALANX_LOG_LEVEL")),
        check_collectives=boolean("PHALANX_CHECK_COLLECTIVES", env.get("PHALANX_CHECK_COLLECTIVES", "1")),
        bucket_mb=None if not env.get("PHALANX_BUCKET_MB") else
        float(positive("PHALANX_BUCKET_MB", env["PHALANX_BUCKET_MB"])),
        algorithm=None if not env.get("PHALANX_ALGORITHM") else
        choice("PHALANX_ALGORITHM", env["PHALANX_ALGORITHM"], ALGORITHMS),
        checkpoint_checksum=choice("PHALANX_CHECKPOINT_CHECKSUM",
                                   env.get("PHALANX_CHECKPOINT_CHECKSUM") or "crc32", ("crc32", "sha256")),
        checkpoint_format=None if not env.get("PHALANX_CHECKPOINT_FORMAT") else
        choice("PHALANX_CHECKPOINT_FORMAT", env["PHALANX_CHECKPOINT_FORMAT"], ("safetensors", "torch")),
        compile_codecs=boolean("PHALANX_COMPILE_CODECS", env.get("PHALANX_COMPILE_CODECS", "1")),
    )


def log_level(raw: str | None) -> str:
    """PHALANX_LOG_LEVEL as a logging level name (TRACE/FATAL/WARN aliases accepted)."""
    if not raw:
        return "WARNING"
    level = raw.strip().upper()
    level = _LOG_ALIASES.get(level, level)
    return choice("PHALANX_LOG_LEVEL", level if level in LOG_LEVELS else raw, LOG_LEVELS)


def _backend(env: Mapping[str, str], backend: str | None) -> str | None:
    if backend is not None:
        return choice("init(backend=)", backend, BACKENDS)
    raw = env.get("PHALANX_BACKEND")
    return choice("PHALANX_BACKEND", raw.lower(), BACKENDS) if raw else None


def _device(env: Mapping[str, str], device) -> torch.device | None:
    name, value = ("init(device=)", device) if device is not None else ("PHALANX_DEVICE", env.get("PHALANX_DEVICE"))
    if value is None or value == "":
        return None
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    accepted = "cpu" + (f" | cuda | cuda:0..{gpus - 1}" if gpus else " (no CUDA device on this machine)")
    try:
        dev = value if isinstance(value, torch.device) else torch.device(value)
    except (RuntimeError, TypeError, ValueError):
        raise _fail(name, value, accepted, "is not a device") from None
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise _fail(name, value, accepted, f"is a {dev.type} device, which phalanx does not run on")
    if not gpus:
        raise _fail(name, value, accepted, "needs CUDA, which this machine does not have")
    if dev.index is not None and dev.index >= gpus:
        raise _fail(name, value, accepted, f"names GPU {dev.index} but this machine has {gpus}")
    return dev


def _timeout(env: Mapping[str, str], timeout) -> float:
    if isinstance(timeout, datetime.timedelta):
        timeout = timeout.total_seconds()
        if timeout <= 0:
            raise _fail("init(timeout=)", timeout, "a number of seconds > 0")
    if timeout is not None:
        return float(positive("init(timeout=)", timeout))
    raw = env.get("PHALANX_TIMEOUT")
    if not raw:
        return DEFAULT_TIMEOUT_S
    return float(positive("PHALANX_TIMEOUT", raw))


_hook_installed = False


def one_line_errors() -> None:
    """Make an uncaught :class:`SettingsError` print ``phalanx: error: <message>`` and nothing else.

    Other exceptions go to the previous ``sys.excepthook`` unchanged. Installed the first time a
    SettingsError is made, so importing phalanx changes nothing.
    """
    global _hook_installed
    if _hook_installed:
        return
    _hook_installed = True
    previous = sys.excepthook

    def hook(exc_type, exc, tb):
        if isinstance(exc, SettingsError):
            print(f"phalanx: error: {exc}", file=sys.stderr, flush=True)
        else:
            previous(exc_type, exc, tb)

    sys.excepthook = hook
