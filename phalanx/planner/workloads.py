"""Models the planner can size from their architecture: parameters and FLOPs per layer.

Every count here comes from the layer list, not from a published result: a
convolution of ``cin -> cout`` channels, kernel ``kh x kw``, output ``ho x wo`` has
``cin cout kh kw`` weights (plus batch norm's 2 per channel, or a bias) and
``cin cout kh kw ho wo`` multiply-adds per sample; a FLOP is half a multiply-add.
Training costs three forward passes (forward, and a backward twice as heavy); a
transformer block with activation recomputation costs four. The GPTs follow
Narayanan et al. 2021, Eq. 2-3: per block ``12h^2 + 13h`` parameters and
``s (24 h^2 + 4 s h)`` forward FLOPs per sequence, embeddings ``(V + s) h``, the
tied output layer ``2 s h V`` FLOPs.

The layers are kept in forward order with their weight matrices (for PowerSGD's
ratio) and their output sizes (activation memory). Backward meets them in reverse:
a layer's gradient is ready when the backward FLOPs of every layer after it are
done (``Workload.backward_order``), which is what data parallel's buckets wait for.

Example::

    from phalanx.planner import workloads
    w = workloads.get("resnet50")
    w.params, w.train_flops_per_sample      # 25.6e6, 24.6e9
    workloads.names()
"""

from __future__ import annotations

import dataclasses
import math

__all__ = ["Layer", "Workload", "get", "names", "resnet", "vgg16", "inception_v3", "gpt"]


@dataclasses.dataclass(frozen=True)
class Layer:
    name: str
    params: int
    fwd_flops: float
    """forward FLOPs per sample"""
    matrices: tuple = ()
    """(rows, cols) of each weight matrix (a conv's weight as cout x cin*kh*kw)"""
    act_elems: float = 0.0
    """output elements per sample (what backward keeps)"""
    block: bool = False
    """a transformer block (recomputed under activation checkpointing; split by tensor parallel)"""
    row_parallel: tuple = ()
    """indexes into ``matrices`` that tensor parallel splits by their input (Megatron's row-parallel: the
    attention output and the MLP's down projection); the others are split by their output"""


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    layers: tuple[Layer, ...]
    kind: str = "cnn"
    seq: int = 1
    hidden: int = 0
    heads: int = 0
    vocab: int = 0
    recompute: bool = False
    precision: str = "fp32"
    """compute precision: "fp32" (2017-era CNNs), "fp16"/"bf16" (mixed precision)"""

    @property
    def params(self) -> int:
        return sum(layer.params for layer in self.layers)

    @property
    def blocks(self) -> int:
        return sum(1 for layer in self.layers if layer.block)

    @property
    def fwd_flops_per_sample(self) -> float:
        return sum(layer.fwd_flops for layer in self.layers)

    @property
    def model_flops_per_sample(self) -> float:
        """Forward + backward, no recomputation (3 forward passes)."""
        return 3 * self.fwd_flops_per_sample

    @property
    def train_flops_per_sample(self) -> float:
        """What the hardware computes: 3 forward passes, 4 for recomputed blocks."""
        return sum(layer.fwd_flops * (4 if self.recompute and layer.block else 3) for layer in self.layers)

    @property
    def grad_bytes_per_param(self) -> int:
        return 4 if self.precision == "fp32" else 2

    def backward_order(self) -> list[tuple[int, float]]:
        """(parameters, fraction of backward done when its gradient is ready) per layer with
        parameters, in the order backward produces them (last layer first)."""
        total = sum(2 * layer.fwd_flops for layer in self.layers) or 1.0
        out, done = [], 0.0
        for layer in reversed(self.layers):
            done += 2 * layer.fwd_flops
            if layer.params:
                out.append((layer.params, min(1.0, done / total)))
        return out

    def powersgd_ratio(self, rank: int = 4) -> float:
        """Bytes PowerSGD sends per gradient byte: ``(n + m) r`` per n x m matrix, vectors uncompressed."""
        sent = 0.0
        for layer in self.layers:
            in_matrices = 0
            for n, m in layer.matrices:
                sent += min((n + m) * rank, n * m)
                in_matrices += n * m
            sent += layer.params - in_matrices
        return sent / self.params

    def powersgd_flops(self, rank: int = 4) -> float:
        """FLOPs of PowerSGD per step: P = M Q, Q = M^T P, the rebuild P Q^T (2 n m r each), orthogonalisation."""
        return sum(6 * n * m * rank + 4 * n * rank * rank for layer in self.layers for n, m in layer.matrices)

    def act_bytes_per_sample(self, dtype_bytes: int) -> float:
        """Activations kept for backward per sample (recomputation keeps each block's input only)."""
        if self.kind == "transformer":
            per_block = self.seq * self.hidden * dtype_bytes * (1 if self.recompute else 17)
            return per_block * self.blocks + self.seq * self.vocab * 4
        return 2 * sum(layer.act_elems for layer in self.layers) * dtype_bytes


