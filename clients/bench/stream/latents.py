"""A dataset seen through a pretrained backbone's frozen part, computed once and reused.

The frozen part's output never changes, so the benchmark encodes each dataset once per backbone
setting (input size, cut, latent bits) and keeps the stored latents in the cache folder; every
run then streams latents instead of images. The service pays one frozen forward an incoming
image: a run measures that cost on its own thread (`frozen_forward_cpu_ms`) and reports it beside
the training step's, so its CPU figure counts one frozen forward a sample as the service does.
"""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import replace
from pathlib import Path

import torch

from learner.data import ImageDataset, default_cache_dir

ENCODE_BATCH = 100
COST_SAMPLE = 100  # images timed for the frozen forward's cost


def _data_key(data: ImageDataset) -> str:
    digest = hashlib.blake2b(digest_size=10)
    for t in (data.train_x, data.train_y, data.test_x, data.test_y):
        digest.update(t.contiguous().numpy().tobytes())
    return digest.hexdigest()


def _encode_all(backbone, images: torch.Tensor, progress=None) -> torch.Tensor:
    """The frozen part's output at the backbone's cut, by the learner's own path (onnxruntime on the
    CPU), in fp16 (what 16-bit latents store; 8-bit ones are quantised from it, at most one grid step
    from quantising the fp32 output)."""
    parts = []
    for i in range(0, images.shape[0], ENCODE_BATCH):
        parts.append(backbone.graphs.lower(images[i:i + ENCODE_BATCH], features=False)[0].half())
        if progress:
            progress(min(i + ENCODE_BATCH, images.shape[0]))
    return torch.cat(parts)


def _cache_file(data: ImageDataset, backbone, cut: int, cache_dir) -> Path:
    name = f"{backbone.name}-{backbone.input_size}px-cut{cut}-ort"  # -ort: onnxruntime's latents
    return Path(cache_dir or default_cache_dir()) / f"{data.name}-{_data_key(data)}-{name}.pt"


def encoded_dataset(data: ImageDataset, backbone, cache_dir: str | os.PathLike | None = None,
                    progress=None) -> ImageDataset:
    """`data` with its images replaced by `backbone.encode` of them (from the cache if there)."""
    sha = backbone.frozen.weights_sha256
    file = _cache_file(data, backbone, backbone.cut, cache_dir)
    if file.exists():
        try:
            saved = torch.load(file, weights_only=True)
            if saved["weights_sha256"] == sha:
                return _stored(data, backbone, saved["train_x"], saved["test_x"])
        except Exception:
            pass  # a torn cache file is rebuilt
    train, test = _encode_all(backbone, data.train_x, progress), _encode_all(backbone, data.test_x)
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        tmp = file.with_suffix(f".tmp{os.getpid()}")
        torch.save({"train_x": train, "test_x": test, "weights_sha256": sha}, tmp)
        os.replace(tmp, file)
    except OSError:
        pass
    return _stored(data, backbone, train, test)


def _stored(data: ImageDataset, backbone, train_x: torch.Tensor, test_x: torch.Tensor) -> ImageDataset:
    def stored(cached: torch.Tensor) -> torch.Tensor:  # fp16 is the 16-bit form already
        return backbone.quantise(cached.float()) if backbone.latent_bits == 8 else cached

    return replace(data, train_x=stored(train_x), test_x=stored(test_x))


def frozen_forward_cpu_ms(backbone, images: torch.Tensor) -> float:
    """CPU milliseconds of one frozen forward an image, on this process's threads, in batches of 10
    (the stream's batch): what the service pays per incoming image before the step."""
    sample = images[:COST_SAMPLE]
    backbone.encode(sample[:10])  # warm-up
    start = time.process_time()
    for i in range(0, sample.shape[0], 10):
        backbone.encode(sample[i:i + 10])
    return 1000 * (time.process_time() - start) / max(sample.shape[0], 1)
