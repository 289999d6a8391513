"""``Trainer``: a distributed training loop that reads top to bottom; options live in callbacks.

Example::

    import phalanx as px
    from phalanx.trainer import Trainer, LRWarmup, MetricAverage

    px.init()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.CrossEntropyLoss(),
                      train_data=(x_train, y_train), val_data=(x_test, y_test), batch_size=64,
                      precision="bf16", callbacks=[LRWarmup(warmup_epochs=2)])
    history = trainer.fit(epochs=10)   # [{'epoch': 0, 'loss': …, 'val_loss': …, 'val_accuracy': …}, …]

``train_data`` is a ``(inputs, targets)`` pair of tensors or any map-style
dataset of ``(input, target)`` items; each rank reads its shard of every
global batch (``batch_size`` is the per-rank batch, as in Horovod scripts).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence

import torch
from torch import nn

import phalanx.runtime as rt
from phalanx.comm import collectives as c
from phalanx.trainer.callbacks import Callback, Checkpoint, MetricAverage

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


class Trainer:
    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        train_data,
        val_data=None,
        *,
        callbacks: Sequence[Callback] = (),
        batch_size: int = 32,
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
    ) -> None:
        if precision not in _PRECISIONS:
            raise ValueError(f"precision must be one of {sorted(_PRECISIONS)}, got {precision!r}")
        if grad_accum < 1 or batch_size < 1:
            raise ValueError(f"grad_accum ({grad_accum}) and batch_size ({batch_size}) must be >= 1")
        from phalanx.parallel.data import DataParallel

        self.topology = rt.topology()
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
        self.callbacks = list(callbacks)
        if not any(isinstance(cb, MetricAverage) for cb in self.callbacks):
            self.callbacks.append(MetricAverage())
        # Checkpoint callbacks run last: a resume at train begin overrides what the others set
        # up (a fresh LR scheduler, the warm-up's first rate); at epoch end they see averaged metrics.
        self.callbacks.sort(key=lambda cb: isinstance(cb, Checkpoint))
        self.shuffle, self.seed, self.progress = shuffle, seed, progress
        self.state = TrainerState()

    # ------------------------------------------------------------------ the loop
    def fit(self, epochs: int) -> list[dict[str, float]]:
        self._call("on_train_begin")
        for epoch in range(self.state.epoch, epochs):
            self.state.epoch = epoch
            self._call("on_epoch_begin")
            self.state.metrics = {"loss": self._train_epoch(epoch)}
            if self.val_data is not None:
                self.state.metrics.update(self.evaluate(self.val_data))
            self._call("on_epoch_end")  # MetricAverage makes metrics global here
            self.state.history.append({"epoch": epoch, **self.state.metrics})
            if self.state.stop:
                break
        self._call("on_train_end")
        return self.state.history

    def _train_epoch(self, epoch: int) -> float:
        self.model.train()
        total, batches = 0.0, 0
        micro = list(self._batches(self.train_data, epoch)) if self.model.balancer is None else \
            _balanced_batches(self, epoch)
        bar = self._progress_bar(len(micro), epoch)
        for i, (x, y) in enumerate(micro):
            last_micro = (i + 1) % self.grad_accum == 0 or i + 1 == len(micro)
            self._call("on_step_begin")
            sync = contextlib.nullcontext() if last_micro else self.model.no_sync()
            with sync:
                with self._autocast():
                    loss = self.loss_fn(self.model(x), y) / self.grad_accum
                self.scaler.scale(loss).backward()
            if last_micro:
                self._optimizer_step()
                self.state.step += 1
                self._call("on_step_end")
            total += loss.item() * self.grad_accum
            batches += 1
            if bar is not None:
                bar.update()
        if bar is not None:
            bar.close()
        return total / max(batches, 1)

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
        flag = torch.tensor([1.0 if finite else 0.0], device=self.topology.device)
        return bool(c.allreduce(flag, op=c.Min, name="trainer.finite").item())

    @torch.no_grad()
    def evaluate(self, data) -> dict[str, float]:
        """Loss and accuracy on this rank's shard of ``data`` (averaged by MetricAverage)."""
        self.model.eval()
        loss_sum, correct, count = 0.0, 0, 0
        for x, y in self._batches(data, epoch=0, shuffle=False):
            with self._autocast():
                out = self.model(x)
            loss_sum += float(self.loss_fn(out.float(), y)) * len(y)
            if out.dim() == 2 and y.dtype == torch.int64:
                correct += int((out.argmax(1) == y).sum())
            count += len(y)
        # Sum over ranks so the result is the global mean whatever the shard sizes.
        totals = c.allreduce(torch.tensor([loss_sum, correct, count], dtype=torch.float64), op=c.Sum)
        loss_sum, correct, count = totals.tolist()
        return {"val_loss": loss_sum / max(count, 1), "val_accuracy": correct / max(count, 1)}

    # ------------------------------------------------------------------ helpers
    def _batches(self, data, epoch: int, shuffle: bool | None = None):
        """This rank's slice of each global batch; the same permutation on every rank."""
        shuffle = self.shuffle if shuffle is None else shuffle
        n_ranks, me = self.topology.size, self.topology.rank
        length = len(data[0]) if isinstance(data, tuple) else len(data)
        order = (torch.randperm(length, generator=torch.Generator().manual_seed(self.seed + epoch))
                 if shuffle else torch.arange(length))
        global_batch = self.batch_size * n_ranks
        for start in range(0, length - global_batch + 1 if shuffle else length, global_batch):
            idx = order[start + me * self.batch_size:][: self.batch_size]
            if len(idx) == 0:
                continue
            yield self._fetch(data, idx)

    def _fetch(self, data, idx):
        device = self.topology.device
        if isinstance(data, tuple):
            return data[0][idx].to(device), data[1][idx].to(device)
        items = [data[int(i)] for i in idx]
        return (torch.stack([torch.as_tensor(a) for a, _ in items]).to(device),
                torch.as_tensor([b for _, b in items]).to(device))

    def _autocast(self):
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.topology.device.type, dtype=self.dtype)

    def _progress_bar(self, total: int, epoch: int):
        if not self.progress or self.topology.rank != 0:
            return None
        from tqdm import tqdm

        return tqdm(total=total, desc=f"epoch {epoch}", leave=False, disable=None, mininterval=0.5)

    def _call(self, hook: str) -> None:
        for cb in self.callbacks:
            getattr(cb, hook)(self)


def _balanced_batches(trainer: Trainer, epoch: int):
    """This rank's share of each global batch as re-split by the balancer (a lazy, sized sequence)."""
    from phalanx.balance import epoch_batches

    return epoch_batches(trainer.model.balancer, trainer.train_data, epoch, trainer._fetch,
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
