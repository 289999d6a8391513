"""The settings by area, each field with its variable, its ``phalanx run`` flag, its default and a line
that says what it does: the one table of every ``PHALANX_*`` variable (``python -m phalanx.settings``
prints it; docs/settings.md is that print).

A field is declared with :func:`setting`; ``Area.read(env)`` parses the area's variables from
``env`` (default ``os.environ``), ``Area.one(name, env)`` one of them; each bad value is one line
naming the variable and what is accepted.

Example::

    from phalanx.settings import LauncherSettings
    hosts = LauncherSettings.read({"PHALANX_WORKER_HOSTS": "a:2,b:2"}).worker_hosts
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from phalanx.settings.checks import (
    ALGORITHMS,
    BACKENDS,
    DEFAULT_TIMEOUT_S,
    boolean,
    choice,
    log_level,
    positive,
    rejected,
)

__all__ = ["Var", "setting", "Area", "RuntimeSettings", "CommSettings", "DataParallelSettings",
           "CheckpointSettings", "ElasticSettings", "PreemptionSettings", "LauncherSettings",
           "TestingSettings", "AREAS", "parse_device"]


@dataclasses.dataclass(frozen=True)
class Var:
    """Where a field comes from: the variable, its parser ``(name, raw) -> value``, what it does,
    the ``phalanx run`` flag that exports it, and Horovod's variable read when it is unset."""

    env: str
    parse: Callable[[str, str], Any]
    doc: str
    flag: str | None = None
    horovod: tuple[str, Callable[[str, str], Any]] | None = None
    internal: bool = False  # written by the launcher for its workers, not set by users


if TYPE_CHECKING:  # torch is imported where a device is parsed, so reading settings loads no torch
    import torch


def setting(default, env: str, parse: Callable[[str, str], Any], doc: str, *, flag: str | None = None,
            horovod: tuple[str, Callable[[str, str], Any]] | None = None, internal: bool = False):
    """A dataclass field read from ``env`` (``default`` when unset or empty)."""
    return dataclasses.field(default=default, metadata={"var": Var(env, parse, doc, flag, horovod, internal)})


# ---------------------------------------------------------------- parsers: (name, raw string) -> value
def _text(name: str, raw: str) -> str:
    return raw


def _flag(name: str, raw: str) -> bool:
    return boolean(name, raw)


def _seconds(name: str, raw: str) -> float:
    return float(positive(name, raw))


def _count(name: str, raw: str) -> int:
    return int(positive(name, raw, integer=True, allow_zero=True))


def _names(name: str, raw: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in raw.split(",") if part.strip())


def _megabytes(name: str, raw: str) -> tuple[float, ...]:
    try:
        values = tuple(float(v) for v in raw.split(","))
    except ValueError:
        raise rejected(name, raw, "megabytes, comma separated (1,4,16)") from None
    for v in values:
        positive(name, v)
    return values


def _one_of(*accepted: str, lower: bool = False) -> Callable[[str, str], str]:
    def parse(name: str, raw: str) -> str:
        return choice(name, raw.strip().lower() if lower else raw, accepted)
    return parse


def _hvd_fusion_mb(name: str, raw: str) -> float:  # HOROVOD_FUSION_THRESHOLD is in bytes
    return float(positive(name, raw)) * 2.0**-20


def _hvd_hierarchical(name: str, raw: str) -> str | None:  # as Horovod reads it: anything but 0 is on
    return "hierarchical" if raw not in ("0", "") else None


def _hvd_on(name: str, raw: str) -> bool:  # Horovod's HOROVOD_AUTOTUNE: 1 / true / yes
    return raw.lower() in ("1", "true", "yes")


