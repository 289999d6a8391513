"""``run_study``: an Optuna study whose every trial is a k-rank phalanx job.

The driver (this process) owns the study: it asks Optuna for a trial, starts a k-rank
job for it — with :func:`phalanx.run` (``launcher="spawn"``, local ranks) or on Ray
actors with :class:`phalanx.ray.RayExecutor` (``launcher="ray"``) — and tells Optuna how
the trial ended. Inside the job, rank 0 re-opens the study from the storage and holds the
trial; every rank calls ``objective(trial, *args)`` with a :class:`DistributedTrial`, so
all follow rank 0's suggestions and pruning decisions. As many trials run at once as the
slots allow (``slots // ranks_per_trial``).

The study lives in an Optuna RDB storage, SQLite by default (``sqlite:///<study_name>.db``):
results survive a crash of the driver. ``n_trials`` counts the study's finished trials
(complete or pruned), so running the same call again after a crash runs only the rest.
The driver writes a heartbeat for each running trial; a trial left RUNNING by a driver
that died is marked FAIL when the study is next opened (``3 * heartbeat_s`` after its last
beat; SQLite keeps whole seconds, so allow one more).

Example::

    import optuna
    from phalanx.tune import run_study

    def objective(trial, epochs):                 # on every rank, phalanx already initialised
        lr = trial.suggest_float("lr", 1e-3, 1.0, log=True)
        ...
        return accuracy

    study = run_study(objective, n_trials=8, ranks_per_trial=2, args=(5,), direction="maximize",
                      pruner=optuna.pruners.MedianPruner(n_warmup_steps=1))
    print(study.best_params)
"""

from __future__ import annotations

import copy
import dataclasses
import os
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import optuna
from optuna.trial import TrialState

import phalanx.runtime as runtime
from phalanx.launcher.spawn import RankError
from phalanx.launcher.spawn import run as spawn_run
from phalanx.log import get_logger
from phalanx.tune.trial import DistributedTrial

__all__ = ["run_study", "open_storage", "trials_table"]

log = get_logger(__name__)
_FINISHED = (TrialState.COMPLETE, TrialState.PRUNED)


def open_storage(url: str, heartbeat_s: float | None = None) -> optuna.storages.RDBStorage:
    """An RDB storage that waits for SQLite's lock instead of failing when trials write at once."""
    engine = {"connect_args": {"timeout": 120}} if url.startswith("sqlite") else None
    if heartbeat_s:
        with warnings.catch_warnings():  # heartbeats are "experimental" in Optuna; we rely on them knowingly
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            return optuna.storages.RDBStorage(url, engine_kwargs=engine, heartbeat_interval=max(1, int(heartbeat_s)),
                                              grace_period=max(3, int(3 * heartbeat_s)))
    return optuna.storages.RDBStorage(url, engine_kwargs=engine)


@dataclasses.dataclass
class _Payload:
    objective: Callable[..., float]
    args: tuple
    storage_url: str
    study_name: str
    number: int
    sampler: Any
    pruner: Any


def trial_job(payload: _Payload):
    """On every rank of a trial's job (phalanx initialised): run the objective with the shared trial."""
    topo = runtime.topology()
    trial = None
    if topo.rank == 0:
        storage = open_storage(payload.storage_url)
        study = optuna.load_study(study_name=payload.study_name, storage=storage, sampler=payload.sampler,
                                  pruner=payload.pruner)
        # read the study's trials once: the study's storage cache must know this trial before it writes to it
        trial_id = next(t._trial_id for t in study.get_trials(deepcopy=False) if t.number == payload.number)
        trial = optuna.trial.Trial(study, trial_id)
    try:
        value = payload.objective(DistributedTrial(trial, topo), *payload.args)
    except optuna.TrialPruned:
        return ("pruned", None)
    return ("complete", value)


def ray_trial_job(payload: _Payload):
    """``trial_job`` on a RayExecutor's actors, which join the job first."""
    runtime.init()
    try:
        return trial_job(payload)
    finally:
        runtime.shutdown()


