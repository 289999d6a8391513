"""The cost model at 256-3072 GPUs: published results recomputed, and phalanx projected to 1024.

Run: python benchmarks/scaling.py [--plots docs/img]      (no GPU, no network: it is all model)

1. Every published row (phalanx.planner.published): the model and hardware as published,
   parameters and FLOPs from the architecture, the prediction against the figure, the error
   in points; contrasts, one term changed: no overlap of gradient sync with backward, and
   (1T row) the A100 constant taken from the same paper's smallest row instead.
2. Projections, weak scaling (fixed samples per GPU): ResNet-50 (64 images/GPU, bf16),
   GPT-1.3B (8 sequences/GPU), GPT-13B (2 sequences/GPU) on H100 nodes of 8 with 8 x 400
   Gbit/s InfiniBand (8 -> 1024 GPUs) and with one 25 Gbit/s Ethernet NIC per node
   (8 -> 128 GPUs): DP, DP + int8, DP + PowerSGD (rank 4), ZeRO-1, ZeRO-3, and the planner's
   best dp x tp x pp layout. A strategy that does not fit in 80 GB is left out.
3. Peak memory per GPU of the published runs that state it (published.MEMORY), term by term, and at both ends of
   the allocator's overhead (x 1 with expandable segments, x FRAGMENTATION with the default settings).
4. The step of the torchtitan 8B rows (8 Grand Teton H100s, eager; 32 H200s, compile + Float8) and of Megatron-LM's
   7.1B row term by term, against the step the published figure implies (``--budget KEY`` for any row); a Megatron-LM
   row also as Megatron-Core runs its data parallel and optimizer (planner.megatron), at micro-batch 1, 2 and 4. And
   every H100 / H200 row with NCCL's expected NVLink bus bandwidth (published.NCCL_H100_NVLINK_BUS), a contrast.
5. With --plots DIR: DIR/scaling_ib400.png, DIR/scaling_eth25.png (throughput and efficiency
   against GPU count, published points on the same axes) and DIR/scaling_published.png.
"""

from __future__ import annotations

import argparse
import dataclasses
import os

from phalanx.planner import hardware, megatron, memory, published, scaling, workloads

PER_GPU = {"resnet50": 64, "gpt-1.3b": 8, "gpt-13b": 2}
STRATEGIES = {
    "DP": dict(),
    "DP+int8": dict(compression="int8"),
    "DP+PowerSGD": dict(compression="powersgd"),
    "ZeRO-1": dict(zero=1),
    "ZeRO-3": dict(zero=3),
}


def _model(name: str) -> workloads.Workload:
    w = workloads.get(name)
    return dataclasses.replace(w, precision="bf16") if w.kind == "cnn" else w  # H100: mixed precision


def table() -> list[dict]:
    rows = []
    for row in published.ROWS:
        pred = published.reproduce(row)
        serial = published.reproduce(dataclasses.replace(row, job=dataclasses.replace(row.job, overlap=False),
                                                         base=row.base and dataclasses.replace(row.base, overlap=False)))
        rows.append({"key": row.key, "source": row.source, "model": row.model, "hardware": row.hardware,
                     "metric": row.metric, "published": row.figure, "predicted": pred, "error": published.error(row, pred),
                     "bound": row.bound, "no_overlap": serial})
    return rows


def published_step(row: published.Row) -> float:
    """The step time (s) a row's published figure implies: its tokens per GPU per step over tokens/s per GPU, or its
    model FLOPs per GPU per step over the MFU's FLOP/s."""
    w, hw = workloads.get(row.model), hardware.get(row.hardware)
    if row.metric == "tokens":
        return row.job.global_batch * w.seq / row.job.gpus / row.figure
    if row.metric == "mfu":
        return w.model_flops_per_sample * row.job.global_batch / row.job.gpus / (row.figure * hw.gpu.peak[w.precision])
    raise ValueError(f"{row.key}: a {row.metric} row has no step time of its own; choose a tokens or mfu row")


