"""Predict from a downloaded ONNX snapshot with onnxruntime alone (no torch, no service).

The snapshot's metadata says everything needed: class labels in output order, input size,
pixel layout (the format is `learner.snapshot_format`'s; importing it does not load
torch). Images of any size are converted to RGB and resized to the input size.

    python -m clients.onnx_client snapshot.onnx photo1.jpg photo2.png --k 3
    python -m clients.onnx_client --url http://127.0.0.1:8000 photo.jpg   # downloads the latest
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from PIL import Image

from learner.snapshot_format import OnnxSnapshot, top_k


class OnnxClassifier(OnnxSnapshot):
    """An ONNX snapshot ready to answer: `predict(images)` -> top-k labels with probabilities."""

    def __init__(self, model: str | Path | bytes, threads: int | None = None):
        super().__init__(model, threads)
        self.labels: list[str] = self.info.labels
        self.input_shape: tuple[int, int, int] = self.info.input_shape
        self.model_version = self.info.model_version
        self.metadata = self.info.metadata

    @classmethod
    def from_service(cls, url: str, snapshot: str = "latest", token: str | None = None, **kwargs) -> "OnnxClassifier":
        import httpx

        headers = {"Authorization": f"Bearer {token}"} if token else {}
        r = httpx.get(f"{url.rstrip('/')}/snapshots/{snapshot}", headers=headers, timeout=60)
        r.raise_for_status()
        return cls(r.content, **kwargs)

    def pixels(self, images) -> np.ndarray:
        """Paths, PIL images or uint8 arrays [H, W, 3] -> uint8 [n, 3, H, W] at the input size."""
        _, h, w = self.input_shape
        out = []
        for img in images:
            if isinstance(img, np.ndarray):
                img = Image.fromarray(img)
            elif not isinstance(img, Image.Image):
                img = Image.open(img)
            img = img.convert("RGB")
            if img.size != (w, h):
                img = img.resize((w, h), Image.BILINEAR)
            out.append(np.asarray(img, dtype=np.uint8).transpose(2, 0, 1))
        return np.ascontiguousarray(np.stack(out))

    def predict(self, images, k: int = 3) -> list[list[dict]]:
        return top_k(self.probabilities(self.pixels(images)), self.labels, k)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", help="a snapshot .onnx file (or use --url)")
    p.add_argument("images", nargs="+")
    p.add_argument("--url", help="download the snapshot from this service instead")
    p.add_argument("--snapshot", default="latest", help="with --url: which snapshot id")
    p.add_argument("--token")
    p.add_argument("--k", type=int, default=3)
    args = p.parse_args(argv)
    if args.url:
        images = ([args.model] if args.model else []) + args.images
        clf = OnnxClassifier.from_service(args.url, args.snapshot, args.token)
    else:
        images = args.images
        clf = OnnxClassifier(args.model)
    for path, top in zip(images, clf.predict(images, args.k)):
        print(json.dumps({"image": str(path), "model_version": clf.model_version, "top": top}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
