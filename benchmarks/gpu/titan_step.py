"""A real Llama 3 8B training step on one GPU, as torchtitan runs it, beside the planner's kernel-by-kernel price.

Issue 42 leaves 14-15% of the step unpriced in three stacks (docs/scaling.md, "What is left, term by term"): the
planner sums kernels each timed alone on an idle H100 (benchmarks/gpu/kernel_rates.py), and a real step may add what
no kernel has alone: launch gaps, allocator work, lower sustained clocks, kernels that differ inside a step. This
script measures that on one GPU, without a network:

- the model is Llama 3.1 8B's architecture (width 4096, 32 heads, 8 KV heads, SwiGLU 14336, vocabulary 128,256,
  sequence 8192, local batch 2) truncated to ``--layers`` blocks (the 32-block model's states, 128 GB, do not fit one
  GPU); blocks as torchtitan's model.py writes them (kernel_rates.Block), its selective "op" activation
  checkpointing (every op of its save list kept but every second matmul: torchtitan's ``_custom_policy`` at 9dec370),
  FSDP2 ``fully_shard`` per block and at the root with bf16 parameters and fp32 reduction in a world of one, the
  loss ``cross_entropy(logits.float())``, ``clip_grad_norm_(1.0)`` and ``AdamW(foreach=True)``;
- each size is timed over ``--steps`` steps (CUDA events around forward + backward, clipping and the optimizer), with
  the SM clock and the power sampled through NVML during them; the difference between two sizes is what one block
  costs inside a real step, to set beside one block timed alone in the same process (the kernel table's way);
- one step is profiled: the device time of each kernel class (GEMM, attention, elementwise and the rest, copies) and
  how much of the step the GPU was idle (the union of kernel intervals against the wall);
- the planner's prediction for the same job (``scaling.predict`` on the ``h100-ib400`` profile, the H100 SXM5 kernel
  table) is printed beside each size.

Run: ``python benchmarks/gpu/titan_step.py --device cuda --out titan.jsonl`` (about a minute on one H100;
``--compile`` adds torchtitan's per-block torch.compile, 1-2 minutes more). ``--device cpu`` is the dry run.
"""

from __future__ import annotations

import gc
import os
import sys
import threading
import time
from collections import defaultdict

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import check_device, emit, parser  # noqa: E402
from kernel_rates import Block  # noqa: E402

BF16 = torch.bfloat16
# (width, heads, kv heads, ffn, vocab, seq, local batch)
SHAPES = {"cuda": (4096, 32, 8, 14336, 128256, 8192, 2), "cpu": (64, 4, 2, 128, 256, 32, 2)}


def save_list() -> set:
    """torchtitan's ``_save_list`` (train_spec / parallelize_llama.py at 9dec370), as this torch spells the ops."""
    ops = torch.ops.aten
    out = {ops.mm.default, ops._scaled_dot_product_efficient_attention.default,
           ops._scaled_dot_product_flash_attention.default, ops.abs.default, ops.max.default}
    if hasattr(ops, "_scaled_dot_product_cudnn_attention"):
        out.add(ops._scaled_dot_product_cudnn_attention.default)
    return out