def budget(key: str) -> list[str]:
    """The model's step of one published row, term by term, and the published step."""
    row = published.by_key(key)
    p = scaling.predict(workloads.get(row.model), hardware.get(row.hardware), row.job)
    lines = [f"{key}: {row.job} ({row.hardware})"]
    for name, t in p.parts["compute_terms"].items():
        lines.append(f"  {name:<34} {t * 1e3:9.1f} ms")
    other = p.step_s - p.parts["compute_s"]
    lines.append(f"  {'compute (sum of the above)':<34} {p.parts['compute_s'] * 1e3:9.1f} ms")
    for name in ("bubble_s", "p2p_s", "tp_s", "dp_exposed_s", "codec_s"):
        if p.parts[name]:
            lines.append(f"  {name:<34} {p.parts[name] * 1e3:9.1f} ms")
    want = published_step(row)
    lines.append(f"  {'step, model':<34} {p.step_s * 1e3:9.1f} ms  (communication and bubble {other * 1e3:.1f} ms)")
    lines.append(f"  {'step, published':<34} {want * 1e3:9.1f} ms  -> not priced: {(want - p.step_s) * 1e3:.1f} ms "
                 f"({(want - p.step_s) / want:.0%} of the published step)")
    if key.startswith("megatron-h100"):
        lines += megatron_contrast(row, want)
    return lines


def megatron_contrast(row: published.Row, want: float) -> list[str]:
    """A Megatron-LM row's step with its data parallel and optimizer as Megatron-Core f2e5db4 runs them
    (planner.megatron), at the row's micro-batch and the others the README leaves open, the tensor-parallel term
    fully exposed (as the model prices it) and fully hidden (the bound --tp-comm-overlap cannot beat)."""
    w, hw = workloads.get(row.model), hardware.get(row.hardware)
    s = megatron.step(w, hw, row.job)
    lines = ["  as Megatron-Core f2e5db4 runs it (planner.megatron): fp32 reduce-scatter in the last micro-batch, "
             "bf16 gather in the first, Adam on 1/dp"]
    for name in ("reduce_s", "reduce_exposed_s", "gather_s", "gather_exposed_s", "optimizer_s"):
        lines.append(f"    {name:<32} {s[name] * 1e3:9.1f} ms")
    lines.append(f"    {'step':<32} {s['step_s'] * 1e3:9.1f} ms  -> error {want / s['step_s'] - 1:+.1%} "
                 f"(the model's own {want / s['model_step_s'] - 1:+.1%})")
    if row.job.pp == 1:
        cells = []
        for mb in (1, 2, 4):
            job = dataclasses.replace(row.job, micro_batch=mb, accumulate=mb * row.job.dp < row.job.global_batch)
            t = megatron.step(w, hw, job)
            cells.append(f"micro-batch {mb}: {want / t['step_s'] - 1:+.1%} / {want / (t['step_s'] - t['tp_s']) - 1:+.1%}")
        lines.append("    error with TP exposed / hidden, " + "; ".join(cells))
    return lines


def memory_table() -> list[str]:
    """Each published memory row: the figure, the model's (with the row's allocator), the error and bound, the model
    at both allocator ends, and its terms in GiB."""
    g = 2**30
    lines = [f"{'row':<34} {'published':>9} {'model':>7} {'error':>7} {'bound':>5} {'x1':>6} {'x1.21':>6}   "
             "states / gathered / activations / pipeline / overhead (GiB)"]
    for row in published.MEMORY:
        w = workloads.get(row.model)
        pred = published.reproduce(row)
        parts = memory.breakdown(w, row.job)
        peak = sum(parts.values()) - parts["overhead"]
        lines.append(f"{row.key:<34} {row.figure:>9.1f} {pred:>7.1f} {published.error(row, pred) * 100:>+6.1f}% "
                     f"{row.bound * 100:>4.0f}% {peak / g:>6.1f} {peak * memory.FRAGMENTATION / g:>6.1f}   "
                     + " / ".join(f"{parts[k] / g:.1f}" for k in ("states", "gathered", "activations", "pipeline",
                                                                       "overhead")))
    return lines