def parse_device(name: str, value) -> torch.device:
    """A device phalanx can run on, on this machine: ``cpu``, ``cuda`` or ``cuda:N`` with N < GPUs."""
    import torch  # here, not at the top: the launcher's exec shim reads settings without loading torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    accepted = "cpu" + (f" | cuda | cuda:0..{gpus - 1}" if gpus else " (no CUDA device on this machine)")
    try:
        dev = value if isinstance(value, torch.device) else torch.device(value)
    except (RuntimeError, TypeError, ValueError):
        raise rejected(name, value, accepted, "is not a device") from None
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise rejected(name, value, accepted, f"is a {dev.type} device, which phalanx does not run on")
    if not gpus:
        raise rejected(name, value, accepted, "needs CUDA, which this machine does not have")
    if dev.index is not None and dev.index >= gpus:
        raise rejected(name, value, accepted, f"names GPU {dev.index} but this machine has {gpus}")
    return dev


class Area:
    """Base of the area dataclasses: :meth:`read` fills one from an environment."""

    @classmethod
    def read(cls, env: Mapping[str, str] | None = None):
        """The area's fields from ``env`` (``os.environ`` by default), each checked."""
        env = os.environ if env is None else env
        return cls(**{f.name: cls.one(f.name, env) for f in dataclasses.fields(cls)})

    @classmethod
    def one(cls, name: str, env: Mapping[str, str] | None = None):
        """One field from ``env`` (``os.environ`` by default), checked; its default when unset."""
        env = os.environ if env is None else env
        f = cls.__dataclass_fields__[name]
        var: Var = f.metadata["var"]
        raw = env.get(var.env)
        if raw:
            return var.parse(var.env, raw)
        if var.horovod is not None and env.get(var.horovod[0]):
            picked = var.horovod[1](var.horovod[0], env[var.horovod[0]])
            if picked is not None:
                return picked
        return f.default

    @classmethod
    def variables(cls) -> dict[str, Var]:
        """field name -> its :class:`Var`."""
        return {f.name: f.metadata["var"] for f in dataclasses.fields(cls)}


@dataclasses.dataclass(frozen=True)
class RuntimeSettings(Area):
    """Joining the job: backend, device, timeouts, logging, and what the launcher tells a worker."""

    backend: str | None = setting(None, "PHALANX_BACKEND", _one_of(*BACKENDS, lower=True),
                                  "collective backend; unset: NCCL with CUDA, else gloo")
    device: torch.device | None = setting(None, "PHALANX_DEVICE", parse_device,
                                          "this rank's device; unset: cuda:local_rank with CUDA, else cpu")
    timeout_s: float = setting(DEFAULT_TIMEOUT_S, "PHALANX_TIMEOUT", _seconds,
                               "seconds a collective waits for its peers before it raises", flag="--timeout")
    log_level: str = setting("WARNING", "PHALANX_LOG_LEVEL", lambda name, raw: log_level(raw),
                             "library log level (lines carry [rank N])", flag="--log-level / --verbose")
    launcher: str | None = setting(None, "PHALANX_LAUNCHER", _text,
                                   "which phalanx launcher started this process (run, spawn)", internal=True)
    spawn_preload: tuple[str, ...] = setting((), "PHALANX_SPAWN_PRELOAD", _names,
                                             "more modules px.run's fork server imports (comma list)")
    secret_file: str | None = setting(None, "PHALANX_SECRET_FILE", _text,
                                      "file with the job's secret (mode 600): keys stores and frames",
                                      internal=True)
    heartbeat_s: float | None = setting(None, "PHALANX_HEARTBEAT_S", _seconds,
                                        "seconds between a rank's heartbeats to the launcher", internal=True)
    heartbeat_store: str = setting("", "PHALANX_HEARTBEAT_STORE", _text,
                                   "host:port of the launcher's store the heartbeats go to", internal=True)
    stack_dir: str | None = setting(None, "PHALANX_STACK_DIR", _text,
                                    "where a rank writes its Python stack when asked (stall reports)",
                                    internal=True)


@dataclasses.dataclass(frozen=True)
class CommSettings(Area):
    """Collectives and codecs."""

    check_collectives: bool = setting(True, "PHALANX_CHECK_COLLECTIVES", _flag,
                                      "the cross-rank check before each collective (1/0, true/false, yes/no, "
                                      "on/off)")
    compile_codecs: bool = setting(True, "PHALANX_COMPILE_CODECS", _flag,
                                   "compile the lossy codecs' kernels on CUDA (torch.compile)")


