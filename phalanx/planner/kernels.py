"""A transformer step's compute from measured kernel times, for GPUs that have a measured table.

The one-constant model (``GPU.mfu``) prices every FLOP alike. On an H100 that cannot follow the published
runs: a GEMM's achieved rate depends on its shape (Megatron-LM's README: MFU "increases from 41% ... to
47-48%" because "larger GEMMs have higher arithmetic intensity"), Float8 linears run on tensor cores twice as
fast, and eager PyTorch spends a measurable share of a block on elementwise kernels that torch.compile fuses.
This module prices one micro-batch of transformer blocks kernel by kernel, from our own H100 measurement
(``benchmarks/gpu/kernel_rates.py``; the table ``h100_kernel_rates.jsonl`` here is a copy of
``benchmarks/results/gpu-h100-kernel-rates.jsonl``, one NVIDIA H100 80GB HBM3 SXM at 700 W):

    linear      (M tokens, K in, N out) per GPU under tensor parallel (column-parallel QKV / W1 / W3 / FC1:
                N/tp; row-parallel O / W2 / FC2: K/tp): measured forward and forward + backward times at the
                rows' shapes; other shapes: the roofline of the measured best rate and the measured copy
                bandwidth (3 GEMMs: 6MKN FLOPs, 3 x 2(MK + KN + MN) bytes)
    float8      torchao's tensorwise Float8Linear (torchtitan's Dec 2024 recipe): the three GEMMs as measured
                with torch._scaled_mm, plus its casts by their HBM bytes: amax (read 2 B) and cast to both
                layouts (read 2, write 1 + 1) of the input, the output gradient and the weight, 6 B an element
    attention   causal SDPA as torch 2.11 runs it on an H100 (cuDNN's fused attention: torch prefers it on sm90 once
                the bundled cuDNN is past 9.15; Transformer Engine prefers it on Hopper too), measured forward and
                forward + backward at the same sequence length and head dim, scaled by batch x heads (the nearest
                measured batch x heads). ``attention="flash2"``: PyTorch's flash backend, FlashAttention-2, at its
                published H100 SXM5 rates (:data:`FLASH2_H100_TFLOPS`), for software that ran it (torchtitan)
    elementwise norms, RoPE, SwiGLU / GeLU, residual adds: the measured Llama block (torchtitan's code) less
                its GEMMs and attention, per element of the activations the block's linears write
                (q, k, v, o and the MLP's widths), eager and under torch.compile
    recompute   "full": the forward again; "op" (torchtitan's selective op policy: every op's output saved
                except every second matmul's): the forward of the 2nd, 4th, 6th ... matmul of the block plus
                its elementwise forward; "none"
    head        the output layer (a linear of the vocabulary, column-parallel), the fp32 cross-entropy over
                the logits (counted pass by pass: 40 B a logit), and the optimizer (mixed-precision Adam:
                32 B a local parameter through HBM)

On a GPU of the same tensor cores at other clocks or memory (``GPU.gemm_scale``, and the HBM bandwidth
against the measured part's 3.35 TB/s), tensor-core time scales by 1/gemm_scale and memory-bound time by
the bandwidth ratio.

Example::

    from phalanx.planner import kernels, workloads
    t = kernels.H100.block_time(workloads.get("llama3-8b"), tokens=2 * 8192, tp=1)
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

__all__ = ["Kernels", "load", "H100", "MEASURED_HBM_BANDWIDTH", "CE_BYTES_PER_LOGIT", "ADAM_BYTES_PER_PARAM",
           "FP8_CAST_BYTES", "AC_MODES", "ATTENTION_BACKENDS", "FLASH2_H100_TFLOPS", "OPTIMIZER_BYTES_PER_PARAM",
           "get"]

MEASURED_HBM_BANDWIDTH = 3350e9
"""the measured part's datasheet HBM3 bandwidth (NVIDIA H100 SXM5 80GB: 3.35 TB/s)"""
CE_BYTES_PER_LOGIT = 40
"""fp32 cross-entropy, eager: bf16 logits read (2) and cast to fp32 (4); log-softmax's max and sum passes
(4 + 4) and its output (4); backward: the gradient written (4), log-softmax's backward reading it and the
output (8) and writing (4), the cast back to bf16 (4 + 2)"""
ADAM_BYTES_PER_PARAM = 32
"""mixed-precision Adam per local parameter: read fp32 master, m, v, fp32 gradient (16); write master, m, v
(12); the bf16 copy for the next forward (4: read nothing new, write 2, the gather's copy 2)"""
OPTIMIZER_BYTES_PER_PARAM = {"fused": ADAM_BYTES_PER_PARAM, "foreach": 80 + 12}
"""HBM bytes per local parameter of the optimizer step, by implementation. "fused": one kernel (ADAM_BYTES_PER_PARAM).
"foreach": torch.optim.AdamW(foreach=True) after torch.nn.utils.clip_grad_norm_(foreach=True), what torchtitan's
train.py runs (its optimizer.fused defaults to False), over fp32 shards, op by op as torch's _multi_tensor_adam issues
them: weight decay mul_ (r+w 8), exp_avg lerp_ (12), exp_avg_sq mul_ (8) and addcmul_ (12), sqrt (8), div_ (8), add_ eps
(8), addcdiv_ into the parameter (16) = 80; the clip: foreach_norm (4) and mul_ by the clip coefficient (8) = 12"""
FP8_CAST_BYTES = 6
"""per element cast by tensorwise Float8 (compiled): amax read 2, cast read 2, write e4m3/e5m2 in both layouts 1+1"""
AC_MODES = ("none", "op", "full")
ATTENTION_BACKENDS = ("cudnn", "flash2")
"""the causal attention kernel a row's software ran. "cudnn": the measured table's (torch 2.11's SDPA on an H100, whose
604 TFLOP/s forward at s 8192 is cuDNN's class, not FlashAttention-2's 333), and Transformer Engine's choice on Hopper
when both apply (NVIDIA/NeMo#9188's docs): Megatron-LM's and MLPerf's rows. "flash2": PyTorch's flash backend,
FlashAttention-2 (Dao 2023, arXiv:2307.08691), what torchtitan's H100 / H200 runs of Dec 2024 and June 2025 dispatched
to: torch 2.6's SDPA did not pick cuDNN on an H100 (pytorch/pytorch#142132, nightly 2.6.0.dev20241204: 329 TFLOP/s
against cuDNN's 631), and torchtitan at e7c0cae pins [FLASH, EFFICIENT, MATH] everywhere but on B200
(torchtitan/models/attention.py)"""
FLASH2_H100_TFLOPS = {512: (191, 214), 1024: (260, 260), 2048: (298, 291), 4096: (319, 310), 8192: (333, 318),
                      16384: (335, 322)}