def project(hw_name: str, gpus: list[int]) -> dict:
    hw = hardware.get(hw_name)
    out: dict = {}
    for name, per_gpu in PER_GPU.items():
        w = _model(name)
        for label, kw in STRATEGIES.items():
            pts = []
            for n in gpus:
                p = scaling.predict(w, hw, scaling.Job(dp=n, global_batch=n * per_gpu, **kw))
                if p.fits(hw):
                    pts.append((n, p.samples_per_s, p.efficiency, p.flops_per_gpu * n, str(p.job)))
            out[(name, label)] = pts
        pts = []
        for n in gpus:
            try:
                best = scaling.search(w, hw, n, n * per_gpu)[0]
            except ValueError:
                continue
            pts.append((n, best.samples_per_s, best.efficiency, best.flops_per_gpu * n, str(best.job)))
        out[(name, "best 3D")] = pts
    return out


def published_points() -> list[tuple]:
    """(gpus, efficiency, aggregate FLOP/s, label, predicted efficiency, predicted FLOP/s) per published
    point; None where the source gives no such figure."""
    out = []
    for row in published.ROWS:
        if row.key == "horovod-inception3" or row.metric in ("tokens", "mfu"):
            continue  # same GPUs and figure as ResNet-101: one star; throughput and MFU rows are in the table
        w, hw = workloads.get(row.model), hardware.get(row.hardware)
        p = scaling.predict(w, hw, row.job)
        pred = published.reproduce(row)
        flops = {"megatron-8.3b": 15.1e15, "narayanan-1t": 502e15}.get(row.key)
        eff = row.figure if row.metric == "efficiency" else None
        out.append((row.job.gpus, eff, flops, row.key, pred if eff else None,
                    p.flops_per_gpu * row.job.gpus if flops else None))
    r101 = workloads.get("resnet101").train_flops_per_sample
    out.append((16, None, 1656.82 * r101, "Horovod ResNet-101 16 GPUs", None, None))
    return out


