"""Achieved rates of the kernels a transformer step is made of, on this GPU, at the published rows' shapes.

Run on a CUDA machine: ``python benchmarks/gpu/kernel_rates.py --out rates.jsonl`` (about 1 minute on one H100),
and ``--only mlperf`` for the MLPerf GPT-3 shapes (seconds). The planner's compute term for H100-class GPUs
(``phalanx.planner.kernels``) reads the results, kept in ``benchmarks/results/gpu-h100-kernel-rates.jsonl`` and
``gpu-h100-kernel-rates-mlperf.jsonl``. One JSON line per measurement:

- ``linear``: one ``nn.Linear`` without bias (x[M,K] @ W[N,K]^T) in bf16, forward alone and forward + backward
  (the three GEMMs: y = x W^T, dx = dy W, dW = dy^T x), at each (M, K, N) the rows run per GPU;
- ``fp8_gemm``: the same three GEMMs as ``torch._scaled_mm`` with tensorwise scales (e4m3 inputs and weights,
  e5m2 gradients, bf16 out: torchao's Float8Linear "tensorwise" recipe, the one torchtitan's Dec 2024 runs used);
  the casts are not in it (the planner prices them by their HBM bytes);
- ``attention``: ``scaled_dot_product_attention`` (flash, causal), forward and forward + backward, at (b, heads,
  s, d) with the key/value heads repeated to the query heads (torchtitan's repeat_kv);
- ``copy``: device-to-device copy bandwidth (bytes read + written per second);
- ``llama_block``: one Llama 3 block as torchtitan writes it (RMSNorm in fp32, complex RoPE, repeat_kv + SDPA,
  SwiGLU), forward + backward, eager and under torch.compile: the check of the planner's elementwise terms.

Median of ``--iters`` timed runs after warm-up, CUDA events. Nothing here is used unless it is written to
benchmarks/results and the planner is pointed at it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

BF16 = torch.bfloat16


def timed(fn, iters: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b) / 1e3)
    return statistics.median(out)


def mlperf_shapes() -> dict:
    """MLPerf Training v3.1 GPT-3 175B as NVIDIA ran it at 10,752 H100s (TP 4, micro-batch 1, sequence 2048,
    vocabulary 50,257 padded to 50,688): fused QKV, proj, fc1, fc2, output, tensor-parallel shards."""
    h, tp, t = 12288, 4, 2048
    return {(t, k, n): f"gpt3-175b-tp4-mb1/{name}" for name, k, n in (
        ("qkv", h, 3 * h // tp), ("proj", h // tp, h), ("fc1", h, 4 * h // tp), ("fc2", 4 * h // tp, h),
        ("out", h, 50688 // tp))}


def linear_shapes() -> dict:
    """(M, K, N) per GPU for each row: Llama 3.1 (torchtitan: separate wq/wk/wv, w1/w3/w2, output) and the
    Megatron-LM GPTs (fused QKV, proj, fc1, fc2, output), tensor-parallel shards."""
    shapes = {}

    def llama(tag, h, kv, ffn, vocab, tp, tokens):
        for name, k, n in (("wq", h, h // tp), ("wk", h, kv // tp), ("wo", h // tp, h), ("w1", h, ffn // tp),
                           ("w2", ffn // tp, h), ("out", h, vocab // tp)):
            shapes[(tokens, k, n)] = f"{tag}/{name}"

    llama("llama8b-tp1-b2", 4096, 1024, 14336, 128256, 1, 2 * 8192)
    llama("llama70b-tp8-b16", 8192, 1024, 28672, 128256, 8, 16 * 8192)
    llama("llama405b-tp8-b4", 16384, 1024, 53248, 128256, 8, 4 * 8192)
    for h, tp in ((2048, 1), (4096, 2), (6144, 4), (7168, 8), (8192, 8), (10240, 8), (12288, 8), (16384, 8),
                  (18432, 8)):
        for mb in (1, 2, 4):
            t = mb * 4096
            for name, k, n in (("qkv", h, 3 * h // tp), ("proj", h // tp, h), ("fc1", h, 4 * h // tp),
                               ("fc2", 4 * h // tp, h), ("out", h, 131072 // tp)):
                shapes.setdefault((t, k, n), f"gpt-h{h}-tp{tp}-mb{mb}/{name}")
    return shapes


def bench_linear(m, k, n, iters):
    x = torch.randn(m, k, device="cuda", dtype=BF16, requires_grad=True)
    w = torch.randn(n, k, device="cuda", dtype=BF16, requires_grad=True)
    g = torch.randn(m, n, device="cuda", dtype=BF16)
    fwd = timed(lambda: F.linear(x, w), iters)

    def step():
        y = F.linear(x, w)
        y.backward(g)
        x.grad = w.grad = None

    both = timed(step, iters)
    return fwd, both


def bench_fp8(m, k, n, iters):
    e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
    one = torch.ones((), device="cuda")
    x = torch.randn(m, k, device="cuda").to(e4)
    wt = torch.randn(k, n, device="cuda").to(e4)          # W^T row-major: W as column-major (N, K)^T
    w_nk = torch.randn(n, k, device="cuda").to(e4)        # W row-major for dgrad's column-major operand
    go = torch.randn(m, n, device="cuda").to(e5)
    go_t = torch.randn(n, m, device="cuda").to(e5)
    x_t = torch.randn(k, m, device="cuda").to(e4)

    def mm(a, b):
        return torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=BF16)

    fwd = timed(lambda: mm(x, w_nk.t()), iters)                # x[M,K] @ W^T: W row-major (N,K) -> .t()
    dgrad = timed(lambda: mm(go, wt.t()), iters)            # dy[M,N] @ W[N,K]: W^T row-major (K,N) -> .t()
    wgrad = timed(lambda: mm(go_t, x_t.t()), iters)         # dy^T[N,M] @ x[M,K]: x^T row-major (K,M) -> .t()
    return fwd, dgrad, wgrad


def bench_attention(b, hq, s, d, iters):
    q, k, v = (torch.randn(b, hq, s, d, device="cuda", dtype=BF16, requires_grad=True) for _ in range(3))
    g = torch.randn(b, hq, s, d, device="cuda", dtype=BF16)
    fwd = timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), iters)

    def step():
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        o.backward(g)
        q.grad = k.grad = v.grad = None

    return fwd, timed(step, iters)


class Block(torch.nn.Module):
    """A Llama 3 block as torchtitan writes it (its model.py, Dec 2024), for one GPU (no TP)."""

    def __init__(self, h, heads, kv_heads, ffn):
        super().__init__()
        self.h, self.heads, self.kv, self.hd = h, heads, kv_heads, h // heads
        lin = lambda i, o: torch.nn.Linear(i, o, bias=False)  # noqa: E731
        self.wq, self.wk, self.wv, self.wo = lin(h, h), lin(h, kv_heads * self.hd), lin(h, kv_heads * self.hd), lin(h, h)
        self.w1, self.w2, self.w3 = lin(h, ffn), lin(ffn, h), lin(h, ffn)
        self.n1, self.n2 = torch.nn.Parameter(torch.ones(h)), torch.nn.Parameter(torch.ones(h))

    @staticmethod
    def norm(x, w):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).type_as(x) * w

    def rope(self, x, freqs):
        xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(xc * freqs).flatten(3).type_as(x)

    def forward(self, x, freqs):
        b, s, _ = x.shape
        y = self.norm(x, self.n1)
        q = self.wq(y).view(b, s, self.heads, self.hd)
        k = self.wk(y).view(b, s, self.kv, self.hd)
        v = self.wv(y).view(b, s, self.kv, self.hd)
        q, k = self.rope(q, freqs), self.rope(k, freqs)
        rep = self.heads // self.kv
        k = k[:, :, :, None, :].expand(b, s, self.kv, rep, self.hd).reshape(b, s, self.heads, self.hd)
        v = v[:, :, :, None, :].expand(b, s, self.kv, rep, self.hd).reshape(b, s, self.heads, self.hd)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.wo(o.transpose(1, 2).reshape(b, s, self.h))
        y = self.norm(x, self.n2)
        return x + self.w2(F.silu(self.w1(y)) * self.w3(y))


def bench_block(iters, compile_it):
    h, heads, kv, ffn, b, s = 4096, 32, 8, 14336, 2, 8192
    blk = Block(h, heads, kv, ffn).cuda().to(BF16)
    hd = h // heads
    inv = 1.0 / (500000.0 ** (torch.arange(0, hd, 2, device="cuda").float() / hd))
    freqs = torch.polar(torch.ones(s, hd // 2, device="cuda"), torch.outer(torch.arange(s, device="cuda").float(), inv))
    freqs = freqs[None, :, None, :]
    x = torch.randn(b, s, h, device="cuda", dtype=BF16, requires_grad=True)
    g = torch.randn(b, s, h, device="cuda", dtype=BF16)
    f = torch.compile(blk) if compile_it else blk

    def step():
        f(x, freqs).backward(g)
        x.grad = None
        for p in blk.parameters():
            p.grad = None

    fwd = timed(lambda: f(x, freqs), iters, warmup=3)
    return fwd, timed(step, iters, warmup=3)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--skip-block", action="store_true")
    ap.add_argument("--only", choices=("all", "mlperf"), default="all",
                    help="mlperf: the MLPerf GPT-3 shapes alone (bf16 and float8 linears, attention)")
    a = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    dev = torch.cuda.get_device_properties(0)
    t0 = time.time()
    with open(a.out, "w") as fh:
        def emit(rec):
            fh.write(json.dumps(rec) + "\n")
            fh.flush()
            print(json.dumps(rec), flush=True)

        emit({"step": "machine", "gpu": dev.name, "torch": torch.__version__, "sms": dev.multi_processor_count})
        src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        t = timed(lambda: dst.copy_(src), 20)
        emit({"step": "copy", "bytes": 2 * src.numel(), "s": t, "bytes_per_s": 2 * src.numel() / t})
        shapes = mlperf_shapes() if a.only == "mlperf" else linear_shapes()
        for (m, k, n), tag in sorted(shapes.items(), key=lambda kv: kv[1]):
            fwd, both = bench_linear(m, k, n, a.iters)
            rec = {"step": "linear", "tag": tag, "m": m, "k": k, "n": n, "fwd_s": fwd, "fwd_bwd_s": both,
                   "fwd_tflops": 2 * m * k * n / fwd / 1e12, "fwd_bwd_tflops": 6 * m * k * n / both / 1e12}
            if tag.startswith(("llama", "gpt3")):
                try:
                    f8 = bench_fp8(m, k, n, a.iters)
                    rec8 = {"step": "fp8_gemm", "tag": tag, "m": m, "k": k, "n": n, "fwd_s": f8[0], "dgrad_s": f8[1],
                            "wgrad_s": f8[2], "fwd_bwd_tflops": 6 * m * k * n / sum(f8) / 1e12}
                except Exception as e:  # noqa: BLE001 - a record of what failed, not a crash
                    rec8 = {"step": "fp8_gemm", "tag": tag, "error": repr(e)[:300]}
                emit(rec8)
            emit(rec)
            torch.cuda.empty_cache()
        attn = (("llama8b", 2, 32, 8192), ("llama70b-tp8", 16, 8, 8192), ("llama405b-tp8", 4, 16, 8192),
                ("gpt-h2048-tp1", 1, 16, 4096), ("gpt-h4096-tp2", 1, 16, 4096), ("gpt-h6144-tp4", 1, 12, 4096),
                ("gpt-h7168-tp8", 1, 7, 4096), ("gpt-h8192-tp8", 1, 8, 4096), ("gpt-h16384-tp8", 1, 16, 4096))
        if a.only == "mlperf":
            attn = (("gpt3-175b-tp4", 1, 24, 2048),)
        for tag, b, hq, s in attn:
            fwd, both = bench_attention(b, hq, s, 128, a.iters)
            emit({"step": "attention", "tag": tag, "b": b, "heads": hq, "s": s, "d": 128, "fwd_s": fwd,
                  "fwd_bwd_s": both, "causal": True})
        if not a.skip_block and a.only == "all":
            for comp in (False, True):
                try:
                    fwd, both = bench_block(a.iters, comp)
                    emit({"step": "llama_block", "model": "llama3-8b", "b": 2, "s": 8192, "compile": comp,
                          "fwd_s": fwd, "fwd_bwd_s": both})
                except Exception as e:  # noqa: BLE001
                    emit({"step": "llama_block", "compile": comp, "error": repr(e)[:300]})
        emit({"step": "done", "seconds": time.time() - t0})


if __name__ == "__main__":
    main()
