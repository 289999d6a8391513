"""The two plots of docs/benchmarks.md, from figures in benchmarks/LOG.md (hard-coded here, nothing measured).

``python benchmarks/plots/headline.py`` writes

* ``docs/img/benchmarks_ratios.png``: phalanx against its peer, as the log states each ratio
  (>1 = phalanx faster), one row per headline claim, a dot per figure, the goal as a red tick
  where the log names one. Rows of the log (anchors in benchmarks/LOG.md):
  ``dp-ddp-paired`` (DataParallel and hvd.DistributedOptimizer vs DDP and DDP with bucket views,
  paired medians, cpu2, 2026-11-25); ``gpu-overhead`` (world of one, h100, 2026-11-26);
  ``compress-1gbit-overlap`` (int8+overlap and PowerSGD vs DDP, PowerSGD vs torch's hook, runs 1
  and 2); ``arch-ab-quiet`` (compression on loopback, new tree; ZeRO stage 1 vs
  ZeroRedundancyOptimizer and stage 3 vs FSDP2; pipeline 1F1B and eager 1F1B vs torch
  Schedule1F1B); ``hier-64mb``; ``ckpt-throughput``; ``keras-tf``; ``keras-torch``;
  ``balance-quiet`` and ``balance-f-dominated``. The goals are the ones those rows name, except
  ZeRO's "throughput at least equal", which docs/zero.md names.
* ``docs/img/benchmarks_gpu_codecs.png``: each codec's compress + decompress round trip on a
  100 MB fp32 gradient in multiples of one device copy (71 us), run 3 (after the fixes of runs 1
  and 2) and run 1 (all eager), with the goal of 5x. Row ``gpu-codecs`` of the log (h100, 2026-11-26).

Needs matplotlib only.
"""

import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUT = os.path.join(ROOT, "docs", "img")

# (label, device, figures as the log writes them, goal or None), top to bottom
RATIOS = [
    ("DataParallel vs DDP (3 models)", "cpu2", ["0.995", "1.001", "0.998"], 1.0),
    ("DataParallel vs DDP bucket views (3 models)", "cpu2", ["0.947", "0.951", "0.967"], None),
    ("hvd.DistributedOptimizer vs DDP (3 models)", "cpu2", ["1.061", "0.999", "1.000"], 1.0),
    ("DataParallel vs DDP, world of one (ResNet-50, GPT-2)", "h100", ["1.28", "1.045"], 0.98),
    ("hvd vs DDP, world of one (ResNet-50, GPT-2)", "h100", ["1.27", "1.040"], 0.98),
    ("int8 + overlap vs DDP at 1 Gbit/s (2 runs)", "cpu2", ["3.18", "3.25"], 3.0),
    ("PowerSGD vs DDP at 1 Gbit/s", "cpu2", ["5.11"], 8.0),
    ("PowerSGD vs torch's PowerSGD hook, 1 Gbit/s (2 runs)", "cpu2", ["2.08", "2.06"], 1.0),
    ("int8, PowerSGD vs DDP on loopback (wire free)", "cpu2", ["0.90", "0.77"], None),
    ("hierarchical vs flat allreduce, 64 MB, 1 Gbit/s", "cpu2", ["1.49"], 1.4),
    ("ZeRO-1 vs ZeroRedundancyOptimizer (speed)", "cpu2", ["0.97"], 1.0),
    ("ZeRO-3 vs FSDP2 (speed)", "cpu2", ["1.96"], 1.0),
    ("pipeline 1F1B, eager 1F1B vs torch Schedule1F1B", "cpu2", ["1.02", "1.06"], 1.0),
    ("checkpoint save, load vs DCP (MiB/s)", "cpu2", ["2.89", "1.10"], None),
    ("Keras TF backend vs MultiWorkerMirroredStrategy", "cpu2", ["2.04"], 1.0),
    ("Keras torch backend vs DataParallel (wide, mlp)", "cpu2", ["0.96", "0.69"], 0.9),
    ("load balancing vs uniform split (conv, F-dominated)", "cpu2", ["1.39", "1.23"], 1.3),
]

