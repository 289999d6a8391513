"""Shared bits of the GPU run's steps (benchmarks/gpu/run.sh): the device switch, timing, JSON lines.

Every step script takes ``--device cpu|cuda`` and ``--out FILE``. ``--device cpu`` is the dry run:
tiny sizes, gloo, seconds, so that tests/runtime/test_gpu_dry_run.py keeps the script from rotting on a
machine without a GPU. Each result is one JSON line appended to ``--out`` (and echoed to stdout),
tagged with the step, the device's name and torch's version, so the lines from one run can be
committed under benchmarks/results/ as they are.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable

import torch


def parser(doc: str | None) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cuda",
                    help="cuda: the measured run; cpu: the dry run (tiny sizes, seconds)")
    ap.add_argument("--out", default=None, help="append one JSON line per result to this file")
    return ap


def check_device(device: str) -> None:
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda but torch sees no CUDA device on this machine; "
                         "use --device cpu for the dry run")


def device_name(device: str) -> str:
    if device == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def emit(out: str | None, step: str, device: str, **fields) -> dict:
    """Write one result as a JSON line (to ``out`` if given, always to stdout)."""
    row = {"step": step, "device": device_name(device), "torch": torch.__version__,
           "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **fields}
    line = json.dumps(row, default=str)
    print(line, flush=True)
    if out:
        with open(out, "a") as f:
            f.write(line + "\n")
    return row


def sync(device: str | torch.device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def timed(fn: Callable[[], object], device: str | torch.device, iters: int) -> float:
    """Seconds per call of ``fn`` over ``iters`` calls, the device drained before and after."""
    sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    sync(device)
    return (time.perf_counter() - t0) / iters


def median_ci(values: list[float]) -> tuple[float, float, float]:
    """Median and a distribution-free ~95% interval of it (order statistics of the binomial)."""
    xs = sorted(values)
    n = len(xs)
    if n < 6:
        return statistics.median(xs), xs[0], xs[-1]
    half = 0.98 * n ** 0.5  # 1.96 * sqrt(n)/2
    lo = max(0, int(n / 2 - half))
    hi = min(n - 1, int(n / 2 + half + 1))
    return statistics.median(xs), xs[lo], xs[hi]
