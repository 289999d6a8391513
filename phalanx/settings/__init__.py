"""The job's settings: every ``PHALANX_*`` variable and ``init()`` argument, read and checked in one place.

One dataclass per area (:mod:`phalanx.settings.areas`: runtime, comm, data parallel, checkpoint,
elastic, preemption, launcher, testing), each field declared with its variable, its ``phalanx
run`` flag, its default and what it does; ``python -m phalanx.settings`` prints that table
(docs/settings.md). Nothing else in phalanx reads a ``PHALANX_*`` variable: ``init()`` calls
:func:`load` and keeps the result (``phalanx.runtime.current_settings()``); code that runs without
``init()`` reads :func:`current`, or ``Area.read(env)`` for an environment it was handed. The
launcher writes the variables for its workers, by the names :func:`var` gives.

A bad value stops the job at start-up with one line that names the variable (or argument), the
value and what is accepted, instead of a torch assertion at the first collective. An uncaught
:class:`SettingsError` prints only that line (no traceback) under ``python script.py`` and
``phalanx run``.

Example::

    from phalanx import settings
    s = settings.load({"PHALANX_TIMEOUT": "60"})
    assert s.runtime.timeout_s == 60.0
    settings.var("elastic.store")          # 'PHALANX_ELASTIC_STORE': the name the launcher writes
    algorithm = settings.choice("DataParallel(algorithm=)", "rign", settings.ALGORITHMS)
    # -> SettingsError: DataParallel(algorithm=)='rign' is not accepted; accepted: auto | ring | ...
"""

from __future__ import annotations

import dataclasses
import datetime
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

from phalanx.settings.areas import (
    AREAS,
    Area,
    CheckpointSettings,
    CommSettings,
    DataParallelSettings,
    ElasticSettings,
    LauncherSettings,
    PreemptionSettings,
    RuntimeSettings,
    TestingSettings,
    Var,
    parse_device,
)
from phalanx.settings.checks import (
    ALGORITHMS,
    BACKENDS,
    DEFAULT_TIMEOUT_S,
    LOG_LEVELS,
    SettingsError,
    boolean,
    choice,
    log_level,
    one_line_errors,
    positive,
    rejected,
)

if TYPE_CHECKING:  # only for annotations: reading settings loads no torch (the exec shim reads them)
    import torch

__all__ = [
    "SettingsError", "Settings", "load", "current", "var", "table",
    "choice", "positive", "boolean", "log_level", "rejected", "one_line_errors",
    "DEFAULT_TIMEOUT_S", "ALGORITHMS", "BACKENDS", "LOG_LEVELS",
    "Area", "Var", "RuntimeSettings", "CommSettings", "DataParallelSettings", "CheckpointSettings",
    "ElasticSettings", "PreemptionSettings", "LauncherSettings", "TestingSettings",
]


@dataclasses.dataclass(frozen=True)
class Settings:
    """Every area's settings, validated. ``None`` in a field means "choose for this machine"."""

    runtime: RuntimeSettings = dataclasses.field(default_factory=RuntimeSettings)
    comm: CommSettings = dataclasses.field(default_factory=CommSettings)
    data_parallel: DataParallelSettings = dataclasses.field(default_factory=DataParallelSettings)
    checkpoint: CheckpointSettings = dataclasses.field(default_factory=CheckpointSettings)
    elastic: ElasticSettings = dataclasses.field(default_factory=ElasticSettings)
    preemption: PreemptionSettings = dataclasses.field(default_factory=PreemptionSettings)
    launcher: LauncherSettings = dataclasses.field(default_factory=LauncherSettings)
    testing: TestingSettings = dataclasses.field(default_factory=TestingSettings)


def load(
    env: Mapping[str, str] | None = None,
    *,
    backend: str | None = None,
    device: str | torch.device | None = None,
    timeout: float | datetime.timedelta | None = None,
) -> Settings:
    """Read and check every setting; raise :class:`SettingsError` at the first bad one. An
    ``init()`` argument wins over its variable.

    Example::

        s = load({"PHALANX_TIMEOUT": "60"})
        assert s.runtime.timeout_s == 60.0
    """
    env = os.environ if env is None else env
    areas = {name: cls.read(env) for name, cls in AREAS.items()}
    runtime = areas["runtime"]
    if backend is not None:
        runtime = dataclasses.replace(runtime, backend=choice("init(backend=)", backend, BACKENDS))
    if device is not None:
        runtime = dataclasses.replace(runtime, device=parse_device("init(device=)", device))
    if timeout is not None:
        runtime = dataclasses.replace(runtime, timeout_s=_timeout(timeout))
    areas["runtime"] = runtime
    return Settings(**areas)


def _timeout(timeout) -> float:
    if isinstance(timeout, datetime.timedelta):
        timeout = timeout.total_seconds()
        if timeout <= 0:
            raise rejected("init(timeout=)", timeout, "a number of seconds > 0")
    return float(positive("init(timeout=)", timeout))


_cached: tuple[tuple, Settings] | None = None


def current() -> Settings:
    """The settings of this process's environment, read again only when a ``PHALANX_*`` or
    ``HOROVOD_*`` variable changed (``init()`` keeps its own: ``phalanx.runtime.current_settings``)."""
    global _cached
    key = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith(("PHALANX_", "HOROVOD_"))))
    if _cached is None or _cached[0] != key:
        _cached = (key, load())
    return _cached[1]


def var(path: str) -> str:
    """The variable of ``"area.field"``: ``var("elastic.store") == "PHALANX_ELASTIC_STORE"``."""
    area, _, field = path.partition(".")
    try:
        return AREAS[area].variables()[field].env
    except KeyError:
        raise KeyError(f"no setting {path!r}; areas: {', '.join(AREAS)}") from None


def table() -> list[tuple[str, str, str, str, str, str]]:
    """``(area.field, variable, phalanx run flag, default, who sets it, what it does)`` for every
    setting, in declaration order: the table of docs/settings.md."""
    rows = []
    for area, cls in AREAS.items():
        for f in dataclasses.fields(cls):
            v: Var = f.metadata["var"]
            default = "unset" if f.default is None else ("(none)" if f.default == () else repr(f.default))
            if v.horovod:
                default += f" (or {v.horovod[0]})"
            rows.append((f"{area}.{f.name}", v.env, v.flag or "", default,
                         "the launcher" if v.internal else "you", v.doc))
    return rows