def run_study(objective: Callable[..., float], n_trials: int, *, ranks_per_trial: int = 2, args: Sequence = (),
              study_name: str = "phalanx-study", storage: str | None = None, direction: str = "maximize",
              sampler: optuna.samplers.BaseSampler | None = None, pruner: optuna.pruners.BasePruner | None = None,
              launcher: str = "spawn", slots: int | None = None, trial_timeout: float = 900.0,
              env: dict[str, str] | None = None, enqueue: Sequence[dict] = (), max_failures: int = 3,
              cpus_per_worker: float = 1, heartbeat_s: float = 10.0) -> optuna.Study:
    """Run the study until it has ``n_trials`` finished trials; return it (see the module docstring).

    Args:
        objective: ``objective(trial, *args) -> float``, a module-level function run on every rank.
        ranks_per_trial: k, the ranks of each trial's job.
        storage: an RDB URL (default ``sqlite:///<cwd>/<study_name>.db``).
        launcher: ``"spawn"`` (``phalanx.run``, this host) or ``"ray"`` (RayExecutor; ``ray.init()`` first).
        slots: ranks that may run at once (default: this host's cores, or the Ray cluster's CPUs).
        enqueue: parameter dicts to try first (``study.enqueue_trial``), e.g. the current defaults.
        max_failures: failed trials (a rank raised) tolerated in this call before it raises.
    """
    if ranks_per_trial < 1:
        raise ValueError(f"run_study: ranks_per_trial must be >= 1, got {ranks_per_trial}")
    if launcher not in ("spawn", "ray"):
        raise ValueError(f"run_study: launcher must be 'spawn' or 'ray', got {launcher!r}")
    storage_url = storage or f"sqlite:///{os.path.abspath(study_name + '.db')}"
    store = open_storage(storage_url, heartbeat_s)
    study = optuna.create_study(study_name=study_name, storage=store, direction=direction, sampler=sampler,
                                pruner=pruner, load_if_exists=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        optuna.storages.fail_stale_trials(study)  # trials a crashed driver left RUNNING
    for params in enqueue:
        study.enqueue_trial(params, skip_if_exists=True)
    slots = slots or _default_slots(launcher, cpus_per_worker)
    parallel = max(1, slots // ranks_per_trial)
    finished = sum(1 for t in study.get_trials(deepcopy=False) if t.state in _FINISHED)
    driver = _Driver(study, store, storage_url, n_trials - finished, dict(
        objective=objective, args=tuple(args), ranks=ranks_per_trial, launcher=launcher, timeout=trial_timeout,
        env=dict(env or {}), sampler=study.sampler, pruner=study.pruner, cpus=cpus_per_worker,
        max_failures=max_failures, heartbeat_s=heartbeat_s))
    log.info("study %s: %d finished trials, %d to run, %d at a time (%d ranks each, %s)", study_name, finished,
             max(0, n_trials - finished), parallel, ranks_per_trial, launcher)
    driver.run(parallel)
    return study


def _default_slots(launcher: str, cpus_per_worker: float) -> int:
    if launcher == "ray":
        import ray

        if not ray.is_initialized():
            raise RuntimeError("run_study(launcher='ray'): call ray.init() (or ray.init(address='auto')) first")
        return int(ray.cluster_resources().get("CPU", 1) // cpus_per_worker)
    return os.cpu_count() or 1


class _Driver:
    """Threads that each ask for a trial, run its job and tell the result, until the study is done."""

    def __init__(self, study, store, storage_url: str, to_run: int, opts: dict) -> None:
        self.study, self.store, self.storage_url, self.to_run, self.o = study, store, storage_url, to_run, opts
        self.lock = threading.Lock()
        self.launched = 0
        self.failures: list[BaseException] = []
        self.running: set[int] = set()  # trial numbers
        self.stop = threading.Event()

    def run(self, parallel: int) -> None:
        beat = threading.Thread(target=self._heartbeat, daemon=True, name="phalanx-tune-heartbeat")
        beat.start()
        threads = [threading.Thread(target=self._loop, name=f"phalanx-tune-{i}") for i in range(parallel)]
        try:
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        finally:
            self.stop.set()
        if len(self.failures) > self.o["max_failures"]:
            raise RuntimeError(f"run_study: {len(self.failures)} trials failed (max_failures="
                               f"{self.o['max_failures']}); the last one:\n{self.failures[-1]}") from self.failures[-1]

    def _heartbeat(self) -> None:
        study_id = self.store.get_study_id_from_name(self.study.study_name)
        while not self.stop.wait(self.o["heartbeat_s"]):
            with self.lock:
                numbers = list(self.running)
            for n in numbers:
                try:
                    self.store.record_heartbeat(self.store.get_trial_id_from_study_id_trial_number(study_id, n))
                except Exception as err:  # noqa: BLE001 - a missed beat only delays stale detection
                    log.debug("heartbeat for trial %d failed: %s", n, err)

    def _loop(self) -> None:
        while True:
            with self.lock:
                if self.launched >= self.to_run or len(self.failures) > self.o["max_failures"]:
                    return
                self.launched += 1
                with warnings.catch_warnings():  # "heartbeat is meant for optimize()": this driver beats itself
                    warnings.filterwarnings("ignore", message="Heartbeat of storage")
                    trial = self.study.ask()
                self.running.add(trial.number)
                study_id = self.store.get_study_id_from_name(self.study.study_name)
                self.store.record_heartbeat(self.store.get_trial_id_from_study_id_trial_number(study_id, trial.number))
            started = time.monotonic()
            sampler = copy.deepcopy(self.o["sampler"])
            sampler.reseed_rng()  # each trial samples in its own process: the same RNG state would repeat draws
            payload = _Payload(self.o["objective"], self.o["args"], self.storage_url, self.study.study_name,
                               trial.number, sampler, self.o["pruner"])
            try:
                kind, value = self._launch(payload)
            except Exception as err:  # noqa: BLE001 - the trial failed; recorded, and counted
                kind, value = "fail", err
            with self.lock:
                self.running.discard(trial.number)
                self._tell(trial, kind, value, time.monotonic() - started)

    def _launch(self, payload: _Payload):
        k = self.o["ranks"]
        if self.o["launcher"] == "spawn":
            return spawn_run(trial_job, np=k, args=(payload,), timeout=self.o["timeout"], env=self.o["env"])[0]
        from phalanx.ray import RayExecutor

        executor = RayExecutor(RayExecutor.create_settings(timeout_s=max(60, self.o["timeout"] / 10)),
                               num_workers=k, cpus_per_worker=self.o["cpus"])
        executor.start(extra_env_vars=self.o["env"])
        try:
            return executor.run(ray_trial_job, args=[payload])[0]
        finally:
            executor.shutdown()

    def _tell(self, trial, kind: str, value, seconds: float) -> None:
        if kind == "complete":
            frozen = self.study.tell(trial, value)
            log.info("trial %d complete: value %.6g, params %s (%.1fs)", trial.number, value, frozen.params, seconds)
        elif kind == "pruned":
            frozen = self.study.tell(trial, state=TrialState.PRUNED)
            log.info("trial %d pruned after %d epochs: params %s (%.1fs)", trial.number,
                     len(frozen.intermediate_values), frozen.params, seconds)
        else:
            text = str(value)
            trial.set_user_attr("phalanx_error", text[-4000:])
            self.study.tell(trial, state=TrialState.FAIL)
            self.failures.append(value)
            rank = f" (rank {value.rank})" if isinstance(value, RankError) else ""
            log.warning("trial %d failed%s: %s", trial.number, rank, text.splitlines()[0] if text else value)


def trials_table(study: optuna.Study, param_names: Sequence[str] | None = None) -> str:
    """The study's trials as a Markdown table: number, state, params, value, epochs reported."""
    trials = study.get_trials(deepcopy=False)
    names = list(param_names or sorted({k for t in trials for k in t.params}))
    head = "| trial | state | " + " | ".join(names) + " | value | epochs reported |"
    rows = [head, "|" + "---|" * (len(names) + 4)]
    for t in trials:
        params = " | ".join(_fmt(t.params.get(n)) for n in names)
        value = _fmt(t.value) if t.value is not None else "—"
        rows.append(f"| {t.number} | {t.state.name} | {params} | {value} | {len(t.intermediate_values)} |")
    return "\n".join(rows)


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "—" if v is None else str(v)