def plot(proj: dict, title: str, path: str, pubs: list[tuple]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 5.5))
    colors = {"resnet50": "tab:blue", "gpt-1.3b": "tab:orange", "gpt-13b": "tab:green"}
    styles = {"DP": "-", "DP+int8": "--", "DP+PowerSGD": ":", "ZeRO-1": "-.", "ZeRO-3": (0, (3, 1, 1, 1, 1, 1)),
              "best 3D": "-"}
    for (model, label), pts in proj.items():
        if not pts:
            continue
        n = [p[0] for p in pts]
        kw = dict(color=colors[model], linestyle=styles[label], linewidth=3 if label == "best 3D" else 1.3,
                  alpha=0.55 if label == "best 3D" else 1.0, label=f"{model} {label}")
        ax1.plot(n, [p[3] / 1e15 for p in pts], marker="o", markersize=3, **kw)
        ax2.plot(n, [p[2] for p in pts], marker="o", markersize=3, **kw)
    for i, (n, eff, flops, label, eff_pred, flops_pred) in enumerate(pubs):
        dy, dx = 6 - 12 * (i % 3), (6 if i % 2 == 0 or label.startswith("horovod") else -95)
        if flops:
            ax1.scatter([n], [flops / 1e15], marker="*", s=160, color="black", zorder=5)
            ax1.annotate(label, (n, flops / 1e15), fontsize=7, xytext=(dx, dy), textcoords="offset points")
        if flops_pred:
            ax1.scatter([n], [flops_pred / 1e15], marker="o", s=60, facecolors="none", edgecolors="red", zorder=6)
        if eff:
            ax2.scatter([n], [eff], marker="*", s=160, color="black", zorder=5)
            ax2.annotate(label, (n, eff), fontsize=7, xytext=(dx, dy), textcoords="offset points")
        if eff_pred:
            ax2.scatter([n], [eff_pred], marker="o", s=60, facecolors="none", edgecolors="red", zorder=6)
    ax1.set(xscale="log", yscale="log", xlabel="GPUs", ylabel="achieved PFLOP/s (all GPUs)",
            title=f"{title}: throughput")
    ax2.set(xscale="log", xlabel="GPUs", ylabel="scaling efficiency (compute / step)", ylim=(0, 1.05),
            title=f"{title}: efficiency")
    ax2.axhline(0.8, color="grey", linewidth=0.6)
    for ax in (ax1, ax2):
        ax.grid(True, which="both", alpha=0.3)
    ax2.legend(fontsize=6, ncol=2, loc="lower left")
    ax1.text(0.01, 0.99, "black stars: published (their own hardware, docs/scaling.md); red circles: our prediction of them", transform=ax1.transAxes,
             fontsize=7, va="top")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_published(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r["metric"] in ("efficiency", "peak")]  # errors in points; the others: the table
    fig, ax = plt.subplots(figsize=(8, 5))
    y = range(len(rows))
    ax.barh([i + 0.2 for i in y], [r["published"] for r in rows], height=0.4, label="published", color="black")
    ax.barh([i - 0.2 for i in y], [r["predicted"] for r in rows], height=0.4, label="phalanx cost model",
            color="tab:blue")
    ax.set_yticks(list(y), [f"{r['key']} ({'% peak' if r['metric'] == 'peak' else 'eff.'})" for r in rows],
                  fontsize=8)
    for i, r in zip(y, rows):
        ax.text(max(r["published"], r["predicted"]) + 0.01, i, f"{r['error'] * 100:+.1f} pts", va="center", fontsize=8)
    ax.set(xlim=(0, 1.15), xlabel="scaling efficiency, or fraction of peak FLOP/s")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2)
    ax.set_title("published vs predicted (architecture FLOPs, published hardware, one MFU per GPU generation)",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--plots", default=None, help="directory for the PNGs (e.g. docs/img)")
    ap.add_argument("--budget", action="append", default=None, metavar="KEY",
                    help="print this published row's step term by term (repeatable); default: three rows")
    args = ap.parse_args()
    try:  # a wrong key: one line, before anything else is printed
        budgets = [budget(key) for key in args.budget or ("torchtitan-8b-8", "torchtitan-8b-h200-32",
                                                            "megatron-h100-7.1b")]
    except (KeyError, ValueError) as e:
        raise SystemExit(str(e).strip("'\"")) from None
    rows = table()
    print(f"{'row':<24} {'metric':<10} {'published':>9} {'predicted':>9} {'error':>8} {'bound':>6} "
          f"{'no overlap':>10}")
    for r in rows:
        unit = "%" if r["metric"] in ("tokens", "mfu") else "p"  # throughput and MFU rows: relative error
        print(f"{r['key']:<24} {r['metric']:<10} {r['published']:>9.2f} {r['predicted']:>9.3f} "
              f"{r['error'] * 100:>+7.1f}{unit} {r['bound'] * 100:>5.0f}{unit} {r['no_overlap']:>10.3f}")
    one_t = published.by_key("narayanan-1t")
    print(f"\nnarayanan-1t with the A100 constant from the same paper's 1.7B row (0.44): "
          f"{published.reproduce(one_t, mfu=0.44):.3f} of peak")
    w17, a100 = workloads.get("gpt-1.7b"), hardware.get("a100-hdr")
    p17 = scaling.predict(w17, a100, scaling.Job(dp=32, global_batch=512, overlap=False))
    print(f"Narayanan Table 1 row 1 (1.7B, 32 A100, data parallel): predicted "
          f"{p17.flops_per_gpu / a100.gpu.peak['bf16']:.3f} of peak, published 0.44")
    vgg = published.by_key("horovod-vgg16")
    for m in (1.0, 1.5):
        print(f"horovod-vgg16 if VGG-16 ran at {m:.0%} of peak in nominal FLOPs: {published.reproduce(vgg, mfu=m):.3f}")
    lo, hi = published.GT_GEMM_SCALE_ENDS
    print(f"\ntorchtitan's Grand Teton H100 (500 W, HBM2e, peak 'between SXM and NVL'): each row at the NVL end "
          f"(gemm_scale {lo:.3f}), the profile's middle ({hardware.get('h100-gt').gpu.gemm_scale:.3f}), the SXM end ({hi:.0f})")
    for row in published.TORCHTITAN:
        at = [published.error(row, published.reproduce(row, gemm_scale=s)) for s in (lo, None, hi)]
        print(f"  {row.key:<26} " + "  ".join(f"{e * 100:+6.1f}%" for e in at))
    gt8, h32 = published.by_key("torchtitan-8b-8-float8"), published.by_key("torchtitan-8b-h200-32")
    ratios = [published.reproduce(gt8, gemm_scale=s) / published.reproduce(h32) for s in (lo, None, hi)]
    print(f"  Grand Teton / H200, the same 8B job (compile + Float8): published {gt8.figure / h32.figure:.3f}, "
          f"model {ratios[0]:.3f} / {ratios[1]:.3f} / {ratios[2]:.3f}")
    nvlink = published.NCCL_H100_NVLINK_BUS
    print(f"\nWith NCCL's expected bus bandwidth on 8 H100s over NVLink ({nvlink / 1e9:.0f} GB/s, nccl-tests#326) "
          "instead of the datasheet's 450: the rows that move (a contrast; the rows keep 450)")
    for row in published.ROWS:
        if "NVLink4" not in hardware.get(row.hardware).node.name:  # the H100 / H200 nodes only
            continue
        now, then = published.reproduce(row), published.reproduce(row, nvlink=nvlink)
        if abs(then / now - 1) > 1e-4:
            e = published.error(row, then)
            print(f"  {row.key:<30} {published.error(row, now) * 100:+6.1f}% -> {e * 100:+6.1f}%"
                  + ("  (out of its bound)" if abs(e) > row.bound else ""))
    print("\nPeak memory per GPU, published (reserved, GiB) against the model")
    print("\n".join(memory_table()))
    print("\nThe step term by term against the published step (compute: blocks x micro-batches, head, optimizer, FSDP2)")
    for lines in budgets:
        print("\n".join(lines))
    projections = {}
    for hw_name, gpus in (("h100-ib400", [8, 16, 32, 64, 128, 256, 512, 1024]),
                          ("h100-eth25", [8, 16, 32, 64, 128])):
        proj = project(hw_name, gpus)
        projections[hw_name] = proj
        print(f"\n{hw_name}: efficiency (samples/s) per GPU count; '-' = does not fit in 80 GB")
        print(f"{'model':<9} {'strategy':<12} " + " ".join(f"{n:>14}" for n in gpus))
        for (model, label), pts in proj.items():
            by_n = {p[0]: p for p in pts}
            cells = [f"{by_n[n][2]:>4.0%} {by_n[n][1]:>9.0f}" if n in by_n else f"{'-':>14}" for n in gpus]
            print(f"{model:<9} {label:<12} " + " ".join(cells))
        for model in PER_GPU:
            pts = proj[(model, "best 3D")]
            if pts:
                print(f"  best 3D {model}: " + "; ".join(f"{p[0]}: {p[4]}" for p in pts))
    if args.plots:
        os.makedirs(args.plots, exist_ok=True)
        pubs = published_points()
        plot(projections["h100-ib400"], "H100 x 8/node, 8 x 400 Gbit/s IB", os.path.join(args.plots,
                                                                                         "scaling_ib400.png"), pubs)
        plot(projections["h100-eth25"], "H100 x 8/node, 25 Gbit/s Ethernet",
             os.path.join(args.plots, "scaling_eth25.png"), pubs)
        plot_published(rows, os.path.join(args.plots, "scaling_published.png"))
        print(f"\nplots in {args.plots}: scaling_ib400.png scaling_eth25.png scaling_published.png")


if __name__ == "__main__":
    main()
