"""Trainer callbacks: each optional behaviour of the loop is one small class.

A callback overrides any of ``on_train_begin``, ``on_epoch_begin``,
``on_step_begin``, ``on_step_end``, ``on_epoch_end``, ``on_train_end`` and
``on_preempt`` (every rank agreed to stop for a preemption after this step); each
receives the trainer (``trainer.state`` holds epoch, step, metrics, history).

Example::

    Trainer(..., callbacks=[LRWarmup(warmup_epochs=5), EarlyStopping("val_loss", patience=3),
                            Checkpoint("ckpt/"), TensorBoard("runs/")])
"""

from __future__ import annotations

import math
import os
import re

import torch

from phalanx.comm import collectives as c
from phalanx.log import get_logger
from phalanx.settings import CheckpointSettings, SettingsError

__all__ = [
    "Callback",
    "BroadcastInitialState",
    "MetricAverage",
    "LRWarmup",
    "LRSchedule",
    "EarlyStopping",
    "Checkpoint",
    "TensorBoard",
]


class Callback:
    """Base class: every hook does nothing."""

    def on_train_begin(self, trainer) -> None: ...
    def on_epoch_begin(self, trainer) -> None: ...
    def on_step_begin(self, trainer) -> None: ...
    def on_step_end(self, trainer) -> None: ...
    def on_epoch_end(self, trainer) -> None: ...
    def on_train_end(self, trainer) -> None: ...
    def on_preempt(self, trainer) -> None: ...


class BroadcastInitialState(Callback):
    """Copy model parameters and optimizer state from ``root_rank`` before training (Horovod's
    BroadcastGlobalVariablesCallback). DataParallel already broadcasts the model at wrap time;
    this also covers optimizer state restored from a checkpoint on one rank."""

    def __init__(self, root_rank: int = 0) -> None:
        self.root_rank = root_rank

    def on_train_begin(self, trainer) -> None:
        from phalanx.comm.broadcast import broadcast_optimizer_state, broadcast_parameters

        broadcast_parameters(trainer.model.module.state_dict(), root_rank=self.root_rank)
        broadcast_optimizer_state(trainer.optimizer, root_rank=self.root_rank)


class MetricAverage(Callback):
    """Average every epoch metric across ranks, so all ranks log and decide on the same numbers.

    The Trainer runs it before every other callback (added when not given), so EarlyStopping,
    TensorBoard and your own callbacks see the averaged values."""

    def on_epoch_end(self, trainer) -> None:
        metrics = trainer.state.metrics
        if not metrics:
            return
        keys = sorted(metrics)
        values = torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64)
        averaged = dict(zip(keys, c.allreduce(values, op=c.Average, name="trainer.metrics").tolist()))
        trainer.state.metrics = {k: averaged[k] for k in metrics}  # sorted for the wire, shown in their order


class LRWarmup(Callback):
    """Linear scaling rule with gradual warm-up (Goyal et al. 2017, "Accurate, Large Minibatch SGD").

    The target rate is ``base_lr × size`` (``scale_by_size``); over the first
    ``warmup_epochs`` it rises linearly per step from ``base_lr`` (or ``initial_lr``).
    """

    def __init__(self, warmup_epochs: float = 5, initial_lr: float | None = None,
                 scale_by_size: bool = True, steps_per_epoch: int | None = None) -> None:
        self.warmup_epochs, self.initial_lr = warmup_epochs, initial_lr
        self.scale_by_size, self.steps_per_epoch = scale_by_size, steps_per_epoch
        self.base_lrs: list[float] = []

    def on_train_begin(self, trainer) -> None:
        # The unscaled rate is kept in the param group, so a resumed run (whose optimizer state
        # holds the warmed-up rate) still knows where the ramp started.
        self.base_lrs = [g.setdefault("warmup_base_lr", g["lr"]) for g in trainer.optimizer.param_groups]
        if self.steps_per_epoch is None:
            self.steps_per_epoch = trainer.steps_per_epoch()
            if self.steps_per_epoch is None:
                raise SettingsError("LRWarmup: train_data has no length (an IterableDataset), so the steps of an "
                                    "epoch are unknown; pass LRWarmup(steps_per_epoch=N)")
        self._apply(trainer, trainer.state.step)

    def lr_at(self, base_lr: float, step: int, size: int) -> float:
        target = base_lr * (size if self.scale_by_size else 1)
        start = self.initial_lr if self.initial_lr is not None else base_lr
        total = self.warmup_epochs * self.steps_per_epoch
        if total <= 0 or step >= total:
            return target
        return start + (target - start) * step / total

    def _apply(self, trainer, step: int) -> None:
        for g, base in zip(trainer.optimizer.param_groups, self.base_lrs):
            g["lr"] = self.lr_at(base, step, trainer.topology.size)

    def on_step_end(self, trainer) -> None:
        self._apply(trainer, trainer.state.step)


