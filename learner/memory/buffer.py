"""The replay memory M: fixed capacity, preallocated tensors, per-slot feature cache.

Images are kept as uint8 [M, 3, H, W] (the raw pixels; the learner scales them to [0, 1]) or, on
a pretrained backbone, as the frozen part's latents in their stored dtype (`learner.networks.backbone`),
labels as int64. `features` caches f_ext of each slot together with the model version that
produced it, so a step never runs the feature extractor twice on the same sample under the
same weights (the update after step n and the retrieval before step n+1 share weights).

>>> import torch
>>> buf = ReplayBuffer(capacity=4, image_shape=(3, 2, 2))
>>> buf.write(torch.tensor([0, 1]), torch.zeros(2, 3, 2, 2, dtype=torch.uint8), torch.tensor([7, 8]))
>>> len(buf), buf.class_counts()
(2, {7: 1, 8: 1})
>>> buf.remove_class(7), len(buf), buf.labels[:1].tolist()
(1, 1, [8])
>>> buf.keys[0] = 41  # the stream sample slot 0 holds (`record_admitted` sets it after a step)
>>> buf.slot_of(41), buf.remove_slots(torch.tensor([0])), len(buf), buf.slot_of(41)
(0, 1, 0, None)
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

PICTURE_SIZE = 32  # a latent memory's pictures, a side (what the memory browser shows of a slot)


class ReplayBuffer:
    def __init__(self, capacity: int, image_shape: tuple[int, ...], device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.uint8):
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self.image_shape = tuple(image_shape)
        self.device = torch.device(device)
        # what a slot stores: the images, or on a pretrained backbone the frozen part's latents
        self.images = torch.zeros((capacity, *self.image_shape), dtype=dtype, device=self.device)
        self.labels = torch.full((capacity,), -1, dtype=torch.long, device=self.device)
        self.size = 0  # slots 0..size-1 are filled
        self.n_seen = 0  # stream samples offered to the buffer so far (reservoir's n)
        self.entered = torch.zeros(capacity, dtype=torch.long)  # n_seen when each slot was last written
        self.keys = torch.full((capacity,), -1, dtype=torch.long)  # the caller's id of each slot's sample (-1: none)
        self.features: torch.Tensor | None = None
        # a latent memory's slots as people see them (`keep_pictures`); None while slots hold the images
        self.pictures: torch.Tensor | None = None
        self.feature_version = torch.full((capacity,), -1, dtype=torch.long, device=self.device)

    def __len__(self) -> int:
        return self.size

    @property
    def is_full(self) -> bool:
        return self.size >= self.capacity

    def write(self, slots: torch.Tensor, images: torch.Tensor, labels: torch.Tensor,
              features: torch.Tensor | None = None, version: int = -1) -> None:
        """Store samples in `slots` (which must be filled or the next free ones)."""
        if slots.numel() == 0:
            return
        slots = slots.to(self.device)
        self.images[slots] = images.to(self.device)
        self.labels[slots] = labels.to(self.device)
        self.entered[slots.cpu()] = self.n_seen
        self.keys[slots.cpu()] = -1  # a new sample: its id, where the caller has one, comes after the step
        if features is not None:
            self._ensure_feature_store(features.shape[1], features.dtype)
            self.features[slots] = features.to(self.device)
            self.feature_version[slots] = version
        else:
            self.feature_version[slots] = -1
        self.size = max(self.size, int(slots.max()) + 1)

    def append(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Fill free slots with as many samples as fit; returns the slots used."""
        n = min(self.capacity - self.size, images.shape[0])
        slots = torch.arange(self.size, self.size + n, device=self.device)
        self.write(slots, images[:n], labels[:n])
        return slots

    def keep_pictures(self, slots: torch.Tensor, images: torch.Tensor) -> None:
        """A PICTURE_SIZE picture of the uint8 images stored (as latents) in `slots`."""
        if self.pictures is None:
            self.pictures = torch.zeros((self.capacity, 3, PICTURE_SIZE, PICTURE_SIZE), dtype=torch.uint8)
        small = torch.nn.functional.interpolate(images.float(), size=(PICTURE_SIZE, PICTURE_SIZE), mode="bilinear",
                                                align_corners=False, antialias=images.shape[-1] > PICTURE_SIZE)
        self.pictures[slots.cpu()] = small.round().clamp(0, 255).to(torch.uint8).cpu()

    def class_counts(self) -> dict[int, int]:
        labels, counts = torch.unique(self.labels[: self.size], return_counts=True)
        return {int(c): int(n) for c, n in zip(labels.tolist(), counts.tolist())}

    def slot_of(self, key: int) -> int | None:
        """The slot holding the sample the caller called `key`, or None."""
        found = torch.nonzero(self.keys[: self.size] == key).flatten()
        return int(found[0]) if found.numel() else None

    def remove_class(self, class_id: int) -> int:
        """Drop every sample of a class, packing the others into the first slots; returns how
        many were removed. Free slots are filled again by the update policies."""
        return self._keep_only(torch.nonzero(self.labels[: self.size] != class_id).squeeze(1))

    def remove_slots(self, slots: torch.Tensor) -> int:
        """Drop the samples in `slots` (one forgotten sample, say), packing the others; returns how many."""
        keep = torch.ones(self.size, dtype=torch.bool)
        keep[slots.cpu()] = False
        return self._keep_only(torch.nonzero(keep).squeeze(1).to(self.device))

    def _keep_only(self, keep: torch.Tensor) -> int:
        removed, n = self.size - keep.numel(), keep.numel()
        if removed == 0:
            return 0
        self.images[:n] = self.images[keep].clone()
        self.labels[:n] = self.labels[keep].clone()
        self.entered[:n] = self.entered[keep.cpu()].clone()
        self.keys[:n] = self.keys[keep.cpu()].clone()
        self.keys[n:] = -1
        if self.pictures is not None:
            self.pictures[:n] = self.pictures[keep.cpu()].clone()
        self.feature_version[:n] = self.feature_version[keep].clone()
        if self.features is not None:
            self.features[:n] = self.features[keep].clone()
        self.labels[n:] = -1
        self.feature_version[n:] = -1
        self.size = n
        return removed

    # --- feature cache -----------------------------------------------------------------
    def _ensure_feature_store(self, dim: int, dtype: torch.dtype) -> None:
        if self.features is None or self.features.shape[1] != dim or self.features.dtype != dtype:
            self.features = torch.zeros((self.capacity, dim), dtype=dtype, device=self.device)
            self.feature_version.fill_(-1)

    def cached_mask(self, slots: torch.Tensor, version: int, max_age: int = 0) -> torch.Tensor:
        """Which slots hold features at most `max_age` weight versions older than `version`."""
        cached = self.feature_version[slots]
        return (cached >= 0) & (version - cached <= max_age)

    def store_features(self, slots: torch.Tensor, features: torch.Tensor, version: int) -> None:
        self._ensure_feature_store(features.shape[1], features.dtype)
        self.features[slots] = features
        self.feature_version[slots] = version

    # --- persistence -------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "capacity": self.capacity,
            "image_shape": self.image_shape,
            "images": self.images[: self.size].cpu(),
            "labels": self.labels[: self.size].cpu(),
            "n_seen": self.n_seen,
            "entered": self.entered[: self.size].clone(),
            "keys": self.keys[: self.size].clone(),
            "dtype": str(self.images.dtype).removeprefix("torch."),
            **({"pictures": self.pictures[: self.size].clone()} if self.pictures is not None else {}),
            # the feature cache: values computed on features up to S steps old (`learner.memory.balanced`) go on
            # from the same features after a resume
            **({"features": self.features[: self.size].cpu(), "feature_version": self.feature_version[: self.size].cpu()}
               if self.features is not None else {}),
        }

    def load_state_dict(self, state: dict) -> None:
        if state["capacity"] != self.capacity or tuple(state["image_shape"]) != self.image_shape:
            raise ValueError("buffer state does not match this buffer's capacity or image shape")
        self.images.zero_()
        self.labels.fill_(-1)
        self.size = 0
        n = state["labels"].shape[0]
        self.write(torch.arange(n, device=self.device), state["images"], state["labels"])
        self.size = n
        self.n_seen = int(state["n_seen"])
        self.entered.zero_()
        if "entered" in state:  # absent from checkpoints written before it existed
            self.entered[:n] = state["entered"]
        if "keys" in state:  # the same
            self.keys[:n] = state["keys"]
        self.pictures = None
        if "pictures" in state and n:
            self.keep_pictures(torch.arange(n), state["pictures"])
        self.feature_version.fill_(-1)
        if "features" in state and n:
            self.store_features(torch.arange(n, device=self.device), state["features"].to(self.device), -1)
            self.feature_version[:n] = state["feature_version"].to(self.device)