def op_sac_context():
    """Selective checkpointing, torchtitan's "op" mode: keep the outputs of the save list's ops, but recompute every
    second matmul (Korthikanti et al. 2022, arXiv:2205.05198, select the cheap-to-recompute activations)."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
    keep, count = save_list(), {"forward": 0, "recompute": 0}

    def policy(ctx, func, *args, **kwargs):
        mode = "recompute" if ctx.is_recompute else "forward"
        if func == torch.ops.aten.mm.default:
            count[mode] += 1
        save = func in keep and not (func == torch.ops.aten.mm.default and count[mode] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE
    return create_selective_checkpoint_contexts(policy)


class Checkpointed(torch.nn.Module):
    def __init__(self, block: torch.nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x, freqs):
        from torch.utils.checkpoint import checkpoint
        return checkpoint(self.block, x, freqs, use_reentrant=False, context_fn=op_sac_context,
                          preserve_rng_state=False)


class Llama(torch.nn.Module):
    def __init__(self, layers, h, heads, kv, ffn, vocab, seq):
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, h)
        self.layers = torch.nn.ModuleList(Checkpointed(Block(h, heads, kv, ffn)) for _ in range(layers))
        self.norm = torch.nn.Parameter(torch.ones(h))
        self.out = torch.nn.Linear(h, vocab, bias=False)
        hd = h // heads
        inv = 1.0 / (500000.0 ** (torch.arange(0, hd, 2).float() / hd))
        freqs = torch.polar(torch.ones(seq, hd // 2), torch.outer(torch.arange(seq).float(), inv))
        self.register_buffer("freqs", freqs[None, :, None, :], persistent=False)

    def forward(self, ids):
        x = self.tok(ids)
        for layer in self.layers:
            x = layer(x, self.freqs)
        return self.out(Block.norm(x, self.norm))


def build(layers: int, device: str, compile_blocks: bool):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    h, heads, kv, ffn, vocab, seq, _ = SHAPES[device]
    model = Llama(layers, h, heads, kv, ffn, vocab, seq).to(device)
    for p in model.parameters():  # a small init, so that the loss stays finite through the timed steps
        torch.nn.init.normal_(p, std=0.02) if p.dim() > 1 else torch.nn.init.ones_(p)
    mp = MixedPrecisionPolicy(param_dtype=BF16 if device == "cuda" else torch.float32, reduce_dtype=torch.float32)
    for i, layer in enumerate(model.layers):
        if compile_blocks:
            layer = torch.compile(layer, fullgraph=True)
            model.layers[i] = layer
        fully_shard(layer, mp_policy=mp, reshard_after_forward=i < layers - 1)
    fully_shard(model, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=8e-4, weight_decay=0.1, foreach=True, fused=False)
    return model, opt


class Clock:
    """SM clock (MHz), power (W) and the clocks-event reasons, sampled every 10 ms through NVML while running."""

    def __init__(self):
        self.samples, self._stop, self._thread = [], threading.Event(), None
        try:
            import pynvml
            pynvml.nvmlInit()
            self._nvml, self._h = pynvml, pynvml.nvmlDeviceGetHandleByIndex(0)
        except Exception:  # noqa: BLE001 - no NVML (the CPU dry run): no samples
            self._nvml = None

    def __enter__(self):
        if self._nvml:
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def _run(self):
        n = self._nvml
        while not self._stop.is_set():
            try:
                reasons = n.nvmlDeviceGetCurrentClocksEventReasons(self._h)
            except Exception:  # noqa: BLE001 - older NVML
                reasons = -1
            self.samples.append((n.nvmlDeviceGetClockInfo(self._h, n.NVML_CLOCK_SM),
                                 n.nvmlDeviceGetPowerUsage(self._h) / 1e3, reasons))
            time.sleep(0.01)

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread:
            self._thread.join()

    def summary(self) -> dict:
        if not self.samples:
            return {}
        sm = sorted(s[0] for s in self.samples)
        watts = sorted(s[1] for s in self.samples)
        reasons = defaultdict(int)
        for s in self.samples:
            reasons[hex(s[2])] += 1
        return {"sm_mhz_median": sm[len(sm) // 2], "sm_mhz_min": sm[0], "sm_mhz_max": sm[-1],
                "power_w_median": watts[len(watts) // 2], "power_w_max": watts[-1], "samples": len(sm),
                "clock_event_reasons": dict(reasons)}


def step_fn(model, opt, ids, labels, device):
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)] if device == "cuda" else None

    def step():
        if ev:
            ev[0].record()
        logits = model(ids)
        loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
        loss.backward()
        if ev:
            ev[1].record()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        if ev:
            ev[2].record()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if ev:
            ev[3].record()
        return loss
    return step, ev


def trainer(layers: int, device: str, compile_blocks: bool):
    """The model, its optimizer and one step on a fixed random batch (seeded)."""
    *_, vocab, seq, batch = SHAPES[device]
    torch.manual_seed(0)
    model, opt = build(layers, device, compile_blocks)
    ids = torch.randint(0, vocab, (batch, seq), device=device)
    labels = torch.randint(0, vocab, (batch, seq), device=device)
    return (model, opt, *step_fn(model, opt, ids, labels, device))


def run_size(args, layers: int, compile_blocks: bool) -> dict:
    device = args.device
    model, opt, step, ev = trainer(layers, device, compile_blocks)
    for _ in range(args.warmup):
        step()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    walls, parts = [], defaultdict(list)
    with Clock() as clock:
        for _ in range(args.steps):
            t0 = time.perf_counter()
            loss = step()
            if device == "cuda":
                torch.cuda.synchronize()
                parts["fwd_bwd_s"].append(ev[0].elapsed_time(ev[1]) / 1e3)
                parts["clip_s"].append(ev[1].elapsed_time(ev[2]) / 1e3)
                parts["optimizer_s"].append(ev[2].elapsed_time(ev[3]) / 1e3)
            walls.append(time.perf_counter() - t0)
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    rec = {"layers": layers, "compile": compile_blocks, "steps": args.steps, "step_s": med(walls),
           "step_s_min": min(walls), "step_s_max": max(walls), "loss": loss.item(),
           **{k: med(v) for k, v in parts.items()}, **clock.summary()}
    if device == "cuda":
        rec["max_memory_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
        rec["max_memory_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
    if args.profile and not compile_blocks and layers == max(args.layers):
        rec["profile"] = profile_step(step, device, args.trace_dir, layers)
    del model, opt, step, ev
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return rec


def kernel_class(name: str) -> str:
    n = name.lower()
    if "flash" in n or "fmha" in n or "attention" in n:
        return "attention"
    if any(k in n for k in ("gemm", "nvjet", "cutlass", "xmma", "sm90_", "cublas", "splitk")):
        return "gemm"
    if "nccl" in n:
        return "nccl"
    if "memcpy" in n or "memset" in n:
        return "copy"
    if "multi_tensor_apply" in n or "foreach" in n:
        return "foreach"
    return "elementwise and other"


def profile_step(step, device: str, trace_dir: str | None, layers: int) -> dict:
    """One step under torch.profiler: device time per kernel class, the GPU's idle share of the step."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        step()
        if device == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    classes, spans, names = defaultdict(float), [], defaultdict(float)
    for e in prof.events():
        if e.device_type != DeviceType.CUDA or getattr(e, "is_user_annotation", False):
            continue  # a range such as "Optimizer.step#AdamW.step" on the GPU's timeline is no kernel
        us = e.time_range.elapsed_us()
        classes[kernel_class(e.name)] += us / 1e6
        names[e.name[:90]] += us / 1e6
        spans.append((e.time_range.start, e.time_range.end))
    busy, end = 0.0, None
    for s, t in sorted(spans):
        if end is None or s > end:
            busy += t - s
            end = t
        elif t > end:
            busy += t - end
            end = t
    first = min((s for s, _ in spans), default=0)
    last = max((t for _, t in spans), default=0)
    out = {"wall_s": wall, "device_busy_s": busy / 1e6, "device_span_s": (last - first) / 1e6,
           "kernel_sum_s": sum(classes.values()), "by_class_s": dict(classes),
           "top_kernels_s": sorted(names.items(), key=lambda kv: -kv[1])[:15]}
    if trace_dir:
        os.makedirs(trace_dir, exist_ok=True)
        prof.export_chrome_trace(os.path.join(trace_dir, f"titan_step_{layers}l.json"))
    return out


