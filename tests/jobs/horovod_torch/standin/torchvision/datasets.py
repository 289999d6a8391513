"""``datasets.MNIST``: the IDX files under ``root/MNIST/raw`` (as torchvision lays them out); no download."""

import os
import struct

import torch


def _read_idx(path: str) -> torch.Tensor:
    with open(path, "rb") as f:
        data = f.read()
    _, _, dtype, ndim = struct.unpack(">BBBB", data[:4])
    shape = struct.unpack(">" + "I" * ndim, data[4:4 + 4 * ndim])
    return torch.frombuffer(bytearray(data[4 + 4 * ndim:]), dtype=torch.uint8).view(*shape)


class MNIST(torch.utils.data.Dataset):
    def __init__(self, root, train=True, transform=None, target_transform=None, download=False):
        prefix = "train" if train else "t10k"
        raw = os.path.join(os.fspath(root), "MNIST", "raw")
        images, labels = (os.path.join(raw, f"{prefix}-{kind}-ubyte") for kind in ("images-idx3", "labels-idx1"))
        if not (os.path.exists(images) and os.path.exists(labels)):
            raise RuntimeError(f"MNIST stand-in: no {images}; write it with tests/jobs/horovod_torch/mnist_data.py "
                               "(this stand-in does not download)")
        self.data, self.targets = _read_idx(images), _read_idx(labels).long()
        self.transform, self.target_transform = transform, target_transform

    def __len__(self):
        return len(self.targets)

    def __getitem__(self, i):
        img, target = self.data[i], int(self.targets[i])
        if self.transform is not None:
            img = self.transform(img)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return img, target
