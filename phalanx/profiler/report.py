"""Scaling report: throughput at 1..N workers, speedup, efficiency, Amdahl's P, as HTML + PNG.

``phalanx report`` runs the bundled digits demo (:func:`phalanx.demo.measure`) or
your script under ``phalanx run`` (:func:`measure_script`) at each worker count, then
fits Amdahl's law ``S(N) = 1 / ((1-P) + P/N)`` to the measured speedups and plots both. It also draws a timeline as a Gantt chart
(:func:`render_timeline`), the picture a docs page can show without a browser.

Example::

    from phalanx.profiler import report
    rows = report.measure_script([1, 2], ["python", "train.py"])
    report.write_report(rows, "scaling/", unit="runs/s")   # scaling/report.html, scaling/scaling.png
"""

from __future__ import annotations

import dataclasses
import html
import os
import subprocess
import sys
import time
from collections.abc import Sequence

from phalanx.planner import cost

__all__ = ["ScalingRow", "measure_script", "summarise", "write_report", "render_timeline"]


@dataclasses.dataclass(frozen=True)
class ScalingRow:
    workers: int
    throughput: float
    """samples/s for the demo; runs/s (1 / wall seconds) for a script"""
    seconds: float


def _plt():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise ImportError("plots need matplotlib: pip install 'phalanx[plot]'") from err
    return plt


def measure_script(workers: Sequence[int], command: Sequence[str], timeout: float = 600.0) -> list[ScalingRow]:
    """Run ``phalanx run -np N COMMAND`` for each N; throughput = 1 / wall seconds (start-up included)."""
    rows = []
    for n in workers:
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "phalanx", "run", "-np", str(n), *command],
                              capture_output=True, text=True, timeout=timeout)
        seconds = time.perf_counter() - t0
        if proc.returncode != 0:
            raise RuntimeError(f"`phalanx run -np {n} {' '.join(command)}` failed ({proc.returncode}):\n"
                               f"{proc.stderr[-2000:]}")
        rows.append(ScalingRow(n, 1.0 / seconds, seconds))
    return rows


def summarise(rows: Sequence[ScalingRow]) -> dict:
    """Speedup and efficiency against the 1-worker row, and the fitted Amdahl P."""
    base = next((r for r in rows if r.workers == 1), None)
    if base is None:
        raise ValueError("a scaling report needs a 1-worker measurement as its baseline")
    speedup = {r.workers: r.throughput / base.throughput for r in rows}
    multi = [(n, s) for n, s in speedup.items() if n > 1]
    p = cost.fit_amdahl([n for n, _ in multi], [s for _, s in multi]) if multi else float("nan")
    return {"speedup": speedup, "efficiency": {n: s / n for n, s in speedup.items()}, "amdahl_p": p}


def _tick(value: float, _position=None) -> str:
    """One format for every axis: thousands separated, no exponent, at most 3 significant digits below 1000."""
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.3g}"


