"""The ONNX snapshot format, in one place and without torch: what the graph takes and gives, the
metadata keys, and how its logits become top-k labels. The exporter (`service.snapshots`), the
learner's and the replica's predictions, and the ONNX client (`clients.onnx_client`) all use it.

A snapshot is an ONNX graph `pixels` (uint8 [n, 3, H, W], RGB, NCHW; the graph scales them to
[0, 1] itself) -> `logits` (float32 [n, classes]), with string metadata: `labels` (JSON list, the
outputs in order), `input_shape` (JSON [3, H, W]), the names and layout above, and the
exporter's own keys (model_version, steps, samples_trained, method, created).

>>> props = metadata_props(["cat", "dog"], 32, {"model_version": 7, "method": "aser-mu"})
>>> info = SnapshotInfo.from_metadata(props)
>>> info.labels, info.input_shape, info.model_version
(['cat', 'dog'], (3, 32, 32), 7)
>>> import numpy as np
>>> top_k(softmax(np.array([[0.0, 2.0, -1e4]])), ["a", "b", None], 3)  # None: a forgotten class
[[{'label': 'b', 'probability': 0.880797}, {'label': 'a', 'probability': 0.119203}]]
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

INPUT_NAME = "pixels"
OUTPUT_NAME = "logits"
RESIZE_RULE = ("shorter side resized to the input size (bilinear, antialiased), then the centre square cropped; "
               "an image already at the input size is taken as it is")
PREPROCESSING = (f"RGB image brought to the input size ({RESIZE_RULE}), pixels as uint8 in NCHW order; the graph "
                 "scales them to [0, 1] itself. Outputs are logits; softmax gives class probabilities.")


def fit_to_input(image, size: int):
    """A PIL image at `size` x `size` by the one rule every part applies (RESIZE_RULE): the
    service's ingest and predict, the replica, the ONNX client and the Python API client.

    >>> from PIL import Image
    >>> fit_to_input(Image.new("RGB", (640, 480)), 32).size
    (32, 32)
    >>> wide = Image.new("RGB", (60, 30), "white"); wide.paste((255, 0, 0), (0, 0, 15, 30))  # red left quarter
    >>> fit_to_input(wide, 30).getpixel((0, 15))  # the centre square keeps no red
    (255, 255, 255)
    """
    from PIL import Image

    w, h = image.size
    if (w, h) == (size, size):
        return image
    scale = size / min(w, h)
    resized = image.resize((max(size, round(w * scale)), max(size, round(h * scale))), Image.BILINEAR)
    left, top = (resized.width - size) // 2, (resized.height - size) // 2
    return resized.crop((left, top, left + size, top + size))


def metadata_props(labels: list[str], input_size: int, extra: dict) -> dict[str, str]:
    """The metadata a snapshot carries, as ONNX string properties."""
    props = {"labels": json.dumps(labels), "input_name": INPUT_NAME,
             "input_shape": json.dumps([3, input_size, input_size]), "input_dtype": "uint8", "color": "RGB",
             "layout": "NCHW", "output_name": OUTPUT_NAME, "preprocessing": PREPROCESSING, "resize": RESIZE_RULE}
    props.update({k: v if isinstance(v, str) else json.dumps(v) for k, v in extra.items()})
    return props


@dataclass(frozen=True)
class SnapshotInfo:
    labels: list[str]
    input_shape: tuple[int, int, int]
    input_name: str
    model_version: int | None
    metadata: dict[str, str]

    @classmethod
    def from_metadata(cls, meta: dict[str, str]) -> "SnapshotInfo":
        return cls(json.loads(meta["labels"]), tuple(json.loads(meta["input_shape"])),
                   meta.get("input_name", INPUT_NAME), int(meta["model_version"]) if "model_version" in meta else None,
                   dict(meta))


def softmax(logits: np.ndarray) -> np.ndarray:
    z = np.asarray(logits, dtype=np.float64)
    z = np.exp(z - z.max(axis=1, keepdims=True))
    return z / z.sum(axis=1, keepdims=True)


def top_k(probs: np.ndarray, labels: list[str | None], k: int) -> list[list[dict]]:
    """[n, classes] probabilities -> per image the k most likely labels with their probabilities
    (ties in output order; a None label, a forgotten class, is never one of them)."""
    live = np.array([i for i, label in enumerate(labels) if label is not None], dtype=np.int64)
    probs = np.asarray(probs)[:, live]
    top = np.argsort(-probs, axis=1, kind="stable")[:, :k]
    return [[{"label": labels[live[c]], "probability": round(float(p[c]), 6)} for c in row]
            for p, row in zip(probs, top)]


class OnnxSnapshot:
    """A snapshot loaded into onnxruntime: `probabilities(pixels)` for uint8 [n, 3, H, W]."""

    def __init__(self, model: str | Path | bytes, threads: int | None = None):
        import onnxruntime as ort

        options = ort.SessionOptions()
        if threads:
            options.intra_op_num_threads = threads
        source = model if isinstance(model, bytes) else str(model)
        self.session = ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])
        self.info = SnapshotInfo.from_metadata(self.session.get_modelmeta().custom_metadata_map)

    def logits(self, pixels: np.ndarray) -> np.ndarray:
        return self.session.run(None, {self.info.input_name: pixels})[0]

    def probabilities(self, pixels: np.ndarray) -> np.ndarray:
        return softmax(self.logits(pixels))