@dataclasses.dataclass(frozen=True)
class DataParallelSettings(Area):
    """The gradient engine's job-wide defaults and bucket autotuning."""

    bucket_mb: float | None = setting(None, "PHALANX_BUCKET_MB", _seconds,
                                      "gradient bucket size in MB; unset: 25", flag="--fusion-threshold-mb",
                                      horovod=("HOROVOD_FUSION_THRESHOLD", _hvd_fusion_mb))
    algorithm: str | None = setting(None, "PHALANX_ALGORITHM", _one_of(*ALGORITHMS),
                                    "allreduce algorithm; unset: flat", flag="--hierarchical-allreduce",
                                    horovod=("HOROVOD_HIERARCHICAL_ALLREDUCE", _hvd_hierarchical))
    autotune: bool = setting(False, "PHALANX_AUTOTUNE", _hvd_on, "tune the bucket size while training",
                             flag="--autotune", horovod=("HOROVOD_AUTOTUNE", _hvd_on))
    autotune_log: str | None = setting(None, "PHALANX_AUTOTUNE_LOG", _text, "CSV of the tuner's trials",
                                       flag="--autotune-log-file", horovod=("HOROVOD_AUTOTUNE_LOG", _text))
    autotune_buckets_mb: tuple[float, ...] | None = setting(None, "PHALANX_AUTOTUNE_BUCKETS_MB", _megabytes,
                                                            "bucket sizes the tuner tries (comma list)")
    autotune_warmup_steps: int = setting(3, "PHALANX_AUTOTUNE_WARMUP_STEPS", _count,
                                         "steps before the tuner starts timing")
    autotune_steps_per_trial: int = setting(5, "PHALANX_AUTOTUNE_STEPS_PER_TRIAL", _count,
                                            "steps timed for each candidate")
    autotune_rounds: int = setting(2, "PHALANX_AUTOTUNE_ROUNDS", _count, "passes per halving stage")
    autotune_settle_steps: int = setting(1, "PHALANX_AUTOTUNE_SETTLE_STEPS", _count,
                                         "steps dropped after each switch")


@dataclasses.dataclass(frozen=True)
class CheckpointSettings(Area):
    """Checkpoint files and resuming."""

    checksum: str | None = setting(None, "PHALANX_CHECKPOINT_CHECKSUM", _one_of("xxh3", "crc32", "sha256"),
                                   "checksum of checkpoint files; unset: xxh3 where the xxhash package is "
                                   "installed, else crc32")
    format: str | None = setting(None, "PHALANX_CHECKPOINT_FORMAT", _one_of("safetensors", "torch"),
                                 "force a file format; unset: safetensors where the dtypes allow")
    resume_from: str | None = setting(None, "PHALANX_RESUME_FROM", _text,
                                      "checkpoint directory a restarted job resumes from", flag="--resume-from")
    crash_at: str | None = setting(None, "PHALANX_CKPT_CRASH", _text,
                                   "tests: crash a save at '<where>:<rank>'", internal=True)


