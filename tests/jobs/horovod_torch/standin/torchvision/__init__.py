"""A stand-in for the two corners of torchvision that Horovod's PyTorch MNIST examples use
(``datasets.MNIST`` reading the raw IDX files, ``transforms.Compose/ToTensor/Normalize``), for a
test machine without torchvision. ``tests/jobs/horovod_torch/mnist_data.py`` writes the files; with
the real torchvision installed the tests use it instead and it reads the same files."""

from . import datasets, transforms  # noqa: F401