def write_report(rows: Sequence[ScalingRow], out_dir: str, title: str = "phalanx scaling report",
                 unit: str = "samples/s", note: str = "") -> dict:
    """Write ``out_dir/scaling.png`` and ``out_dir/report.html``; returns the summary and paths."""
    plt = _plt()
    os.makedirs(out_dir, exist_ok=True)
    summary = summarise(rows)
    ns = [r.workers for r in rows]
    p = summary["amdahl_p"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.plot(ns, [r.throughput for r in rows], "o-")
    ax1.set_xlabel("workers")
    ax1.set_ylabel(unit)
    ax1.set_title("throughput")
    ax1.set_ylim(bottom=0)          # from zero, so a 5% gain does not look like a doubling
    ax2.plot(ns, [summary["speedup"][n] for n in ns], "o-", label="measured")
    ax2.plot(ns, ns, "--", color="gray", label="ideal")
    if p == p:  # not NaN
        dense = [1 + i * (max(ns) - 1) / 50 for i in range(51)]
        ax2.plot(dense, [cost.amdahl(p, n) for n in dense], ":", label=f"Amdahl P={p:.2f}")
    ax2.set_xlabel("workers")
    ax2.set_ylabel("speedup")
    ax2.set_title("speedup")
    ax2.set_ylim(bottom=0)
    ax2.legend()
    for ax in (ax1, ax2):           # whole workers only, and one number format on both axes
        ax.set_xticks(ns)
        ax.yaxis.set_major_formatter(plt.FuncFormatter(_tick))
    fig.suptitle(title + (f"\n{note}" if note else ""), fontsize=10)
    fig.tight_layout()
    png = os.path.join(out_dir, "scaling.png")
    fig.savefig(png, dpi=110)
    plt.close(fig)
    body = "".join(
        f"<tr><td>{r.workers}</td><td>{r.throughput:.4g}</td><td>{r.seconds:.2f}</td>"
        f"<td>{summary['speedup'][r.workers]:.2f}</td><td>{summary['efficiency'][r.workers]:.0%}</td></tr>"
        for r in rows)
    page = (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title></head><body>"
            f"<h1>{html.escape(title)}</h1><p>{html.escape(note)}</p>"
            f"<p>Amdahl fit: parallel fraction P = {p:.3f}; predicted limit 1/(1-P) = "
            f"{(1 / (1 - p) if p < 1 else float('inf')):.1f}x</p>"
            f"<table border=1 cellpadding=4><tr><th>workers</th><th>{html.escape(unit)}</th><th>seconds</th>"
            f"<th>speedup</th><th>efficiency</th></tr>{body}</table>"
            f"<p><img src='scaling.png' alt='scaling plots'></p></body></html>")
    page_path = os.path.join(out_dir, "report.html")
    with open(page_path, "w") as f:
        f.write(page)
    return {**summary, "png": png, "html": page_path}


_COLOURS = {"data": "#8c8c8c", "forward": "#4c72b0", "backward": "#55a868", "optimizer": "#c44e52",
            "compress": "#dd8452", "decompress": "#dd8452", "allreduce_launch": "#8172b3",
            "allreduce_wait": "#da8bc3", "wait": "#da8bc3", "allreduce": "#937860"}


def render_timeline(events: Sequence[dict], path: str, start_ms: float | None = None,
                    span_ms: float | None = None) -> str:
    """Draw Chrome-trace events as a Gantt chart PNG: one row per (rank, kind of span)."""
    plt = _plt()
    xs = [e for e in events if e.get("ph") == "X" and e.get("cat") != "step"]
    if not xs:
        raise ValueError("render_timeline: no span events to draw")
    t0 = min(e["ts"] for e in xs) / 1e3 if start_ms is None else start_ms
    t1 = t0 + span_ms if span_ms else max(e["ts"] + e["dur"] for e in xs) / 1e3
    lanes = sorted({(e["pid"], "comm" if e.get("cat") == "comm" else "main") for e in xs})
    fig, ax = plt.subplots(figsize=(12, 0.5 + 0.45 * len(lanes)))
    seen = set()
    for e in xs:
        a, b = e["ts"] / 1e3, (e["ts"] + e["dur"]) / 1e3
        if b < t0 or a > t1:
            continue
        y = lanes.index((e["pid"], "comm" if e.get("cat") == "comm" else "main"))
        colour = _COLOURS.get(e["name"], "#cccccc")
        label = e["name"] if e["name"] not in seen else None
        seen.add(e["name"])
        ax.broken_barh([(a - t0, max(b - a, 1e-3))], (y - 0.4, 0.8), facecolors=colour, label=label)
    ax.set_yticks(range(len(lanes)))
    ax.set_yticklabels([f"rank {r} {kind}" for r, kind in lanes])
    ax.set_xlim(0, t1 - t0)
    ax.invert_yaxis()
    ax.set_xlabel("ms (common clock)")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.4), ncol=8, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