def isolated_block(device: str, iters: int) -> dict:
    """One block's forward + backward timed alone, as the kernel table times it, and with the op checkpointing."""
    h, heads, kv, ffn, _, seq, batch = SHAPES[device]
    dtype = BF16 if device == "cuda" else torch.float32
    blk = Block(h, heads, kv, ffn).to(device, dtype)
    hd = h // heads
    inv = 1.0 / (500000.0 ** (torch.arange(0, hd, 2, device=device).float() / hd))
    freqs = torch.polar(torch.ones(seq, hd // 2, device=device), torch.outer(torch.arange(seq, device=device).float(), inv))
    freqs = freqs[None, :, None, :]
    x = torch.randn(batch, seq, h, device=device, dtype=dtype, requires_grad=True)
    g = torch.randn(batch, seq, h, device=device, dtype=dtype)
    out = {}
    for name, f in (("plain_s", blk), ("op_checkpointed_s", Checkpointed(blk))):
        def one(f=f):
            f(x, freqs).backward(g)
            x.grad = None
            for p in blk.parameters():
                p.grad = None
        for _ in range(3):
            one()
        times = []
        for _ in range(iters):
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            one()
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        out[name] = sorted(times)[len(times) // 2]
    return out


def sustain(args, layers: int) -> None:
    """Step without a pause for ``args.sustain`` seconds; one line per 10 s window."""
    device = args.device
    step = trainer(layers, device, False)[2]
    temp = Clock()
    t_end, window = time.perf_counter() + args.sustain, 0
    while time.perf_counter() < t_end:
        walls = []
        with Clock() as clock:
            w_end = time.perf_counter() + min(10.0, args.sustain)
            while time.perf_counter() < w_end:
                t0 = time.perf_counter()
                step()
                if device == "cuda":
                    torch.cuda.synchronize()
                walls.append(time.perf_counter() - t0)
        celsius = None
        if temp._nvml:
            celsius = temp._nvml.nvmlDeviceGetTemperature(temp._h, temp._nvml.NVML_TEMPERATURE_GPU)
        emit(args.out, "titan_sustain", device, layers=layers, window=window, steps=len(walls),
             step_s=sorted(walls)[len(walls) // 2], step_s_max=max(walls), gpu_celsius=celsius, **clock.summary())
        window += 1


def predicted(layers: int, compiled: bool) -> dict:
    """The planner's step for the same job: one GPU, ZeRO-3 (FSDP2) in a world of one, op checkpointing."""
    from phalanx.planner import hardware, published, scaling, workloads
    h, heads, kv, ffn, vocab, seq, batch = SHAPES["cuda"]
    w = workloads.llama(layers, h, heads, kv, ffn, vocab, seq, name=f"llama3-8b-{layers}-blocks")
    job = published.titan_2024(dp=1, global_batch=batch, zero=3, ac="op", compiled=compiled)
    p = scaling.predict(w, hardware.get("h100-ib400"), job)
    return {"step_s": p.step_s, **{k: v for k, v in p.parts["compute_terms"].items()}}


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--layers", type=int, nargs="+", default=None, help="block counts (default cuda: 1 3; cpu: 1 2)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per size (default cuda 8, cpu 2)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--compile", action="store_true", help="also the largest size with per-block torch.compile")
    ap.add_argument("--profile", action="store_true", help="profile one step of the largest eager size")
    ap.add_argument("--trace-dir", default=None, help="write that step's chrome trace here")
    ap.add_argument("--sustain", type=float, default=0.0, metavar="SECONDS",
                    help="instead: the largest eager size stepped for this long, a line per 10 s window "
                         "(step time, SM clock, power, temperature): do clocks fall as the card heats?")
    args = ap.parse_args()
    check_device(args.device)
    args.layers = sorted(args.layers or ([1, 3] if args.device == "cuda" else [1, 2]))
    args.steps = args.steps or (8 if args.device == "cuda" else 2)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    import torch.distributed as dist
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo", rank=0, world_size=1)
    if args.device == "cuda":
        torch.cuda.set_device(0)
        torch.backends.cuda.matmul.allow_tf32 = True
    try:
        if args.sustain:
            return sustain(args, max(args.layers))
        emit(args.out, "titan_block_alone", args.device, **isolated_block(args.device, 8 if args.device == "cuda" else 2))
        runs = [(n, False) for n in args.layers] + ([(max(args.layers), True)] if args.compile else [])
        done = {}
        for layers, comp in runs:
            try:
                rec = run_size(args, layers, comp)
            except Exception as e:  # noqa: BLE001 - a record of what failed, and the next size
                emit(args.out, "titan_step", args.device, layers=layers, compile=comp, error=repr(e)[:400])
                continue
            rec["predicted"] = predicted(layers, comp)
            done[(layers, comp)] = rec
            emit(args.out, "titan_step", args.device, **rec)
        lo, hi = min(args.layers), max(args.layers)
        if (lo, False) in done and (hi, False) in done and hi > lo:
            a, b = done[(lo, False)], done[(hi, False)]
            per = lambda k: (b[k] - a[k]) / (hi - lo)  # noqa: E731
            pa, pb = a["predicted"], b["predicted"]
            emit(args.out, "titan_per_block", args.device, measured_step_s=per("step_s"),
                 predicted_step_s=(pb["step_s"] - pa["step_s"]) / (hi - lo),
                 predicted_terms={k: (pb[k] - pa[k]) / (hi - lo) for k in pb if k != "step_s"},
                 measured_fwd_bwd_s=per("fwd_bwd_s") if "fwd_bwd_s" in a else None,
                 measured_optimizer_s=per("optimizer_s") if "optimizer_s" in a else None,
                 note="the difference between two sizes, per block: one block inside a real step")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