class _Net:
    """A tiny shape tracker that emits Layers (channels c, height h, width w)."""

    def __init__(self, c: int, h: int, w: int | None = None) -> None:
        self.c, self.h, self.w = c, h, w or h
        self.layers: list[Layer] = []

    def conv(self, cout: int, kh: int, kw: int | None = None, s: int = 1, ph: int | None = None,
             pw: int | None = None, bn: bool = True, name: str = "conv") -> _Net:
        kw = kw or kh
        ph = (kh - 1) // 2 if ph is None else ph
        pw = (kw - 1) // 2 if pw is None else pw
        ho, wo = (self.h + 2 * ph - kh) // s + 1, (self.w + 2 * pw - kw) // s + 1
        weights = self.c * cout * kh * kw
        params = weights + (2 * cout if bn else cout)
        self.layers.append(Layer(name, params, 2.0 * weights * ho * wo, ((cout, self.c * kh * kw),), cout * ho * wo))
        self.c, self.h, self.w = cout, ho, wo
        return self

    def pool(self, k: int, s: int, p: int = 0) -> _Net:
        self.h, self.w = (self.h + 2 * p - k) // s + 1, (self.w + 2 * p - k) // s + 1
        return self

    def fc(self, out: int, name: str = "fc") -> _Net:
        n_in = self.c * self.h * self.w
        self.layers.append(Layer(name, n_in * out + out, 2.0 * n_in * out, ((out, n_in),), out))
        self.c, self.h, self.w = out, 1, 1
        return self

    def branches(self, *specs) -> _Net:
        """Run each spec (a function of a _Net) from the current input; concatenate channels.
        A spec returning None is a pass-through of the input (a pooling branch)."""
        c, h, w = self.c, self.h, self.w
        outs, size = [], None
        for spec in specs:
            self.c, self.h, self.w = c, h, w
            spec(self)
            outs.append(self.c)
            size = (self.h, self.w)
        self.c, (self.h, self.w) = sum(outs), size
        return self


def resnet(depth: int) -> Workload:
    """torchvision's ResNet-50/101 (bottleneck, stride on the 3x3), 224x224, 1000 classes."""
    blocks = {50: (3, 4, 6, 3), 101: (3, 4, 23, 3), 152: (3, 8, 36, 3)}[depth]
    net = _Net(3, 224).conv(64, 7, s=2, ph=3).pool(3, 2, 1)
    for stage, (n, width) in enumerate(zip(blocks, (64, 128, 256, 512))):
        for i in range(n):
            s = 2 if (i == 0 and stage > 0) else 1
            cin, h = net.c, net.h
            net.conv(width, 1).conv(width, 3, s=s).conv(4 * width, 1)
            if i == 0:  # projection shortcut from the block's input
                c, hh, ww = net.c, net.h, net.w
                net.c, net.h, net.w = cin, h, h
                net.conv(4 * width, 1, s=s, name="downsample")
                net.c, net.h, net.w = c, hh, ww
    net.pool(net.h, 1)
    net.fc(1000)
    return Workload(f"resnet{depth}", tuple(net.layers))


