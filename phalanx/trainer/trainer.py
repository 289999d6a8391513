"""``Trainer``: a distributed training loop that reads top to bottom; options live in callbacks.

Example::

    import phalanx as px
    from phalanx.trainer import Trainer, LRWarmup, MetricAverage

    px.init()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.CrossEntropyLoss(),
                      train_data=(x_train, y_train), val_data=(x_test, y_test), batch_size=64,
                      precision="bf16", callbacks=[LRWarmup(warmup_epochs=2)])
    history = trainer.fit(epochs=10)   # [{'epoch': 0, 'loss': …, 'val_loss': …, 'val_accuracy': …}, …]

``train_data`` is a ``(inputs, targets)`` pair of tensors, any ``Dataset`` or
``IterableDataset`` (samples as pairs or dicts), or a ``DataLoader`` (re-sharded,
its settings kept); each rank reads its shard of every global batch
(``batch_size`` is the per-rank batch, as in Horovod scripts). See
:mod:`phalanx.trainer.data`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence

import torch
from torch import nn

import phalanx.runtime as rt
from phalanx import settings
from phalanx.comm import collectives as c
from phalanx.trainer.callbacks import Callback, Checkpoint, MetricAverage
from phalanx.trainer.data import batch_len, check_shapes, make_epoch_data, to_device
from phalanx.trainer.data import split_batch as pair_or_dict
from phalanx.trainer.progress import Progress

__all__ = ["Trainer", "TrainerState"]

_PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclasses.dataclass
class TrainerState:
    """What callbacks see and may change (``stop`` ends training after this epoch)."""

    epoch: int = 0
    step: int = 0
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    history: list[dict[str, float]] = dataclasses.field(default_factory=list)
    skipped_steps: int = 0
    stop: bool = False
    batch: int = 0  # micro-batches done in this epoch (kept by a preemption checkpoint taken inside an epoch)
    epoch_loss_sum: float = 0.0  # their summed loss, so the resumed epoch reports the same mean


class Trainer:
    """A data-parallel training loop (docs/trainer.md).

    ``train_data``/``val_data``: ``(inputs, targets)`` tensors, a Dataset, an IterableDataset or a
    DataLoader (:mod:`phalanx.trainer.data`); ``batch_size`` is per rank (default 32, or the
    DataLoader's). ``progress``: rank 0's bar on a terminal, else a line per epoch and every
    ``log_every`` batches. ``split_batch(batch) -> (inputs, targets)`` for batches that are
    neither pairs nor dicts with one target key. Arguments are checked here, in one line each.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        train_data,
        val_data=None,
        *,
        callbacks: Sequence[Callback] = (),
        batch_size: int | None = None,
        precision: str = "fp32",
        grad_accum: int = 1,
        max_grad_norm: float | None = None,
        activation_checkpointing: bool = False,
        compression=None,
        shuffle: bool = True,
        seed: int = 0,
        progress: bool = True,
        balance=False,
        overlap_optimizer: bool = False,
        log_every: int | None = None,
        split_batch: Callable | None = None,
    ) -> None:
        settings.choice("Trainer(precision=)", precision, tuple(_PRECISIONS))
        grad_accum = settings.positive("Trainer(grad_accum=)", grad_accum, integer=True)
        if batch_size is not None:
            batch_size = settings.positive("Trainer(batch_size=)", batch_size, integer=True)
        if log_every is not None:
            log_every = settings.positive("Trainer(log_every=)", log_every, integer=True)
        from phalanx.parallel.data import DataParallel

        self.topology = rt.topology()
        topo = self.topology
        # The data first: bad input is refused before the model is wrapped (which talks to the other ranks).
        self.train_loader, batch_size = make_epoch_data(
            train_data, what="Trainer(train_data=)", rank=topo.rank, size=topo.size, batch_size=batch_size,
            shuffle=shuffle, seed=seed, train=True)
        self.val_loader = None if val_data is None else make_epoch_data(
            val_data, what="Trainer(val_data=)", rank=topo.rank, size=topo.size, batch_size=batch_size,
            shuffle=False, seed=seed, train=False)[0]
        if activation_checkpointing:
            _checkpoint_children(model)
        from phalanx import balance as _balance  # balance=True: docs/load_balancing.md

        if overlap_optimizer and (precision == "fp16" or max_grad_norm is not None):
            raise ValueError("overlap_optimizer=True steps the optimizer on each piece of the gradient as it "
                             "arrives, before the whole gradient is known: it cannot be combined with "
                             f"precision='fp16' (GradScaler) or max_grad_norm (clipping); got precision={precision!r}, "
                             f"max_grad_norm={max_grad_norm!r}")
        self.overlap = bool(overlap_optimizer)
        self.model = DataParallel(model, topology=self.topology, compression=compression,
                                  balance=_balance.as_balancer(balance, batch_size * self.topology.size),
                                  overlap_optimizer=optimizer if overlap_optimizer else None)
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.train_data, self.val_data = train_data, val_data
        self.batch_size, self.grad_accum = batch_size, grad_accum
        self.max_grad_norm = max_grad_norm
        self.dtype = _PRECISIONS[precision]
        self.scaler = torch.amp.GradScaler(self.topology.device.type, enabled=precision == "fp16")
        # MetricAverage runs first, so every other callback (EarlyStopping, TensorBoard, the user's)
        # sees the metrics averaged across ranks. Checkpoint callbacks run last: a resume at train
        # begin overrides what the others set up (a fresh LR scheduler, the warm-up's first rate).
        averages = [cb for cb in callbacks if isinstance(cb, MetricAverage)] or [MetricAverage()]
        self.callbacks = averages + [cb for cb in callbacks if not isinstance(cb, MetricAverage)]
        self.callbacks.sort(key=lambda cb: isinstance(cb, Checkpoint))
        self.shuffle, self.seed, self.progress = shuffle, seed, progress
        self.log_every = log_every
        self.split_batch = split_batch or pair_or_dict
        self.state = TrainerState()
        self._shapes_checked = False
        # set by Checkpoint(preempt=True): the per-step inf/NaN allreduce also carries the preemption vote
        self.preemption = None
        self._preempt_agreed = False

    # ------------------------------------------------------------------ the loop
    def fit(self, epochs: int) -> list[dict[str, float]]:
        epochs = settings.positive("Trainer.fit(epochs=)", epochs, integer=True, allow_zero=True)
        self._epochs = epochs
        progress = Progress(enabled=self.progress, rank=self.topology.rank, size=self.topology.size,
                            log_every=self.log_every)
        try:
            return self._fit(epochs, progress)
        finally:
            if self.preemption is not None:
                self.preemption.close()

    def _fit(self, epochs: int, progress: Progress) -> list[dict[str, float]]:
        self._call("on_train_begin")
        for epoch in range(self.state.epoch, epochs):
            self.state.epoch = epoch
            self._call("on_epoch_begin")
            self.state.metrics = {"loss": self._train_epoch(epoch, progress)}
            progress.train_end()
            if self.val_loader is not None:
                self.state.metrics.update(self.evaluate(self.val_loader))
            self._call("on_epoch_end")  # MetricAverage (first) makes the metrics global
            self.state.history.append({"epoch": epoch, **self.state.metrics})
            progress.epoch_end(self.state.metrics)
            if self._any_rank(self.state.stop, "trainer.stop"):  # a rank's own callback may have stopped it
                self.state.stop = True
                break
        self._call("on_train_end")
        return self.state.history

    def steps_per_epoch(self) -> int | None:
        """Optimizer steps in one epoch (None for an IterableDataset without a length)."""
        batches = len(self._epoch_batches(0)) if self.model.balancer is not None else self.train_loader.steps()
        return None if batches is None else max(1, batches // self.grad_accum)

    def _epoch_batches(self, epoch: int):
        if self.model.balancer is not None:
            return _balanced_batches(self, epoch)
        return self.train_loader.epoch(epoch)

    def _train_epoch(self, epoch: int, progress: Progress) -> float:
        self.model.train()
        total, batches = 0.0, 0
        micro = self._epoch_batches(epoch)
        count = len(micro) if self.model.balancer is not None else self.train_loader.steps()
        progress.epoch_begin(epoch, self._epochs, count)
        uneven = self.train_loader.uneven and self.model.balancer is None
        stream, i = self._resume_stream(micro)
        if i:
            total, batches = self.state.epoch_loss_sum, i
        while True:
            batch = next(stream, None)
            if uneven and not self._all_ranks(batch is not None, "trainer.has_batch"):
                break  # an IterableDataset ran out on some rank: every rank ends the epoch here
            if batch is None:
                break
            x, y = self._to_device(batch)
            last_micro = (i + 1) % self.grad_accum == 0 or (count is not None and i + 1 == count)
            self._call("on_step_begin")
            sync = contextlib.nullcontext() if last_micro else self.model.no_sync()
            with sync:
                with self._autocast():
                    out = self._forward(x)
                    if not self._shapes_checked:
                        self._shapes_checked = True
                        check_shapes(out, y)
                    loss = self.loss_fn(out, y) / self.grad_accum
                self.scaler.scale(loss).backward()
            if last_micro:
                self._optimizer_step()
                self.state.step += 1
                self._call("on_step_end")
            value = loss.item() * self.grad_accum
            total += value
            batches += 1
            i += 1
            progress.batch(batch_len(y), value)
            if last_micro and self._preempt_agreed:
                self.state.batch, self.state.epoch_loss_sum = i, total
                self._preempted()
        self.state.batch, self.state.epoch_loss_sum = 0, 0.0
        if i % self.grad_accum and count is None:
            # An iterable ran out inside an accumulation group: those gradients were never averaged.
            self.optimizer.zero_grad(set_to_none=True)
        if batches == 0:
            raise settings.SettingsError(f"epoch {epoch}: Trainer(train_data=) gave rank {self.topology.rank} no "
                                         "batch at all; an IterableDataset needs at least one full batch per rank")
        return total / batches

    def _resume_stream(self, micro):
        """This epoch's batches, past the ones a preemption checkpoint says were already trained on."""
        skip, self.state.batch = self.state.batch, 0
        if not skip:
            return iter(micro), 0
        # A DataLoader draws its base seed from torch's generator when iterated; the checkpoint's
        # generator state is from after that draw, so it is put back after this one.
        rng = torch.get_rng_state()
        stream = iter(micro)
        torch.set_rng_state(rng)
        for _ in range(skip):
            next(stream)
        return stream, skip

    def _preempted(self):
        """Every rank agreed on this step: callbacks save (Checkpoint raises Preempted when done)."""
        from phalanx.preemption import Preempted

        self._call("on_preempt")
        raise Preempted(None, self.preemption.signal if self.preemption else None)

    def _optimizer_step(self) -> None:
        # Gradients were averaged across ranks during backward (DataParallel).
        self.scaler.unscale_(self.optimizer)
        if not self._all_ranks_finite():
            if self.overlap:
                raise RuntimeError(
                    f"step {self.state.step}: a gradient was inf/NaN on some rank, and with overlap_optimizer=True "
                    "the optimizer had already applied it during backward (the parameters are no longer finite); "
                    "the step cannot be skipped. Train with overlap_optimizer=False to skip such steps, or find "
                    "the cause (learning rate, loss, data).")
            # One rank's inf/NaN: every rank skips, and the loss scale backs off alike.
            self.state.skipped_steps += 1
            self.optimizer.zero_grad(set_to_none=True)
            if self.scaler.is_enabled():
                self.scaler.update(self.scaler.get_scale() * self.scaler.get_backoff_factor())
            return
        if self.max_grad_norm is not None:
            nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)

    def _all_ranks_finite(self) -> bool:
        finite = all(torch.isfinite(p.grad).all() for p in self.model.parameters() if p.grad is not None)
        if self.preemption is None:
            flag = torch.tensor([1.0 if finite else 0.0], device=self.topology.device)
            return bool(c.allreduce(flag, op=c.Min, name="trainer.finite").item())
        # The same allreduce carries the preemption vote: MIN of minus the signal number is minus the largest.
        flag = torch.tensor([1.0 if finite else 0.0, -float(self.preemption.local_flag())], device=self.topology.device)
        out = c.allreduce(flag, op=c.Min, name="trainer.finite")
        self._preempt_agreed = self.preemption.decide(int(-out[1].item()))
        return bool(out[0].item())

    def _any_rank(self, flag: bool, name: str) -> bool:
        if self.topology.size == 1:
            return bool(flag)
        t = torch.tensor([1.0 if flag else 0.0], device=self.topology.device)
        return bool(c.allreduce(t, op=c.Max, name=name).item())

    def _all_ranks(self, flag: bool, name: str) -> bool:
        return not self._any_rank(not flag, name)

    @torch.no_grad()
    def evaluate(self, data) -> dict[str, float]:
        """Loss and accuracy over every rank's shard of ``data`` (summed over ranks: the global mean).

        ``data`` takes the same forms as ``val_data``; every sample is counted once.
        """
        from phalanx.trainer.data import EpochData

        if not isinstance(data, EpochData):
            topo = self.topology
            data = make_epoch_data(data, what="Trainer.evaluate(data=)", rank=topo.rank, size=topo.size,
                                   batch_size=self.batch_size, shuffle=False, seed=self.seed, train=False)[0]
        self.model.eval()
        loss_sum, correct, count = 0.0, 0, 0
        for batch in data.epoch(0):
            x, y = self._to_device(batch)
            with self._autocast():
                out = self._forward(x)
            n = batch_len(y)
            loss_sum += float(self.loss_fn(out.float(), y)) * n
            if torch.is_tensor(out) and out.dim() == 2 and y.dtype == torch.int64:
                correct += int((out.argmax(1) == y).sum())
            count += n
        # Sum over ranks so the result is the global mean whatever the shard sizes.
        totals = c.allreduce(torch.tensor([loss_sum, correct, count], dtype=torch.float64), op=c.Sum)
        loss_sum, correct, count = totals.tolist()
        return {"val_loss": loss_sum / max(count, 1), "val_accuracy": correct / max(count, 1)}

    # ------------------------------------------------------------------ helpers
    def _to_device(self, batch):
        x, y = self.split_batch(batch)
        pinned = self.train_loader.loader.pin_memory and self.topology.device.type == "cuda"
        return to_device(x, self.topology.device, pinned), to_device(y, self.topology.device, pinned)

    def _forward(self, x):
        return self.model(**x) if isinstance(x, dict) else self.model(x)

    def _autocast(self):
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.topology.device.type, dtype=self.dtype)

    def _call(self, hook: str) -> None:
        for cb in self.callbacks:
            getattr(cb, hook)(self)


def _balanced_batches(trainer: Trainer, epoch: int):
    """This rank's share of each global batch as re-split by the balancer (a lazy, sized sequence)."""
    from phalanx.balance import epoch_batches

    dataset = trainer.train_loader.dataset
    collate = trainer.train_loader.loader.collate_fn

    def fetch(data, idx):
        if isinstance(data, torch.utils.data.TensorDataset):
            return data[idx]
        return collate([data[int(i)] for i in idx])

    return epoch_batches(trainer.model.balancer, dataset, epoch, fetch,
                         shuffle=trainer.shuffle, seed=trainer.seed, accumulation=trainer.grad_accum)


def _checkpoint_children(model: nn.Module) -> None:
    """Recompute each top-level child's activations in backward instead of storing them.

    The child's ``forward`` is replaced on the instance, so parameter names do not change.
    """
    from torch.utils.checkpoint import checkpoint

    for child in model.children():
        plain = child.forward

        def forward(*args, _plain=plain, _child=child):
            if not _child.training or not torch.is_grad_enabled():
                return _plain(*args)
            return checkpoint(_plain, *args, use_reentrant=False)

        child.forward = forward
