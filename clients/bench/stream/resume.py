"""A benchmark run's state between two passes of its stream, so that a run longer than its process
(GSS, or Mini-ImageNet on a CPU) goes on where it stopped: `run --checkpoint PATH`.

After each task (each epoch for iid-online / iid-offline) the run writes what it has learned and
measured so far: the learner's state, the stream's and torch's RNG states, the accuracy matrices,
the training seconds. Started again with the same checkpoint, it loads that and trains on from
the next task, so the result is the one an uninterrupted run gives (the tests compare them). A
checkpoint names the settings of its run and is refused by any other run.

Memory samples are copies of training images, so a checkpoint stores their indices in the
training set rather than their pixels (Mini-ImageNet, M=1000: 8 KB instead of 21 MB), small
enough to keep in a repository between sessions; a memory holding any other image keeps pixels.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch

from learner.data import ImageDataset
from learner.networks.lite0 import POOLED

# the settings that decide a run's trajectory; threads, device and output paths do not
IDENTITY_KEYS = ("method", "dataset", "mem_size", "k", "n_candidates", "lr", "batch_size", "replay_batch",
                 "tasks", "epochs", "step", "loss", "exclude_current_task", "one_class_batches", "bf16",
                 "bf16_latent", "compile", "train_per_class", "test_per_class")
# named from the identity's version 2 on: a checkpoint written before (no version) is compared without them
LATER_OPTIONS = {"optimizer": "sgd", "head_lr": None, "choose_head": False, "head_prior": None, "train_every": 1,
                 "standardize_features": False, "label_noise": 0.0, "suspect_rule": False,
                 "label_noise_mode": "symmetric"}
IDENTITY_VERSION = 2
# later options: named only when set, so checkpoints written before they existed still match
OPTION_DEFAULTS = {"augment": False, "iterations": 1, "ema": None, "feature_max_age": 100, "distill": 0.0,
                   "serving_bn": "average", "serving_bias": False, "backbone": "scratch", "input_size": 128,
                   "cut": POOLED, "latent_bits": 16, "serving_head": None,
                   "trained_head_from": None, "rehearsals": 0, "sleep_every": 0, "sleep_epochs": 8.0, "sleep_batch": 32,
                   "sleep_lr": 0.01, "sleep_schedule": "constant", "sleep_source": "store", "sleep_draw": "balanced",
                   "sleep_store": 100_000, "fresh_sleep_at_end": False, "fresh_sleep_epochs": None,
                   **LATER_OPTIONS}


class CheckpointMismatch(ValueError):
    """The checkpoint at the path was written by a run with other settings."""


def run_identity(args, data: ImageDataset, seed: int) -> dict:
    identity = {key: getattr(args, key, None) for key in IDENTITY_KEYS}
    identity |= {key: getattr(args, key, d) for key, d in OPTION_DEFAULTS.items() if getattr(args, key, d) != d}
    return {**identity, "seed": seed, "train_samples": int(data.train_y.numel()),
            "test_samples": int(data.test_y.numel()), "identity": IDENTITY_VERSION}


def save_run_state(path: Path, state: dict, data: ImageDataset) -> None:
    """Write `state` atomically (temporary name, fsync, rename): a kill leaves the last one whole."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        torch.save({**state, "learner": _compact_buffer(state["learner"], data)}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_run_state(path: Path, identity: dict, data: ImageDataset) -> dict | None:
    """The state saved at `path` for the run `identity`; None if there is none."""
    if not path.exists():
        return None
    state = torch.load(path, map_location="cpu", weights_only=False)
    if "identity" not in state["run"]:
        identity = {k: v for k, v in identity.items() if k not in LATER_OPTIONS and k != "identity"}
    if state["run"] != identity:
        differ = sorted(k for k in identity.keys() | state["run"].keys() if identity.get(k) != state["run"].get(k))
        raise CheckpointMismatch(f"{path} is another run's checkpoint (its {', '.join(differ)} differ); "
                                 "delete it or give this run another --checkpoint")
    return {**state, "learner": _expand_buffer(state["learner"], data)}


def _compact_buffer(learner_state: dict, data: ImageDataset) -> dict:
    buffer = learner_state.get("buffer")
    if buffer is None or "images" not in buffer:
        return learner_state
    index = training_indices(buffer["images"], buffer["labels"], data)
    if index is None:
        return learner_state
    compact = {k: v for k, v in buffer.items() if k != "images"}
    return {**learner_state, "buffer": {**compact, "train_index": index}}


def _expand_buffer(learner_state: dict, data: ImageDataset) -> dict:
    buffer = learner_state.get("buffer")
    if buffer is None or "train_index" not in buffer:
        return learner_state
    full = {k: v for k, v in buffer.items() if k != "train_index"}
    return {**learner_state, "buffer": {**full, "images": data.train_x[buffer["train_index"]].clone()}}


def training_indices(images: torch.Tensor, labels: torch.Tensor, data: ImageDataset) -> torch.Tensor | None:
    """For each image, the index of an identical training image of the same label; None if one
    has none.

    >>> from learner.data import ImageDataset
    >>> x = torch.arange(4 * 3, dtype=torch.uint8).view(4, 3, 1, 1)
    >>> data = ImageDataset("toy", x, torch.tensor([0, 0, 1, 1]), x[:0], torch.tensor([]), ["a", "b"])
    >>> training_indices(x[[3, 0, 3]], torch.tensor([1, 0, 1]), data).tolist()
    [3, 0, 3]
    >>> training_indices(x[[3]] + 1, torch.tensor([1]), data) is None
    True
    """
    found = torch.full((labels.numel(),), -1, dtype=torch.long)
    for label in labels.unique().tolist():
        pool = torch.nonzero(data.train_y == label).flatten()
        table = {_digest(data.train_x[i]): i for i in pool.tolist()}
        for slot in torch.nonzero(labels == label).flatten().tolist():
            found[slot] = table.get(_digest(images[slot]), -1)
    if (found < 0).any() or not torch.equal(data.train_x[found.clamp(min=0)], images):
        return None
    return found


def _digest(image: torch.Tensor) -> bytes:
    return hashlib.blake2b(image.contiguous().numpy().tobytes(), digest_size=16).digest()
