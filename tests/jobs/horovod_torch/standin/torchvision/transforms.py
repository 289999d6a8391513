"""``transforms.Compose``, ``ToTensor`` and ``Normalize`` as torchvision applies them to an MNIST image."""

import torch


class Compose:
    def __init__(self, transforms):
        self.transforms = list(transforms)

    def __call__(self, x):
        for t in self.transforms:
            x = t(x)
        return x


class ToTensor:
    """uint8 H x W -> float 1 x H x W in [0, 1]."""

    def __call__(self, img):
        return torch.as_tensor(img, dtype=torch.float32).div(255.0).unsqueeze(0)


class Normalize:
    def __init__(self, mean, std):
        self.mean, self.std = torch.tensor(mean).view(-1, 1, 1), torch.tensor(std).view(-1, 1, 1)

    def __call__(self, x):
        return (x - self.mean) / self.std