@dataclasses.dataclass(frozen=True)
class ElasticSettings(Area):
    """Elastic jobs: what the supervisor tells a worker, and the waits of a re-form."""

    store: str | None = setting(None, "PHALANX_ELASTIC_STORE", _text, "host:port of the launcher's store",
                                internal=True)
    worker_id: str | None = setting(None, "PHALANX_ELASTIC_WID", _text,
                                    "this worker's id for the life of the job (w0, w1, ...)", internal=True)
    join: bool = setting(False, "PHALANX_ELASTIC_JOIN", lambda name, raw: raw == "1",
                         "1: started mid-run, joins at the next commit", internal=True)
    generation: int = setting(0, "PHALANX_ELASTIC_GEN", _count, "the generation the worker was started in",
                              internal=True)
    reform_timeout_s: float | None = setting(None, "PHALANX_ELASTIC_REFORM_TIMEOUT", _seconds,
                                             "seconds a re-form may take; unset: the collective timeout + 30")
    form_timeout_s: float = setting(30.0, "PHALANX_ELASTIC_FORM_TIMEOUT", _seconds,
                                    "seconds the first group may take to form")
    join_timeout_s: float = setting(600.0, "PHALANX_ELASTIC_JOIN_TIMEOUT", _seconds,
                                    "seconds a joining worker waits for the next commit")
    spare: bool = setting(False, "PHALANX_ELASTIC_SPARE", _flag,
                          "in-process elastic: keep one worker process ready, its imports done, to replace a "
                          "lost worker on this machine (seconds sooner back at full size; one more process)")
    heartbeat_timeout_s: float = setting(3.0, "PHALANX_HEARTBEAT_TIMEOUT", _seconds,
                                         "in-process elastic: a worker whose heartbeat stopped this long (a frozen "
                                         "or stopped process) is lost: killed, and the others re-form",
                                         flag="--heartbeat-timeout")
    commit_dir: str | None = setting(None, "PHALANX_ELASTIC_DIR", _text,
                                     "where an elastic state writes its commits; unset: --resume-from, else "
                                     "/dev/shm/phalanx-elastic-<run id>")
    discovery_script: str | None = setting(None, "PHALANX_HOST_DISCOVERY_SCRIPT", _text,
                                           "the script that lists the hosts", flag="--host-discovery-script")
    max_restarts: int | None = setting(None, "PHALANX_MAX_RESTARTS", _count,
                                       "group restarts allowed", flag="--max-restarts")


@dataclasses.dataclass(frozen=True)
class PreemptionSettings(Area):
    """Checkpoint-and-exit on a signal."""

    signals: tuple[str, ...] = setting((), "PHALANX_PREEMPT_SIGNAL", _names,
                                       "more signals that mean 'preempted' (besides SIGTERM)",
                                       flag="--preempt-signal")
    mark: str | None = setting(None, "PHALANX_PREEMPT_MARK", _text,
                               "file whose presence tells the ranks a preemption is under way", internal=True)
    requeue: str = setting("auto", "PHALANX_REQUEUE", _one_of("auto", "1", "0", "yes", "no", "true", "false",
                                                              lower=True),
                           "requeue the SLURM job after a preemption", flag="--requeue / --no-requeue")


@dataclasses.dataclass(frozen=True)
class LauncherSettings(Area):
    """What ``phalanx run`` exports to the workers it starts."""

    worker_hosts: str | None = setting(None, "PHALANX_WORKER_HOSTS", _text,
                                       "every host and its slots (TF_CONFIG's worker list)", internal=True)
    host_index: int | None = setting(None, "PHALANX_HOST_INDEX", _count,
                                     "this worker's host in PHALANX_WORKER_HOSTS", internal=True)
    tf_port: int | None = setting(None, "PHALANX_TF_PORT", _count,
                                  "first port of tf.distribute's workers; unset: MASTER_PORT + 1")
    num_servers: int = setting(1, "PHALANX_NUM_SERVERS", _count, "parameter servers", flag="--servers")
    timeline: str | None = setting(None, "PHALANX_TIMELINE", _text, "Chrome-trace timeline file",
                                   flag="--timeline")


@dataclasses.dataclass(frozen=True)
class TestingSettings(Area):
    """phalanx's own test suite."""

    __test__ = False  # not a pytest class

    test_device: str = setting("cpu", "PHALANX_TEST_DEVICE", _one_of("cpu", "cuda"),
                               "the device the suite's rank bodies compute on")


AREAS: dict[str, type[Area]] = {
    "runtime": RuntimeSettings, "comm": CommSettings, "data_parallel": DataParallelSettings,
    "checkpoint": CheckpointSettings, "elastic": ElasticSettings, "preemption": PreemptionSettings,
    "launcher": LauncherSettings, "testing": TestingSettings,
}
"""Area name (an attribute of :class:`~phalanx.settings.Settings`) -> its dataclass."""
