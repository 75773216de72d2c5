"""Latent features f_ext(x) for buffer slots and incoming images, computed once per weights.

Features are taken in eval mode under inference mode, as in the reference implementation,
so a sample's features depend only on the weights. `Latent.of` gathers every slot whose cached
features are stale together with the new images and runs one batched forward pass.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .buffer import ReplayBuffer


class Latent:
    """Feature access for one step; `version` names the weights the features come from."""

    def __init__(self, extract: Callable[[torch.Tensor], torch.Tensor], buffer: ReplayBuffer, version: int):
        self.extract = extract  # uint8 images -> features, eval mode, no grad
        self.buffer = buffer
        self.version = version

    def of(self, slots: torch.Tensor, images: torch.Tensor | None = None,
           max_age: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Features of buffer `slots` (cached ones at most `max_age` weight versions old) and of
        `images`, in one forward pass for what is missing."""
        buf = self.buffer
        stale = slots[~buf.cached_mask(slots, self.version, max_age)] if slots.numel() else slots
        stale = torch.unique(stale)
        parts = [buf.images[stale]] if stale.numel() else []
        n_new = 0 if images is None else images.shape[0]
        if n_new:
            parts.append(images.to(buf.device))
        new_feats = None
        if parts:
            batch = parts[0] if len(parts) == 1 else torch.cat(parts)
            feats = self.extract(batch)
            if stale.numel():
                buf.store_features(stale, feats[: stale.numel()], self.version)
            if n_new:
                new_feats = feats[stale.numel():]
        slot_feats = buf.features[slots] if slots.numel() else None
        if slot_feats is None:
            dim = new_feats.shape[1] if new_feats is not None else 0
            slot_feats = torch.zeros((0, dim), device=buf.device)
        return slot_feats, new_feats