class LRSchedule(Callback):
    """Step a torch LR scheduler, per ``"epoch"`` or per ``"step"``.

    ``make`` builds the scheduler from the optimizer, e.g.
    ``LRSchedule(lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10))``.
    """

    def __init__(self, make, every: str = "epoch") -> None:
        if every not in ("epoch", "step"):
            raise ValueError(f"every must be 'epoch' or 'step', got {every!r}")
        self.make, self.every, self.scheduler = make, every, None

    def on_train_begin(self, trainer) -> None:
        self.scheduler = self.make(trainer.optimizer)

    def on_step_end(self, trainer) -> None:
        if self.every == "step":
            self.scheduler.step()

    def on_epoch_end(self, trainer) -> None:
        if self.every == "epoch":
            self.scheduler.step()

    def state_dict(self) -> dict:
        return {"scheduler": self.scheduler.state_dict() if self.scheduler is not None else None}

    def load_state_dict(self, state: dict) -> None:
        if state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])


class EarlyStopping(Callback):
    """Stop when ``monitor`` has not improved by ``min_delta`` for ``patience`` epochs.

    Metrics are averaged across ranks first, so every rank stops at the same epoch.
    """

    def __init__(self, monitor: str = "val_loss", patience: int = 3, min_delta: float = 0.0, mode: str = "min"):
        if mode not in ("min", "max"):
            raise ValueError(f"mode must be 'min' or 'max', got {mode!r}")
        self.monitor, self.patience, self.min_delta, self.mode = monitor, patience, min_delta, mode
        self.best, self.bad_epochs = math.inf if mode == "min" else -math.inf, 0

    def on_epoch_end(self, trainer) -> None:
        if self.monitor not in trainer.state.metrics:
            raise KeyError(f"EarlyStopping monitors {self.monitor!r} but the metrics are {sorted(trainer.state.metrics)}")
        value = trainer.state.metrics[self.monitor]
        better = value < self.best - self.min_delta if self.mode == "min" else value > self.best + self.min_delta
        if better:
            self.best, self.bad_epochs = value, 0
        else:
            self.bad_epochs += 1
            trainer.state.stop = self.bad_epochs >= self.patience

    def state_dict(self) -> dict:
        return {"best": self.best, "bad_epochs": self.bad_epochs}

    def load_state_dict(self, state: dict) -> None:
        self.best, self.bad_epochs = float(state["best"]), int(state["bad_epochs"])