"""FlashAttention-2 on an H100 80GB SXM5, head dim 128, BF16, TFLOP/s by sequence length: (forward with the causal
mask, backward), as published by Shah et al. 2024 (FlashAttention-3, arXiv:2407.08608, Fig. 5: forward, causal; Fig. 6:
backward, the figure has no causal variant). FLOPs as that paper counts them: forward 4 s^2 d heads (halved when
causal), backward 2.5 x forward. Other lengths: the nearest one; tensor-core time (scaled by ``gemm_scale``)"""


@dataclasses.dataclass(frozen=True)
class Kernels:
    source: str
    copy_bw: float
    linear: dict
    """(M, K, N) -> (forward s, forward + backward s), bf16"""
    fp8: dict
    """(M, K, N) -> the three GEMMs' seconds in float8 (torch._scaled_mm, tensorwise)"""
    attention: dict
    """(s, d) -> [(batch x heads, forward s, forward + backward s)]"""
    elementwise: dict
    """compiled (bool) -> (forward s, forward + backward s) per element of the linears' outputs"""
    best_rate: float
    """the best measured forward + backward rate of a bf16 linear (FLOP/s): the roofline's roof"""

    # -- kernels ------------------------------------------------------------------------------------
    def linear_time(self, m: float, k: float, n: float, *, float8: bool = False) -> tuple[float, float, float]:
        """(forward, forward + backward, HBM-bound part of it) seconds of a linear x[M,K] W[N,K]^T."""
        key = (int(m), int(k), int(n))
        if key in self.linear:
            fwd, both = self.linear[key]
        else:  # roofline: the best measured rate, or the bytes at the measured copy bandwidth
            flops, nbytes = 2 * m * k * n, 2 * (m * k + k * n + m * n)
            fwd = max(flops / self.best_rate, nbytes / self.copy_bw)
            both = 3 * fwd
        if not float8:
            return fwd, both, 0.0
        gemms = self.fp8.get(key)
        if gemms is None:  # no float8 measurement of this shape: the measured float8/bf16 ratio of the largest
            big = max(self.fp8, key=lambda s: s[0] * s[1] * s[2])
            gemms = both * self.fp8[big] / self.linear[big][1]
        casts = FP8_CAST_BYTES * (m * k + m * n + k * n) / self.copy_bw
        fwd_casts = FP8_CAST_BYTES * (m * k + k * n) / self.copy_bw
        return gemms / 3 + fwd_casts, gemms + casts, casts

    def attention_time(self, batch_heads: float, s: int, d: int, backend: str = "cudnn") -> tuple[float, float]:
        """(forward, forward + backward) seconds of causal attention over ``batch_heads`` heads, as ``backend`` runs
        it (:data:`ATTENTION_BACKENDS`)."""
        if backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention backend {backend!r} unknown; choose one of {', '.join(ATTENTION_BACKENDS)}")
        if backend == "flash2":
            fwd_rate, bwd_rate = FLASH2_H100_TFLOPS[min(FLASH2_H100_TFLOPS, key=lambda n: abs(n - s))]
            fwd_flops = 4 * batch_heads * s * s * d / 2
            fwd = fwd_flops / (fwd_rate * 1e12)
            return fwd, fwd + 2.5 * fwd_flops / (bwd_rate * 1e12)
        runs = self.attention.get((s, d))
        if not runs:  # scale the nearest measured length by s^2 (FLOPs) and d
            s0, d0 = min(self.attention, key=lambda sd: abs(sd[0] - s) + abs(sd[1] - d))
            f, b = self.attention_time(batch_heads, s0, d0)
            r = (s / s0) ** 2 * d / d0
            return f * r, b * r
        bh, f, b = min(runs, key=lambda r: abs(r[0] - batch_heads))
        return f * batch_heads / bh, b * batch_heads / bh

    # -- a block ------------------------------------------------------------------------------------
    def block_terms(self, w, tokens: float, tp: int = 1, *, float8: bool = False, compiled: bool = False,
                    ac: str = "none", sequence_parallel: bool = False, gemm_scale: float = 1.0,
                    hbm_scale: float = 1.0, attention: str = "cudnn") -> dict:
        """Seconds of one transformer block's forward + backward (+ recomputation) on ``tokens`` tokens per GPU,
        term by term: ``linear_s`` (the GEMMs, forward + backward), ``attention_s`` (forward + backward),
        ``recompute_s`` (the GEMMs and attention recomputation runs again), tensor-core time scaled by 1/gemm_scale;
        ``casts_s`` (Float8), ``elementwise_s`` (forward + backward) and ``recompute_elementwise_s``, memory-bound
        time scaled by 1/hbm_scale. ``sequence_parallel`` (Korthikanti et al. 2022): the elementwise work on the
        row-parallel outputs (residual adds, norms) runs on 1/tp of the tokens."""
        if ac not in AC_MODES:
            raise ValueError(f"activation checkpointing {ac!r} unknown; choose one of {', '.join(AC_MODES)}")
        block = next(layer for layer in w.layers if layer.block)
        linear = casts = 0.0
        fwd_mm = []
        width = 0.0
        for i, (out, inp) in enumerate(block.matrices):
            n, k = (out, inp // tp) if i in block.row_parallel else (out // tp, inp)
            f, both, cast = self.linear_time(tokens, k, n, float8=float8)
            linear += both - cast
            casts += cast
            fwd_mm.append(f)
            width += n / tp if sequence_parallel and i in block.row_parallel else n
        heads = w.heads // tp
        af, ab = self.attention_time(tokens / w.seq * heads, w.seq, w.hidden // w.heads, attention)
        ef, eb = self.elementwise[compiled]
        recompute = {"full": sum(fwd_mm) + af,
                     "op": sum(fwd_mm[1::2]),  # torchtitan's policy: every second matmul (2nd, 4th, ...) again
                     "none": 0.0}[ac]
        return {"linear_s": linear / gemm_scale, "attention_s": ab / gemm_scale, "recompute_s": recompute / gemm_scale,
                "casts_s": casts / hbm_scale, "elementwise_s": eb * tokens * width / hbm_scale,
                "recompute_elementwise_s": (ef * tokens * width if ac != "none" else 0.0) / hbm_scale}

    def block_time(self, w, tokens: float, tp: int = 1, **kw) -> dict:
        """:meth:`block_terms` summed: tensor-core time (``gemm_s``) and memory-bound time (``hbm_s``)."""
        t = self.block_terms(w, tokens, tp, **kw)
        return {"gemm_s": t["linear_s"] + t["attention_s"] + t["recompute_s"],
                "hbm_s": t["casts_s"] + t["elementwise_s"] + t["recompute_elementwise_s"]}

    def head_time(self, w, tokens: float, tp: int = 1, *, gemm_scale: float = 1.0, hbm_scale: float = 1.0) -> dict:
        """The output layer and the fp32 cross-entropy over its logits, per micro-batch."""
        _, both, _ = self.linear_time(tokens, w.hidden, w.vocab // tp)
        ce = CE_BYTES_PER_LOGIT * tokens * w.vocab / tp / self.copy_bw
        return {"gemm_s": both / gemm_scale, "hbm_s": ce / hbm_scale}

    def optimizer_time(self, local_params: float, hbm_scale: float = 1.0, implementation: str = "fused") -> float:
        """The optimizer step over ``local_params`` parameters (:data:`OPTIMIZER_BYTES_PER_PARAM`)."""
        if implementation not in OPTIMIZER_BYTES_PER_PARAM:
            choices = ", ".join(OPTIMIZER_BYTES_PER_PARAM)
            raise ValueError(f"optimizer {implementation!r} unknown; choose one of {choices}")
        return OPTIMIZER_BYTES_PER_PARAM[implementation] * local_params / self.copy_bw / hbm_scale


def load(path: str | pathlib.Path) -> Kernels:
    """A table written by ``benchmarks/gpu/kernel_rates.py``."""
    recs = [json.loads(line) for line in pathlib.Path(path).read_text().splitlines() if line.strip()]
    copy_bw = next(r["bytes_per_s"] for r in recs if r["step"] == "copy")
    linear = {(r["m"], r["k"], r["n"]): (r["fwd_s"], r["fwd_bwd_s"]) for r in recs if r["step"] == "linear"}
    fp8 = {(r["m"], r["k"], r["n"]): r["fwd_s"] + r["dgrad_s"] + r["wgrad_s"] for r in recs
           if r["step"] == "fp8_gemm" and "error" not in r}
    attention: dict = {}
    for r in recs:
        if r["step"] == "attention":
            attention.setdefault((r["s"], r["d"]), []).append((r["b"] * r["heads"], r["fwd_s"], r["fwd_bwd_s"]))
    best = max(6 * m * k * n / both for (m, k, n), (_, both) in linear.items())
    elementwise = {}
    for r in recs:  # the Llama 3 8B block (h 4096, 32 heads, 8 kv heads, ffn 14336), b 2, s 8192
        if r["step"] != "llama_block" or "error" in r:
            continue
        h, kv, ffn, tokens = 4096, 1024, 14336, r["b"] * r["s"]
        shapes = [(h, h), (kv, h), (kv, h), (h, h), (ffn, h), (ffn, h), (h, ffn)]
        mm = [linear[(tokens, k, n)] for n, k in shapes]
        att = next(x for x in attention[(r["s"], 128)] if x[0] == r["b"] * 32)
        width = sum(n for n, _ in shapes)
        fwd = r["fwd_s"] - sum(f for f, _ in mm) - att[1]
        both = r["fwd_bwd_s"] - sum(b for _, b in mm) - att[2]
        elementwise[bool(r["compile"])] = (max(fwd, 0.0) / (tokens * width), max(both, 0.0) / (tokens * width))
    return Kernels(str(path), copy_bw, linear, fp8, attention, elementwise, best)


H100_TABLE = pathlib.Path(__file__).with_name("h100_kernel_rates.jsonl")
H100 = load(H100_TABLE)
"""one NVIDIA H100 80GB HBM3 (SXM, 700 W), torch 2.11 + CUDA 13: benchmarks/results/gpu-h100-kernel-rates.jsonl"""

_TABLES = {"h100": H100}


def get(name: str) -> Kernels:
    if name not in _TABLES:
        raise ValueError(f"no measured kernel table {name!r}; choose one of {', '.join(_TABLES)}")
    return _TABLES[name]
