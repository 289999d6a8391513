"""Trainer callbacks: each optional behaviour of the loop is one small class.

A callback overrides any of ``on_train_begin``, ``on_epoch_begin``,
``on_step_begin``, ``on_step_end``, ``on_epoch_end``, ``on_train_end``; each
receives the trainer (``trainer.state`` holds epoch, step, metrics, history).

Example::

    Trainer(..., callbacks=[LRWarmup(warmup_epochs=5), EarlyStopping("val_loss", patience=3),
                            Checkpoint("ckpt/"), TensorBoard("runs/")])
"""

from __future__ import annotations

import math

import torch

from phalanx.comm import collectives as c

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


class BroadcastInitialState(Callback):
    """Copy model parameters and optimizer state from ``root_rank`` before training (Horovod's
    BroadcastGlobalVariablesCallback). DataParallel already broadcasts the model at wrap time;
    this also covers optimizer state restored from a checkpoint on one rank."""

    def __init__(self, root_rank: int = 0) -> None:
        self.root_rank = root_rank

    def on_train_begin(self, trainer) -> None:
        from phalanx.parallel.data_optimizer import broadcast_optimizer_state, broadcast_parameters

        broadcast_parameters(trainer.model.module.state_dict(), root_rank=self.root_rank)
        broadcast_optimizer_state(trainer.optimizer, root_rank=self.root_rank)


class MetricAverage(Callback):
    """Average every epoch metric across ranks, so all ranks log and decide on the same numbers."""

    def on_epoch_end(self, trainer) -> None:
        metrics = trainer.state.metrics
        if not metrics:
            return
        keys = sorted(metrics)
        values = torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64)
        averaged = c.allreduce(values, op=c.Average, name="trainer.metrics")
        trainer.state.metrics = dict(zip(keys, averaged.tolist()))


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
        self.base_lrs = [g["lr"] for g in trainer.optimizer.param_groups]
        if self.steps_per_epoch is None:
            self.steps_per_epoch = max(1, len(list(trainer._batches(trainer.train_data, 0))) // trainer.grad_accum)
        self._apply(trainer, 0)

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


class Checkpoint(Callback):
    """Save model, optimizer, scaler and trainer position every ``every`` epochs.

    Uses phalanx.checkpoint (atomic, sharded, optionally async) when available; resumes
    from the newest intact checkpoint in ``directory`` at train begin when ``resume``.
    """

    def __init__(self, directory: str, every: int = 1, async_: bool = False, keep: int = 3, resume: bool = True):
        self.directory, self.every, self.async_, self.keep, self.resume = directory, every, async_, keep, resume

    def _state(self, trainer) -> dict:
        return {"model": trainer.model.module, "optimizer": trainer.optimizer, "scaler": trainer.scaler,
                "extras": {"epoch": trainer.state.epoch, "step": trainer.state.step}}

    def on_train_begin(self, trainer) -> None:
        if not self.resume:
            return
        from phalanx import checkpoint

        state = self._state(trainer)
        if checkpoint.load_latest(self.directory, state) is not None:
            trainer.state.epoch = int(state["extras"]["epoch"]) + 1
            trainer.state.step = int(state["extras"]["step"])

    def on_epoch_end(self, trainer) -> None:
        if (trainer.state.epoch + 1) % self.every:
            return
        from phalanx import checkpoint

        path = f"{self.directory}/epoch-{trainer.state.epoch:05d}"
        checkpoint.save(path, self._state(trainer), async_=self.async_, keep=self.keep)


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
