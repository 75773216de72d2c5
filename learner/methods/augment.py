"""Augmentation of a training batch as batched tensor operations on the learner's device:
random crop with zero padding, then a random horizontal flip (the CIFAR standard, as repeated
augmented rehearsal, RAR, NeurIPS 2022, uses it). One gather does both: each output pixel reads
the padded image at a shifted, possibly mirrored, column. uint8 in, uint8 out; labels are
untouched, and the draws come from the augmenter's own generator, so a run is reproducible from
its seed whatever else draws random numbers.

>>> import torch
>>> images = torch.arange(2 * 3 * 4 * 4, dtype=torch.uint8).view(2, 3, 4, 4)
>>> crop = BatchAugment(padding=1, seed=0)
>>> out = crop(images)
>>> out.shape, out.dtype
(torch.Size([2, 3, 4, 4]), torch.uint8)
>>> torch.equal(BatchAugment(padding=1, seed=0)(images), out)  # the same seed, the same batch
True
>>> identity = BatchAugment(padding=0, flip=False)
>>> torch.equal(identity(images), images)
True
"""

from __future__ import annotations

import math

import torch
from torch.nn import functional as F


class BatchAugment:
    def __init__(self, padding: int = 4, flip: bool = True, seed: int = 0):
        if padding < 0:
            raise ValueError(f"padding must be >= 0, got {padding}")
        self.padding = padding
        self.flip = flip
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        """images [n, C, H, W] -> the same shape and dtype, each image cropped and flipped at random."""
        n, _, h, w = images.shape
        if n == 0:
            return images
        p = self.padding
        # draws on the CPU generator, so the batch is the same on every device
        dy = torch.randint(0, 2 * p + 1, (n,), generator=self.generator)
        dx = torch.randint(0, 2 * p + 1, (n,), generator=self.generator)
        mirror = torch.rand(n, generator=self.generator) < 0.5 if self.flip else torch.zeros(n, dtype=torch.bool)
        cols = torch.arange(w).expand(n, w)
        cols = torch.where(mirror[:, None], w - 1 - cols, cols) + dx[:, None]  # flip, then shift
        rows = torch.arange(h).expand(n, h) + dy[:, None]
        padded = F.pad(images, (p, p, p, p)) if p else images
        dev = images.device
        index = torch.arange(n, device=dev)[:, None, None]
        out = padded.permute(0, 2, 3, 1)[index, rows.to(dev)[:, :, None], cols.to(dev)[:, None, :]]
        return out.permute(0, 3, 1, 2).contiguous()

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])


class StrongAugment:
    """The stronger policy (`augment="strong"`), batched on the images' device: a random resized
    crop (area 0.2-1 of the image, aspect 3/4-4/3) with a random horizontal flip, in one
    `grid_sample`; colour jitter with probability 0.8 (brightness, contrast and saturation factors
    in 0.6-1.4, in that order; no hue, whose colour-space round trip would cost more than the rest);
    grayscale with probability 0.2. The SimCLR family's policy, as OCM and MKD train with, but
    without the per-image PIL loop. uint8 in, uint8 out; the draws come from its own CPU
    generator, so a batch is the same on every device and a run reproducible from its seed.

    >>> import torch
    >>> images = torch.randint(0, 256, (4, 3, 32, 32), dtype=torch.uint8)
    >>> out = StrongAugment(seed=0)(images)
    >>> out.shape, out.dtype, torch.equal(out, StrongAugment(seed=0)(images))
    (torch.Size([4, 3, 32, 32]), torch.uint8, True)
    """

    def __init__(self, scale: tuple[float, float] = (0.2, 1.0), ratio: tuple[float, float] = (3 / 4, 4 / 3),
                 jitter: float = 0.4, jitter_p: float = 0.8, gray_p: float = 0.2, seed: int = 0):
        if not 0 < scale[0] <= scale[1] <= 1:
            raise ValueError(f"the crop's area range must lie in (0, 1], got {scale}")
        self.scale, self.ratio, self.jitter, self.jitter_p, self.gray_p = scale, ratio, jitter, jitter_p, gray_p
        self.generator = torch.Generator().manual_seed(seed)

    def _uniform(self, n: int, low: float, high: float) -> torch.Tensor:
        return low + (high - low) * torch.rand(n, generator=self.generator)

    def crop_boxes(self, n: int) -> torch.Tensor:
        """[n, 2, 3] affine maps from output to input coordinates (-1..1): crop, shift, mirror."""
        area = self._uniform(n, *self.scale)
        ratio = torch.exp(self._uniform(n, math.log(self.ratio[0]), math.log(self.ratio[1])))
        width, height = (area * ratio).sqrt().clamp(max=1), (area / ratio).sqrt().clamp(max=1)
        cx, cy = (1 - width) * self._uniform(n, -1, 1), (1 - height) * self._uniform(n, -1, 1)
        mirror = torch.where(torch.rand(n, generator=self.generator) < 0.5, -1.0, 1.0)
        theta = torch.zeros(n, 2, 3)
        theta[:, 0, 0], theta[:, 0, 2], theta[:, 1, 1], theta[:, 1, 2] = width * mirror, cx, height, cy
        return theta

    def colour_factors(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[n, 3] brightness, contrast, saturation factors (1: unchanged) and [n] grayscale flags."""
        factors = self._uniform(3 * n, 1 - self.jitter, 1 + self.jitter).view(n, 3)
        jittered = torch.rand(n, generator=self.generator) < self.jitter_p
        factors = torch.where(jittered[:, None], factors, torch.ones_like(factors))
        return factors, torch.rand(n, generator=self.generator) < self.gray_p

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        n = images.shape[0]
        if n == 0:
            return images
        dev = images.device
        theta, (factors, gray) = self.crop_boxes(n).to(dev), self.colour_factors(n)
        factors, gray = factors.to(dev)[:, :, None, None, None], gray.to(dev)[:, None, None, None]
        x = images.float() / 255
        grid = F.affine_grid(theta, list(x.shape), align_corners=False)
        x = F.grid_sample(x, grid, mode="bilinear", padding_mode="reflection", align_corners=False)
        x = (x * factors[:, 0]).clamp(0, 1)  # brightness
        mean = _luma(x).mean((1, 2, 3), keepdim=True)
        x = ((x - mean) * factors[:, 1] + mean).clamp(0, 1)  # contrast
        x = ((x - _luma(x)) * factors[:, 2] + _luma(x)).clamp(0, 1)  # saturation
        x = torch.where(gray, _luma(x).expand_as(x), x)
        return (x * 255).round().to(torch.uint8)

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])


def _luma(x: torch.Tensor) -> torch.Tensor:
    """[n, 3, H, W] -> [n, 1, H, W] grayscale (ITU-R 601, as torchvision's)."""
    return (0.299 * x[:, 0:1] + 0.587 * x[:, 1:2] + 0.114 * x[:, 2:3])


Augment = BatchAugment | StrongAugment
AUGMENTATIONS = {"crop-flip": BatchAugment, "strong": StrongAugment}


def make_augment(policy: str | bool | None, seed: int):
    """The augmentation named `policy` (True: crop-flip; False or None: none)."""
    if not policy:
        return None
    name = "crop-flip" if policy is True else policy
    if name not in AUGMENTATIONS:
        raise ValueError(f"unknown augmentation {name!r}; choose one of {', '.join(AUGMENTATIONS)}")
    return AUGMENTATIONS[name](seed=seed)
