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
