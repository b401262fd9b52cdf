"""A deterministic image-classification set for ``pretrain_vision.py``, generated rather than downloaded.

No image set ships with the packages installed here (torchvision does not install beside the CPU
torch), and a training run must not depend on a download. Each class is a sinusoidal grating of
its own orientation and frequency in its own colour balance; each image draws its phase, contrast,
offset and pixel noise from a generator seeded by ``(seed, split, index)``. The noise is strong
enough that a model must learn the pattern: accuracy starts at chance (1 / classes) and rises as it
trains. Any sample of any split can be produced alone and is the same on every rank, every run.
"""

from __future__ import annotations

import hashlib
import math

import torch

SPLITS = ("train", "valid", "test")
NOISE = 1.0  # pixel noise std; a grating's amplitude is 0.4 to 1.0 times its class's colour weights (0.25 to 1.75)


class PatternImages(torch.utils.data.Dataset):
    """``size`` samples ``{"pixels": (channels, height, width) float, "label": long}`` of split ``split``."""

    def __init__(self, size: int, split: str, seed: int, height: int, width: int, channels: int, classes: int) -> None:
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, not {split!r}")
        self.size, self.split, self.seed = size, split, seed
        self.channels, self.classes = channels, classes
        ys, xs = torch.meshgrid(torch.linspace(-1, 1, height), torch.linspace(-1, 1, width), indexing="ij")
        self.grid = torch.stack([xs, ys])  # (2, H, W)
        # The classes themselves do not depend on the seed: every split and run learns the same task.
        rule = torch.Generator().manual_seed(0)
        angles = torch.arange(classes) * math.pi / classes
        self.directions = torch.stack([angles.cos(), angles.sin()], 1)  # (classes, 2)
        self.frequencies = 2.0 + torch.arange(classes) % 3  # cycles across the image
        self.colours = torch.rand(classes, channels, generator=rule) * 1.5 + 0.25

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        # torch's CPU generator keeps 32 bits of its seed: a hash of all three, not seed | split | index
        digest = hashlib.blake2b(f"{self.seed}/{self.split}/{index}".encode(), digest_size=4).digest()
        g = torch.Generator().manual_seed(int.from_bytes(digest, "little"))
        label = int(torch.randint(self.classes, (), generator=g))
        phase, contrast, offset = torch.rand(3, generator=g) * torch.tensor([2 * math.pi, 0.6, 0.4])
        position = torch.einsum("d,dhw->hw", self.directions[label], self.grid)
        grating = (0.4 + contrast) * torch.sin(math.pi * self.frequencies[label] * position + phase)
        pixels = self.colours[label][:, None, None] * grating + offset - 0.2
        pixels = pixels + NOISE * torch.randn(self.channels, *grating.shape, generator=g)
        return {"pixels": pixels, "label": torch.tensor(label)}
