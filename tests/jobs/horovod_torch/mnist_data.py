"""Write a small learnable MNIST stand-in as torchvision's raw IDX files: ``python mnist_data.py DIR [N_TRAIN N_TEST]``.

Digit ``c`` is a bright 8x8 square at one of ten positions plus noise, so a few SGD steps lower the loss;
``datasets.MNIST(DIR, download=True)`` (real torchvision, or ``standin/``) finds the files and reads them.
"""

import os
import struct
import sys

import torch


def _write_idx(path: str, t: torch.Tensor) -> None:
    with open(path, "wb") as f:
        f.write(struct.pack(">BBBB", 0, 0, 0x08, t.dim()) + struct.pack(">" + "I" * t.dim(), *t.shape))
        f.write(t.to(torch.uint8).contiguous().numpy().tobytes())


def write_mnist(root: str, n_train: int = 256, n_test: int = 64, seed: int = 0) -> str:
    raw = os.path.join(root, "MNIST", "raw")
    os.makedirs(raw, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        labels = torch.randint(0, 10, (n,), generator=g)
        images = torch.randint(0, 60, (n, 28, 28), generator=g)
        for i, c in enumerate(labels.tolist()):
            r, col = 2 + (c // 5) * 12, 2 + (c % 5) * 5
            images[i, r:r + 8, col:col + 5] = 255
        _write_idx(os.path.join(raw, f"{prefix}-images-idx3-ubyte"), images)
        _write_idx(os.path.join(raw, f"{prefix}-labels-idx1-ubyte"), labels)
    return root


if __name__ == "__main__":
    write_mnist(sys.argv[1], *(int(a) for a in sys.argv[2:4]))