# codec: (run 3, run 1) round trip in multiples of a device copy, as the log writes them
CODECS = {
    "fp16": ("1.9", "1.9"), "bf16": ("2.0", "1.9"), "sign no-ef": ("5.2", "21.1"), "sign": ("10.5", "25.4"),
    "int4 no-ef": ("10.1", "14.4"), "int4": ("19.1", "21.9"), "2bit no-ef": ("9.6", "14.6"), "2bit": ("17.2", "22.3"),
    "int8 no-ef": ("11.3", "6.8"), "int8": ("12.6", "9.9"), "topk no-ef": ("8.8", "8.6"), "topk": ("10.8", "10.8"),
    "threshold no-ef": ("8.9", "8.9"), "threshold": ("17.8", "17.7"), "PowerSGD": ("6.9", "4.8"),
}

COLOURS = {"cpu2": "tab:blue", "h100": "tab:orange"}


def ratios(path):
    fig, ax = plt.subplots(figsize=(10, 7.2))
    n = len(RATIOS)
    for i, (_label, device, figures, goal) in enumerate(RATIOS):
        y = n - 1 - i
        c = COLOURS[device]
        text = " / ".join(figures)
        figures = [float(f) for f in figures]
        ax.plot([min(figures), max(figures)], [y, y], color=c, lw=2, alpha=0.5)
        ax.plot(figures, [y] * len(figures), "o", color=c, ms=6)
        if goal is not None:
            ax.plot([goal], [y], marker="|", color="red", ms=16, mew=2)
        ax.text(max(figures + [goal or 0, 1.0]) * 1.06, y, text, va="center", fontsize=8)
    ax.axvline(1.0, color="black", lw=1)
    ax.set_xscale("log")
    ax.set_xlim(0.6, 12)
    ticks = [0.7, 1, 1.5, 2, 3, 5, 8]
    ax.set_xticks(ticks)
    ax.set_xticklabels([f"{t:g}x" for t in ticks])
    ax.minorticks_off()
    ax.set_yticks(range(n))
    ax.set_yticklabels([f"{label} [{device}]" for label, device, _, _ in reversed(RATIOS)], fontsize=9)
    ax.set_xlabel("phalanx vs peer, as benchmarks/LOG.md states it (>1 = phalanx faster; log scale)")
    ax.plot([], [], "o", color=COLOURS["cpu2"], label="cpu2: 2 cores, gloo over loopback")
    ax.plot([], [], "o", color=COLOURS["h100"], label="h100: one H100 80GB")
    ax.plot([], [], marker="|", ls="", color="red", ms=12, mew=2, label="goal named in the log")
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title("Speed against the peer, headline claims (one dot per model or run)")
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def codecs(path):
    names = sorted(CODECS, key=lambda k: float(CODECS[k][0]))
    fig, ax = plt.subplots(figsize=(9, 6))
    ys = range(len(names))
    h = 0.38
    ax.barh([y + h / 2 for y in ys], [float(CODECS[k][0]) for k in names], h, color="tab:orange",
            label="run 3 (sign, int4, 2bit through torch.compile, 4/2-bit decode eager)")
    ax.barh([y - h / 2 for y in ys], [float(CODECS[k][1]) for k in names], h, color="tab:gray", alpha=0.6,
            label="run 1 (all eager)")
    for y, k in zip(ys, names):
        ax.text(float(CODECS[k][0]) + 0.3, y + h / 2, CODECS[k][0], va="center", fontsize=8)
    ax.axvline(1.0, color="black", lw=1, label="one device copy")
    ax.axvline(5.0, color="red", lw=1.5, ls="--", label="goal: within 5x a copy")
    ax.set_yticks(list(ys))
    ax.set_yticklabels(names, fontsize=9)
    ax.invert_yaxis()
    ax.set_xlabel("compress + decompress time, in multiples of one device copy (71 us); lower is better")
    ax.set_title("Codecs on one H100, 100 MB fp32 gradient (no-ef = without error feedback)")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=2, fontsize=8, frameon=False)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    os.makedirs(OUT, exist_ok=True)
    ratios(os.path.join(OUT, "benchmarks_ratios.png"))
    codecs(os.path.join(OUT, "benchmarks_gpu_codecs.png"))
    print("wrote docs/img/benchmarks_ratios.png, docs/img/benchmarks_gpu_codecs.png")