def vgg16() -> Workload:
    """VGG-16 (configuration D), 224x224: 13 3x3 convolutions with biases, three FC layers."""
    net = _Net(3, 224)
    for v in (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"):
        net.pool(2, 2) if v == "M" else net.conv(v, 3, bn=False)
    net.fc(4096).fc(4096).fc(1000)
    return Workload("vgg16", tuple(net.layers))


def inception_v3() -> Workload:
    """Inception V3 (Szegedy et al. 2016, torchvision's layout), 299x299, without the auxiliary head."""
    net = _Net(3, 299).conv(32, 3, s=2, ph=0).conv(32, 3, ph=0).conv(64, 3).pool(3, 2)
    net.conv(80, 1).conv(192, 3, ph=0).pool(3, 2)

    def a(pool_features):
        return (lambda n: n.conv(64, 1), lambda n: n.conv(48, 1).conv(64, 5),
                lambda n: n.conv(64, 1).conv(96, 3).conv(96, 3), lambda n: n.pool(3, 1, 1).conv(pool_features, 1))

    for pf in (32, 64, 64):
        net.branches(*a(pf))
    net.branches(lambda n: n.conv(384, 3, s=2, ph=0), lambda n: n.conv(64, 1).conv(96, 3).conv(96, 3, s=2, ph=0),
                 lambda n: n.pool(3, 2))
    for c7 in (128, 160, 160, 192):
        net.branches(lambda n: n.conv(192, 1),
                     lambda n, c7=c7: n.conv(c7, 1).conv(c7, 1, 7).conv(192, 7, 1),
                     lambda n, c7=c7: n.conv(c7, 1).conv(c7, 7, 1).conv(c7, 1, 7).conv(c7, 7, 1).conv(192, 1, 7),
                     lambda n: n.pool(3, 1, 1).conv(192, 1))
    net.branches(lambda n: n.conv(192, 1).conv(320, 3, s=2, ph=0),
                 lambda n: n.conv(192, 1).conv(192, 1, 7).conv(192, 7, 1).conv(192, 3, s=2, ph=0),
                 lambda n: n.pool(3, 2))
    for _ in range(2):
        net.branches(lambda n: n.conv(320, 1),
                     lambda n: n.conv(384, 1).branches(lambda m: m.conv(384, 1, 3), lambda m: m.conv(384, 3, 1)),
                     lambda n: n.conv(448, 1).conv(384, 3).branches(lambda m: m.conv(384, 1, 3),
                                                                    lambda m: m.conv(384, 3, 1)),
                     lambda n: n.pool(3, 1, 1).conv(192, 1))
    net.pool(net.h, 1)
    net.fc(1000)
    return Workload("inception3", tuple(net.layers))


def gpt(layers: int, hidden: int, heads: int, seq: int = 2048, vocab: int = 51200, *, recompute: bool = True,
        precision: str = "fp16", name: str | None = None, tied: bool = True) -> Workload:
    """A GPT (Narayanan et al. 2021 Eq. 2-3): blocks of attention + 4h MLP, tied embeddings (``tied=False``: an
    output layer of its own, as Megatron-LM's ``--untie-embeddings-and-output-weights``)."""
    h, s = hidden, seq
    emb = Layer("embedding", (vocab + s) * h, 0.0, ((vocab, h),), s * h)
    block = Layer("block", 12 * h * h + 13 * h, s * (24.0 * h * h + 4.0 * s * h),
                  ((3 * h, h), (h, h), (4 * h, h), (h, 4 * h)), s * h, block=True, row_parallel=(1, 3))
    head = (Layer("logits", 0, 2.0 * s * h * vocab, (), s * vocab) if tied else
            Layer("output", vocab * h, 2.0 * s * h * vocab, ((vocab, h),), s * vocab))
    params = 12 * layers * h * h + 13 * layers * h + (vocab + s) * h + (0 if tied else vocab * h)
    label = name or f"gpt-{params / 1e9:.1f}b"
    return Workload(label, (emb,) + (block,) * layers + (head,), "transformer", s, h, heads, vocab, recompute, precision)


def llama(layers: int, hidden: int, heads: int, kv_heads: int, ffn: int, vocab: int, seq: int, *,
          recompute: bool = False, name: str) -> Workload:
    """A Llama 3 (Dubey et al. 2024, Table 3): grouped-query attention, SwiGLU MLP of width ``ffn``, RMSNorm,
    untied input and output embeddings. Forward FLOPs per sequence: 2 s per weight of a block, plus
    ``4 s^2 h`` for the attention scores and their use (as Narayanan et al. Eq. 3), plus the output layer."""
    h, s, kv = hidden, seq, hidden // heads * kv_heads
    emb = Layer("embedding", vocab * h, 0.0, ((vocab, h),), s * h)
    weights = 2 * h * h + 2 * h * kv + 3 * h * ffn
    block = Layer("block", weights + 2 * h, 2.0 * s * weights + 4.0 * s * s * h,
                  ((h, h), (kv, h), (kv, h), (h, h), (ffn, h), (ffn, h), (h, ffn)), s * h, block=True,
                  row_parallel=(3, 6))
    head = Layer("output", vocab * h + h, 2.0 * s * h * vocab, ((vocab, h),), s * vocab)
    return Workload(name, (emb,) + (block,) * layers + (head,), "transformer", s, h, heads, vocab, recompute, "bf16")


_MODELS = {
    "resnet50": lambda: resnet(50),
    "resnet101": lambda: resnet(101),
    "vgg16": vgg16,
    "inception3": inception_v3,
    # GPT-3 paper, Table 2.1: "GPT-3 XL" 1.3B (24 layers, d 2048, 24 heads) and 13B (40 layers, d 5140, 40 heads)
    "gpt-1.3b": lambda: gpt(24, 2048, 24, name="gpt-1.3b"),
    "gpt-13b": lambda: gpt(40, 5140, 40, name="gpt-13b"),
    # Megatron-LM 2019 weak-scaling 8.3B: 72 layers, h 3072, 32 heads, seq 1024, vocab 51200
    "gpt-8.3b": lambda: gpt(72, 3072, 32, seq=1024, name="gpt-8.3b"),
    # Narayanan et al. 2021 Table 1, first and last rows
    "gpt-1.7b": lambda: gpt(24, 2304, 24, name="gpt-1.7b"),
    "gpt-1t": lambda: gpt(128, 25600, 160, name="gpt-1t"),
    # Llama 3.1 (Dubey et al. 2024, Table 3): layers, model dim, heads, KV heads, FFN dim, vocab 128,256;
    # sequence 8192 as torchtitan's benchmarks train them (benchmarks/llama3_h100_202412_torchtitan.md)
    "llama3-8b": lambda: llama(32, 4096, 32, 8, 14336, 128256, 8192, name="llama3-8b"),
    "llama3-70b": lambda: llama(80, 8192, 64, 8, 28672, 128256, 8192, recompute=True, name="llama3-70b"),
    "llama3-405b": lambda: llama(126, 16384, 128, 8, 53248, 128256, 8192, recompute=True, name="llama3-405b"),
}
# Megatron-LM README (NVIDIA/Megatron-LM, images/model_table.png, Megatron-Core r0.8.0 on H100): GPTs of
# vocabulary 131,072 and sequence 4,096; (layers, hidden, heads) per row. The table's sizes count an untied output
# layer (1.7B: 1.48B tied, 1.74B untied; 462B: 461.4B untied)
MEGATRON_GPTS = {"1.7b": (24, 2048, 16), "7.1b": (30, 4096, 32), "16b": (32, 6144, 48), "32b": (48, 7168, 56),
                 "70b": (84, 8192, 64), "119b": (92, 10240, 80), "177b": (96, 12288, 96), "314b": (96, 16384, 128),
                 "462b": (112, 18432, 144)}
# MLPerf Training v3.1's GPT-3 175B (mlcommons/training_results_v3.1, NVIDIA's NeMo config): 96 layers, h 12288,
# 96 heads, sequence 2048; GPT-2's 50,257 tokens padded to a multiple of 128 x TP 4 = 50,688 (Megatron's rule)
_MODELS["gpt3-175b"] = lambda: gpt(96, 12288, 96, seq=2048, vocab=50688, recompute=False, precision="bf16",
                                   name="gpt3-175b")
for _size, (_l, _h, _a) in MEGATRON_GPTS.items():
    _MODELS[f"megatron-{_size}"] = (lambda n_layers=_l, h=_h, a=_a, n=f"megatron-{_size}":
                                    gpt(n_layers, h, a, seq=4096, vocab=131072, recompute=False, precision="bf16", name=n,
                                        tied=False))
_cache: dict[str, Workload] = {}


def names() -> list[str]:
    return sorted(_MODELS)


def get(name: str) -> Workload:
    """A named model (``phalanx plan --model NAME``)."""
    if name not in _MODELS:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(sorted(_MODELS))} "
                         "(or give --params for any other)")
    if name not in _cache:
        _cache[name] = _MODELS[name]()
    return _cache[name]


def check_shapes(w: Workload) -> None:
    """Sanity: every layer's matrices hold at most its parameters (used by tests)."""
    for layer in w.layers:
        if sum(n * m for n, m in layer.matrices) > layer.params + (0 if layer.params else math.inf):
            raise AssertionError(f"{w.name}/{layer.name}: matrices larger than the layer")
