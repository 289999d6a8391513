"""The validators every setting and argument goes through: one line naming what is wrong.

Example::

    from phalanx.settings import choice, positive
    algorithm = choice("DataParallel(algorithm=)", algorithm, ("flat", "ring", "hierarchical", "auto"))
    bucket_mb = positive("DataParallel(bucket_mb=)", bucket_mb)
    # -> SettingsError: DataParallel(bucket_mb=)='25' is not a number; accepted: a number > 0
"""

from __future__ import annotations

import sys
from collections.abc import Collection

__all__ = ["SettingsError", "rejected", "choice", "positive", "boolean", "log_level", "one_line_errors",
           "DEFAULT_TIMEOUT_S", "ALGORITHMS", "BACKENDS", "LOG_LEVELS"]

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


def rejected(name: str, value, accepted: str, why: str = "") -> SettingsError:
    """The error for ``name=value``: ``"<name>=<value> <why>; accepted: <accepted>"``."""
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
    raise rejected(name, value, " | ".join(str(a) for a in accepted))


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
            raise rejected(name, value, accepted, f"is not {kind}") from None
    if isinstance(number, bool) or not isinstance(number, (int, float)):
        raise rejected(name, value, accepted, f"is not {kind}")
    if integer and not isinstance(number, int):
        if not float(number).is_integer():
            raise rejected(name, value, accepted, f"is not {kind}")
        number = int(number)
    if number != number or number < 0 or (number == 0 and not allow_zero) or number == float("inf"):
        raise rejected(name, value, accepted)
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
    raise rejected(name, value, "1/0, true/false, yes/no, on/off")


def _is_env_name(name: str) -> bool:
    return name.isupper() and "(" not in name


def log_level(raw: str | None) -> str:
    """PHALANX_LOG_LEVEL as a logging level name (TRACE/FATAL/WARN aliases accepted)."""
    if not raw:
        return "WARNING"
    level = raw.strip().upper()
    level = _LOG_ALIASES.get(level, level)
    return choice("PHALANX_LOG_LEVEL", level if level in LOG_LEVELS else raw, LOG_LEVELS)


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
