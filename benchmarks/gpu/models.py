"""Benchmark models built in code (no downloads, no torchvision): GPT-2 small and ResNet-50.

``gpt2_small()`` is phalanx's own GPT (``phalanx.models.GPT``: separate q/k/v projections,
``scaled_dot_product_attention(is_causal=True)``, pre-LayerNorm blocks) sized as GPT-2 small:
12 layers, d=768, 12 heads, vocabulary 50257, positions 1024, the output head tied to the token
embedding as GPT-2 does, weights drawn N(0, 0.02) as GPT-2 does: 124,439,808 parameters, the
same number as GPT-2 small. ``resnet50()`` is torchvision's ResNet-50 (v1.5: the stride on the
3x3 convolution), bottleneck blocks [3, 4, 6, 3], BatchNorm: 25,557,032 parameters.
``tiny=True`` gives the dry run's sizes (2 layers / one block per stage, seconds on a CPU).

Example::

    from models import gpt2_small, resnet50      # with benchmarks/gpu on sys.path
    gpt = gpt2_small()                           # logits_BTV = gpt(ids_BT), T <= 1024
    cnn = resnet50()                             # logits_BC = cnn(images_B3HW), 224x224
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from phalanx.models import GPT, GPTConfig

__all__ = ["gpt2_small", "resnet50", "count_params", "tie_head"]


def count_params(model: nn.Module) -> int:
    """Parameters, a tied one counted once (``parameters()`` yields each tensor once)."""
    return sum(p.numel() for p in model.parameters())


def gpt2_small(tiny: bool = False, vocab: int = 50257) -> GPT:
    """GPT-2 small (or a 2-layer d=64 model over 64 positions with ``tiny``), head tied to the
    token embedding; any sequence up to ``model.config.block_size`` (1024) tokens."""
    if tiny:
        cfg = GPTConfig(vocab_size=min(vocab, 512), block_size=64, n_layer=2, n_head=4, n_embd=64)
    else:
        cfg = GPTConfig(vocab_size=vocab, block_size=1024, n_layer=12, n_head=12, n_embd=768)
    model = GPT(cfg)
    for m in model.modules():  # GPT-2's initialisation: N(0, 0.02) weights, zero biases
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)
    return tie_head(model)


def tie_head(model: GPT) -> GPT:
    """The output head shares the token embedding's Parameter (GPT-2's tying); idempotent.

    ``model.to("cuda")`` keeps a tie (it swaps each Parameter's data in place), a move to a
    device whose tensors cannot take that swap (``meta``) does not: call this again after it.
    """
    model.head.lm_head.weight = model.embed.tok.weight
    return model


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (carries the stride), 1x1 expand (x4), plus the shortcut."""

    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        cout = 4 * width
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False),
                                      nn.BatchNorm2d(cout))

    def forward(self, x):
        shortcut = x if self.down is None else self.down(x)
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)))
        return F.relu(self.bn3(self.conv3(y)) + shortcut)


class ResNet(nn.Module):
    def __init__(self, layers=(3, 4, 6, 3), width: int = 64, num_classes: int = 1000) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, width, 7, stride=2, padding=3, bias=False), nn.BatchNorm2d(width),
            nn.ReLU(inplace=True), nn.MaxPool2d(3, stride=2, padding=1))
        blocks, cin = [], width
        for i, n in enumerate(layers):
            w = width * 2**i
            for j in range(n):
                blocks.append(Bottleneck(cin, w, stride=2 if i > 0 and j == 0 else 1))
                cin = 4 * w
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x):
        x = self.blocks(self.stem(x))
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


def resnet50(tiny: bool = False, num_classes: int = 1000) -> ResNet:
    """ResNet-50 (or one bottleneck per stage at width 8 with ``tiny``)."""
    if tiny:
        return ResNet(layers=(1, 1, 1, 1), width=8, num_classes=min(num_classes, 10))
    return ResNet(num_classes=num_classes)
