"""Training progress on rank 0: a live bar on a terminal, else plain lines a log file can hold.

On a terminal (``sys.stdout.isatty()``) rank 0 draws a tqdm bar per epoch. Anywhere else (under
``phalanx run``, a batch job, a pipe) it prints one line per epoch, and one every ``log_every``
batches when asked, never a bar redraw per update::

    epoch 3 batch 40/112: loss 0.3121 (rank 0) | 11,804 samples/s
    epoch 3/10: loss 0.2954 | val_loss 0.3102 | val_accuracy 0.9120 | 11,650 samples/s | 1.2 s

``samples/s`` counts every rank's samples (this rank's times the number of ranks). The
epoch line shows the metrics averaged across ranks; a step line shows rank 0's running loss.
"""

from __future__ import annotations

import sys
import time

__all__ = ["Progress"]


class Progress:
    """Rank 0's view of one ``fit``; every other rank's calls do nothing."""

    def __init__(self, *, enabled: bool, rank: int, size: int, log_every: int | None = None, stream=None) -> None:
        self.enabled = enabled and rank == 0
        self.size, self.log_every = size, log_every
        self.stream = stream if stream is not None else sys.stdout
        self.bar = None

    def _terminal(self) -> bool:
        try:
            return self.stream.isatty()
        except (AttributeError, ValueError):
            return False

    def epoch_begin(self, epoch: int, epochs: int, steps: int | None) -> None:
        self.epoch, self.epochs, self.steps = epoch, epochs, steps
        self.samples, self.loss_sum, self.micro = 0, 0.0, 0
        self.start = time.perf_counter()
        self.train_s = 0.0
        if self.enabled and self._terminal():
            try:
                from tqdm import tqdm
            except ImportError:
                return
            self.bar = tqdm(total=steps, desc=f"epoch {epoch + 1}/{epochs}", leave=False, file=self.stream, mininterval=0.5,
                            unit="batch")

    def batch(self, samples: int, loss: float) -> None:
        self.samples += samples
        self.loss_sum += loss
        self.micro += 1
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update()
            if self.micro % 10 == 0:
                self.bar.set_postfix(loss=f"{self.loss_sum / self.micro:.4f}", refresh=False)
            return
        if self.log_every and self.micro % self.log_every == 0:
            of = f"/{self.steps}" if self.steps else ""
            self._print(f"epoch {self.epoch + 1} batch {self.micro}{of}: loss {self.loss_sum / self.micro:.4f} "
                        f"(rank 0) | {self._rate(time.perf_counter() - self.start)}")

    def train_end(self) -> None:
        """The epoch's training part is over (evaluation is not counted in samples/s)."""
        self.train_s = time.perf_counter() - self.start
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def epoch_end(self, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        shown = " | ".join(f"{k} {v:.4f}" for k, v in metrics.items())
        self._print(f"epoch {self.epoch + 1}/{self.epochs}: {shown} | {self._rate(self.train_s)} | "
                    f"{time.perf_counter() - self.start:.1f} s")

    def _rate(self, seconds: float) -> str:
        return f"{self.samples * self.size / max(seconds, 1e-9):,.0f} samples/s"

    def _print(self, line: str) -> None:
        print(line, file=self.stream, flush=True)