class Checkpoint(Callback):
    """Save the whole training state every ``every`` epochs; resume from the newest one at train begin.

    The state is the model, the optimizer, the GradScaler, every process's RNG streams, the
    trainer's position (epoch, step, history) and the state of callbacks that have one
    (LR schedules, early stopping), written with :func:`phalanx.checkpoint.save` into
    ``directory/epoch-N`` (sharded, atomic, checksummed; ``async_=True`` returns after the CPU
    copy; the newest ``keep`` are kept). With ``resume`` (default) ``fit`` first loads the newest
    intact checkpoint under ``$PHALANX_RESUME_FROM`` (``phalanx run --resume-from DIR``: a
    directory that does not exist is a one-line error, unless it is ``directory`` itself) or else
    ``directory`` (a fresh one starts from scratch), and continues with the next epoch. Folders named ``step-N`` by earlier versions are read too.
    The trainer runs this callback's ``on_train_begin`` after the others', so the loaded state
    wins over what they set up (a new scheduler, the warm-up's first rate).

    With ``preempt`` (default) it also watches for preemption (SIGTERM and ``$PHALANX_PREEMPT_SIGNAL``,
    i.e. ``phalanx run --preempt-signal USR1``): the ranks agree on one step through the allreduce
    the trainer makes every step anyway, save ``directory/epoch-N-batch-B`` there, requeue a
    SLURM job when wanted, and ``fit`` raises :class:`phalanx.preemption.Preempted` (exit status
    85). The next run continues inside epoch N, after batch B (docs/preemption.md).

    Example::

        Trainer(..., callbacks=[Checkpoint("ckpt/", every=1, keep=3)]).fit(epochs=20)
        # killed at epoch 7? the same command continues from the end of epoch 6
    """

    def __init__(self, directory: str, every: int = 1, async_: bool = False, keep: int = 3,
                 resume: bool = True, preempt: bool = True) -> None:
        from phalanx.checkpoint import CheckpointManager

        if every < 1:
            raise ValueError(f"Checkpoint(every={every}): save every 1 or more epochs")
        self.directory, self.every, self.async_, self.resume = directory, every, async_, resume
        self.preempt = preempt
        self.manager = CheckpointManager(directory, keep=keep)
        self.resumed_from: str | None = None

    def _state(self, trainer) -> dict:
        from phalanx.checkpoint import RNGState

        return {"model": trainer.model.module, "optimizer": trainer.optimizer, "scaler": trainer.scaler,
                "rng": RNGState(), "trainer": _TrainerPosition(trainer)}

    def on_train_begin(self, trainer) -> None:
        from phalanx.checkpoint import load_latest

        named = CheckpointSettings.one("resume_from")
        if self.resume:
            # A --resume-from directory that does not exist is a typo, not a fresh start; except this
            # callback's own directory, so that one command (`--resume-from ckpt/` with Checkpoint("ckpt/"))
            # starts a run and continues it after a crash.
            own = named and os.path.realpath(named) == os.path.realpath(self.directory)
            if named and not own and not os.path.isdir(named):
                raise SettingsError(f"PHALANX_RESUME_FROM={named!r} (phalanx run --resume-from) is not a directory; "
                                    "accepted: a directory holding checkpoints (check the path, or leave the "
                                    "option out to start afresh)")
            self.resumed_from = load_latest(named or self.directory, self._state(trainer))
            log = get_logger(__name__)
            if trainer.topology.rank == 0 and self.resumed_from is not None:
                log.warning("resumed from %s: continuing with epoch %d", self.resumed_from, trainer.state.epoch)
            elif trainer.topology.rank == 0 and named and not own:
                log.warning("--resume-from %s holds no complete checkpoint: starting from scratch", named)
        self._refuse_newer_run(trainer)
        if self.preempt and trainer.preemption is None:
            from phalanx.preemption import Preemption

            trainer.preemption = Preemption(topology=trainer.topology).install()

    def on_preempt(self, trainer) -> None:
        """Save where the trainer stands inside this epoch, then raise Preempted (after a SLURM requeue)."""
        import time

        from phalanx.checkpoint import save

        started, st = time.monotonic(), trainer.state
        path = os.path.join(self.directory, f"epoch-{st.epoch:09d}-batch-{st.batch:09d}")
        save(path, self._state(trainer), meta={"epoch": st.epoch, "step": st.step, "batch": st.batch,
                                               "preempted": True}, on_done=self.manager.prune)
        trainer.preemption.finish(path, save_s=time.monotonic() - started)

    def _refuse_newer_run(self, trainer) -> None:
        """This run's checkpoints must be the newest in ``directory``, or they would be pruned at once
        (and a later resume would load the older run's)."""
        from phalanx.checkpoint import list_checkpoints

        found = list_checkpoints(self.directory)
        if trainer.topology.size > 1:
            found = c.broadcast_object(found, root_rank=0)  # rank 0 prunes: its view decides
        newest = _epoch_of(found[0]) if found else -1
        resumed_here = self.resumed_from is not None and \
            os.path.realpath(os.path.dirname(self.resumed_from)) == os.path.realpath(self.directory)
        if newest >= trainer.state.epoch and not resumed_here:
            raise SettingsError(f"Checkpoint({self.directory!r}) already holds {os.path.basename(found[0])} from "
                                f"another run, newer than this run's first save (epoch {trainer.state.epoch}); "
                                "it would prune this run's checkpoints: use a new directory, remove the old "
                                "checkpoints, or resume from them (resume=True)")

    def on_epoch_end(self, trainer) -> None:
        if (trainer.state.epoch + 1) % self.every:
            return
        from phalanx.checkpoint import save

        epoch = trainer.state.epoch
        save(os.path.join(self.directory, f"epoch-{epoch:09d}"), self._state(trainer), async_=self.async_,
             meta={"epoch": epoch, "step": trainer.state.step}, on_done=self.manager.prune)

    def on_train_end(self, trainer) -> None:
        if self.async_:
            from phalanx.checkpoint import wait

            wait()  # the last save is on disk before fit() returns


