"""Predict from a downloaded ONNX snapshot with onnxruntime alone (no torch, no service).

The snapshot's metadata says everything needed: class labels in output order, input size,
pixel layout (the format is `learner.formats.snapshot`'s; importing it does not load
torch, and it needs no HTTP package: onnxruntime, numpy and Pillow are all it imports). Image files are read by the service's own input rule (`read_image`: the formats and
modes it accepts, EXIF orientation, the centre square brought to the input size). Every failure (a file that
is missing or not ONNX, a model that is not one of our snapshots, an image that is not one, a
service that is down or has no such snapshot) is one line on stderr and exit status 1.

    python -m clients.onnx_client snapshot.onnx photo1.jpg photo2.png --k 3
    python -m clients.onnx_client --url http://127.0.0.1:8000 photo.jpg   # downloads the latest
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
from PIL import Image

from learner.formats.snapshot import ImageRejected, OnnxSnapshot, fit_to_input, read_image, top_k


class SnapshotError(RuntimeError):
    """A model, an image or a service that cannot be used, said in one sentence."""


class OnnxClassifier(OnnxSnapshot):
    """An ONNX snapshot ready to answer: `predict(images)` -> top-k labels with probabilities."""

    def __init__(self, model: str | Path | bytes, threads: int | None = None):
        if not isinstance(model, bytes):
            path = Path(model)
            if not path.is_file():
                raise SnapshotError(f"{path}: no such file")
            if path.stat().st_size == 0:
                raise SnapshotError(f"{path}: the file is empty")
        what = "the downloaded model" if isinstance(model, bytes) else str(model)
        try:
            super().__init__(model, threads)
        except KeyError as exc:
            raise SnapshotError(f"{what}: an ONNX model, but not a snapshot of this service (no {exc} "
                                "metadata)") from None
        except Exception as exc:  # onnxruntime's InvalidProtobuf, InvalidGraph, Fail...
            raise SnapshotError(f"{what}: not a usable ONNX model ({type(exc).__name__})") from None
        self.labels: list[str] = self.info.labels
        self.input_shape: tuple[int, int, int] = self.info.input_shape
        self.model_version = self.info.model_version
        self.metadata = self.info.metadata

    @classmethod
    def from_service(cls, url: str, snapshot: str = "latest", token: str | None = None, **kwargs) -> "OnnxClassifier":
        """Download a snapshot with the standard library alone (this client needs no HTTP package)."""
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        request = urllib.request.Request(f"{url.rstrip('/')}/snapshots/{snapshot}", headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=60) as r:
                return cls(r.read(), **kwargs)
        except urllib.error.HTTPError as exc:
            body = exc.read()
            try:
                detail = json.loads(body).get("detail", body.decode(errors="replace"))
            except ValueError:
                detail = body[:200].decode(errors="replace")
            raise SnapshotError(f"the service answered {exc.code} for snapshot {snapshot!r}: {detail}") from None
        except (urllib.error.URLError, OSError) as exc:
            raise SnapshotError(f"cannot reach the service at {url}: {exc}") from None

    def pixels(self, images) -> np.ndarray:
        """Paths or file objects (read by the service's own input rule, `read_image`), PIL images or
        uint8 arrays [H, W, 3] -> uint8 [n, 3, H, W] at the input size."""
        out = []
        for img in images:
            if isinstance(img, np.ndarray):
                img = Image.fromarray(img)
            if isinstance(img, Image.Image):
                img = fit_to_input(img.convert("RGB"), self.input_shape[1])
                out.append(np.asarray(img, dtype=np.uint8).transpose(2, 0, 1))
            else:
                out.append(open_image(img, self.input_shape[1]))
        return np.ascontiguousarray(np.stack(out))

    def predict(self, images, k: int = 3) -> list[list[dict]]:
        return top_k(self.probabilities(self.pixels(images)), self.labels, k)

    def answer(self, images, k: int = 3) -> list[dict]:
        """Per image, as the service's `/predict` answers one: the top-k labels, whether it is "none of these"
        (`unknown`) and its score (None from an uncalibrated snapshot)."""
        probabilities, scores, unknown = self.answers(self.pixels(images))
        tops = top_k(probabilities, self.labels, k)
        return [{"top": top, "unknown": bool(u), "unknown_score": None if scores is None else round(float(s), 4)}
                for top, u, s in zip(tops, unknown, scores if scores is not None else [None] * len(tops))]


def open_image(source, size: int) -> np.ndarray:
    """A path or file object read by the one input rule, as uint8 [3, size, size], or a
    SnapshotError naming it."""
    name = getattr(source, "name", source)
    try:
        data = source.read() if hasattr(source, "read") else Path(source).read_bytes()
        return read_image(data, size)
    except FileNotFoundError:
        raise SnapshotError(f"{name}: no such file") from None
    except IsADirectoryError:
        raise SnapshotError(f"{name}: a directory, not an image") from None
    except ImageRejected as exc:
        raise SnapshotError(f"{name}: not a readable image ({exc.detail})") from None


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {value}")
    return value


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", help="a snapshot .onnx file (or use --url)")
    p.add_argument("images", nargs="+")
    p.add_argument("--url", help="download the snapshot from this service instead")
    p.add_argument("--snapshot", default="latest", help="with --url: which snapshot id")
    p.add_argument("--token")
    p.add_argument("--k", type=positive, default=3, help="labels per image (1 or more)")
    args = p.parse_args(argv)
    try:
        if args.url:
            images = ([args.model] if args.model else []) + args.images
            clf = OnnxClassifier.from_service(args.url, args.snapshot, args.token)
        else:
            images = args.images
            clf = OnnxClassifier(args.model)
        answers = clf.answer(images, args.k)
    except SnapshotError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for path, answer in zip(images, answers):
        print(json.dumps({"image": str(path), "model_version": clf.model_version, **answer}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