def rows_of(rows: torch.Tensor, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Which of `rows` are equal to a sample of `batch` (a mask), and the index in `batch` of each that is.

    >>> found, at = rows_of(torch.tensor([[2, 2], [5, 5]]), torch.tensor([[1, 1], [2, 2]]))
    >>> found.tolist(), at[found].tolist()
    ([True, False], [1])
    """
    same = (rows.flatten(1)[:, None] == batch.flatten(1).to(rows.device)[None]).all(2)  # [rows, batch]
    return same.any(1), same.float().argmax(1)


@contextmanager
def record_admitted(buffer: ReplayBuffer | None, pixels: torch.Tensor, stored: torch.Tensor,
                    keys: torch.Tensor | None = None, features: torch.Tensor | None = None, version: int = -1):
    """Around a step: for each sample the step admits, its id (`keys`, the caller's, one a sample of the batch:
    `ReplayBuffer.keys`), on a latent memory a small picture (`ReplayBuffer.pictures`: what a person browsing
    the memory sees) and, given, its features of weights `version` (the batch's, computed already: the memory's
    next valuation need not compute them again); the step's stored samples tell which sample a slot took."""
    # the images kept as they are (the same tensor, or the same part of one) need no picture
    same = pixels.data_ptr() == stored.data_ptr() and pixels.shape == stored.shape
    pictures = not same and pixels.dtype == torch.uint8
    if buffer is None or not (pictures or keys is not None or features is not None):
        yield
        return
    offered = buffer.n_seen
    yield
    slots = torch.nonzero(buffer.entered[:buffer.size] >= offered).flatten().to(buffer.device)
    if slots.numel():
        found, sample = rows_of(buffer.images[slots], stored)
        if pictures:
            buffer.keep_pictures(slots[found], pixels[sample[found]])
        if keys is not None:
            buffer.keys[slots[found].cpu()] = keys.cpu()[sample[found].cpu()]
        if features is not None and bool(found.any()):
            buffer.store_features(slots[found], features[sample[found]].float().to(buffer.device), version)