def _epoch_of(path: str) -> int:
    # epoch-N, epoch-N-batch-B (preempted inside epoch N), and step-N of earlier versions
    match = re.search(r"(\d+)(?:-batch-\d+)?$", os.path.basename(path))
    return int(match.group(1)) if match else -1


class _TrainerPosition:
    """The trainer's place and the callbacks' own state, as one checkpoint piece."""

    def __init__(self, trainer) -> None:
        self.trainer = trainer

    def _stateful_callbacks(self) -> dict:
        return {f"{i}.{type(cb).__name__}": cb for i, cb in enumerate(self.trainer.callbacks)
                if hasattr(cb, "state_dict") and hasattr(cb, "load_state_dict")}

    def state_dict(self) -> dict:
        st = self.trainer.state
        # on_epoch_end runs before the append; a preemption inside an epoch has no metrics for it yet
        history = st.history + ([] if st.batch else [{"epoch": st.epoch, **st.metrics}])
        return {"epoch": st.epoch, "step": st.step, "skipped_steps": st.skipped_steps, "history": history,
                "batch": st.batch, "epoch_loss_sum": st.epoch_loss_sum,
                "callbacks": {k: cb.state_dict() for k, cb in self._stateful_callbacks().items()}}

    def load_state_dict(self, sd: dict) -> None:
        st = self.trainer.state
        st.batch, st.epoch_loss_sum = int(sd.get("batch", 0)), float(sd.get("epoch_loss_sum", 0.0))
        st.epoch, st.step = int(sd["epoch"]) + (0 if st.batch else 1), int(sd["step"])
        st.skipped_steps, st.history = int(sd["skipped_steps"]), [dict(h) for h in sd["history"]]
        for key, cb in self._stateful_callbacks().items():
            if key in sd["callbacks"]:
                cb.load_state_dict(sd["callbacks"][key])


class TensorBoard(Callback):
    """Write epoch metrics as TensorBoard event files on rank 0 (needs the tensorboard extra)."""

    def __init__(self, log_dir: str) -> None:
        self.log_dir, self.writer = log_dir, None

    def on_train_begin(self, trainer) -> None:
        if trainer.topology.rank == 0:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as err:
                raise ImportError("TensorBoard callback needs tensorboard: pip install 'phalanx[tensorboard]'") from err
            self.writer = SummaryWriter(self.log_dir)

    def on_epoch_end(self, trainer) -> None:
        if self.writer is not None:
            for k, v in trainer.state.metrics.items():
                self.writer.add_scalar(k, v, trainer.state.epoch)
            self.writer.flush()

    def on_train_end(self, trainer) -> None:
        if self.writer is not None:
            self.writer.close()
