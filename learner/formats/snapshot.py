"""The ONNX snapshot format, in one place and without torch: what the graph takes and gives, the
metadata keys, and how its logits become top-k labels. The exporter (`service.storage.snapshots`), the
learner's and the replica's predictions, and the ONNX client (`clients.onnx_client`) all use it.

A snapshot is an ONNX graph `pixels` (uint8 [n, 3, H, W], RGB, NCHW; the graph scales them to
[0, 1] itself) -> `logits` (float32 [n, classes]; calibrated where the service calibrates: their softmax is the
probabilities `/predict` answers), and from a calibrated service `unknown_score` (float32 [n]: how unlike every
learned class, `learner.heads.calibration`), with string metadata: `labels` (JSON list, the
outputs in order), `input_shape` (JSON [3, H, W]), the names and layout above, and the
exporter's own keys (model_version, steps, samples_trained, method, created, service_version: the
package's version, as /openapi.json says it; `calibration`: the temperature, and the unknown_threshold past
which an image is "none of these").

>>> props = metadata_props(["cat", "dog"], 32, {"model_version": 7, "method": "aser-mu"})
>>> info = SnapshotInfo.from_metadata(props)
>>> info.labels, info.input_shape, info.model_version
(['cat', 'dog'], (3, 32, 32), 7)
>>> import numpy as np
>>> top_k(softmax(np.array([[0.0, 2.0, -1e4]])), ["a", "b", None], 3)  # None: a forgotten class
[[{'label': 'b', 'probability': 0.880797}, {'label': 'a', 'probability': 0.119203}]]
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

INPUT_NAME = "pixels"
OUTPUT_NAME = "logits"
UNKNOWN_OUTPUT = "unknown_score"
RESIZE_RULE = ("EXIF orientation applied, the centre square cropped, then resized to the input size (bilinear, "
               "antialiased); an image already at the input size is taken as it is")
PREPROCESSING = (f"RGB image brought to the input size ({RESIZE_RULE}), pixels as uint8 in NCHW order; the graph "
                 "scales them to [0, 1] itself. Outputs are logits; softmax gives class probabilities.")


ACCEPTED_FORMATS = ("PNG", "JPEG", "MPO", "WEBP", "BMP")  # MPO: a phone's multi-picture JPEG, its first frame
ACCEPTED_MODES = ("RGB", "RGBA", "L", "LA", "P", "1")  # channels read as RGB without guessing (no CMYK, no 16-bit)
MAX_PIXELS = 40_000_000  # decoded pixels of one image (a JPEG decodes at 1/2 to 1/8 scale first when it can)
MAX_ASPECT_RATIO = 20  # longer side over shorter side
# a JPEG's scans: ordinary encoders write a dozen or fewer (libjpeg's progression: 10 in colour, 6 in
# grey); each is a pass over the coefficient buffer, so a file of repeated scans is a CPU bomb
MAX_SCANS = 100
# a progressive JPEG buffers every coefficient at full size whatever the draft scale (2 bytes each):
# 128 MiB is a 42 MP photo in 4:2:0, 21 MP in 4:4:4
MAX_COEFFICIENT_BYTES = 128 * 2**20
# decoding is pixel work: at most one image a core at a time, whatever the number of requests; and one
# progressive JPEG at a time, so the worst memory at once is one coefficient buffer (136 MiB at the cap,
# results/images/image-costs.json) beside the other cores' baseline decodes (16 MiB each at worst)
_DECODES = threading.BoundedSemaphore(os.cpu_count() or 1)
_PROGRESSIVE_DECODES = threading.BoundedSemaphore(1)


class ImageRejected(ValueError):
    """An image the input rule refuses; `code` names why, `status` is the HTTP status a service answers."""

    def __init__(self, code: str, detail: str, status: int = 422):
        super().__init__(detail)
        self.code, self.detail, self.status = code, detail, status


def read_image(data: bytes, size: int, strict: bool = False) -> np.ndarray:
    """Encoded image bytes -> uint8 [3, size, size] by the one input rule every part applies (the
    service's ingest and predict, the replica, the ONNX client): a format of ACCEPTED_FORMATS in a
    mode of ACCEPTED_MODES, whole (a JPEG must end with its end-of-image marker and its data must
    cover its declared frame), at most MAX_PIXELS decoded and MAX_ASPECT_RATIO long, a JPEG at most
    MAX_SCANS scans and, progressive, MAX_COEFFICIENT_BYTES of coefficients (all from the headers,
    before any decoding: `learner.formats.jpeg_structure`), EXIF orientation applied, then `fit_to_input`.
    `strict`: refuse any size but size x size. Raises ImageRejected.

    >>> from PIL import Image
    >>> buf = io.BytesIO(); Image.new("RGB", (64, 48), (255, 0, 0)).save(buf, "PNG")
    >>> read_image(buf.getvalue(), 32).shape
    (3, 32, 32)
    >>> buf = io.BytesIO(); Image.new("L", (3000, 100)).save(buf, "PNG")
    >>> try:
    ...     read_image(buf.getvalue(), 32)
    ... except ImageRejected as e:
    ...     print(e.code, e.status)
    extreme_aspect_ratio 422
    """
    from PIL import Image, ImageOps

    if not data:
        raise ImageRejected("empty_image", "the image is empty")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as im:
                progressive = _check_header(im, data, size, strict)
                if im.format in ("JPEG", "MPO"):
                    im.draft("RGB", (size, size))  # decode at the smallest scale still >= size
                with _PROGRESSIVE_DECODES if progressive else contextlib.nullcontext(), _DECODES:
                    im.load()  # decodes fully: truncated or corrupt data fails here
                    upright = ImageOps.exif_transpose(im)
                    return np.ascontiguousarray(np.asarray(fit_to_input(upright.convert("RGB"), size),
                                                           dtype=np.uint8).transpose(2, 0, 1))
    except ImageRejected:
        raise
    except Exception as exc:  # PIL raises many types for corrupt data
        raise ImageRejected("corrupt_image", f"the image cannot be decoded: {exc}") from exc


def _check_header(im, data: bytes, size: int, strict: bool) -> bool:
    """Everything the header tells, refused before a pixel is decoded. Returns whether the image is a
    progressive JPEG (its decode buffers every coefficient)."""
    (w, h), fmt = im.size, im.format
    if fmt not in ACCEPTED_FORMATS:
        raise ImageRejected("unsupported_format", f"image format {fmt} is not accepted; send one of "
                            f"{', '.join(ACCEPTED_FORMATS)}", 415)
    if im.mode not in ACCEPTED_MODES:
        raise ImageRejected("unsupported_mode", f"image mode {im.mode} is not accepted; send 8-bit RGB, "
                            "grayscale or palette images (no CMYK, no 16-bit)")
    if strict and (w, h) != (size, size):
        raise ImageRejected("wrong_shape", f"the image is {w}x{h}, this model takes {size}x{size}")
    if min(w, h) < 1 or max(w, h) > MAX_ASPECT_RATIO * min(w, h):
        raise ImageRejected("extreme_aspect_ratio",
                            f"the image is {w}x{h}, more than {MAX_ASPECT_RATIO} times longer than wide")
    reduce = 8 if fmt in ("JPEG", "MPO") else 1  # a JPEG's draft decodes at 1/8 scale when it can
    if w * h > MAX_PIXELS * reduce * reduce or (reduce == 1 and w * h > MAX_PIXELS):
        raise ImageRejected("too_many_pixels", f"the image is {w}x{h}, more than {MAX_PIXELS:,} pixels", 413)
    if fmt in ("JPEG", "MPO"):
        if not data.rstrip(b"\0").endswith(b"\xff\xd9"):
            raise ImageRejected("corrupt_image", "the JPEG data is truncated (no end-of-image marker)")
        return _check_jpeg_structure(data)
    return False


def _check_jpeg_structure(data: bytes) -> bool:
    """The costs a JPEG's header does not show: its scans, its data's coverage, its coefficient buffer."""
    from .jpeg_structure import JpegStructureError, read_structure

    try:
        jpeg = read_structure(data)
    except JpegStructureError as exc:
        if exc.kind == "unsupported":
            raise ImageRejected("unsupported_format", str(exc), 415) from exc
        raise ImageRejected("corrupt_image", f"the JPEG cannot be decoded: {exc}") from exc
    if jpeg.scans > MAX_SCANS:
        raise ImageRejected("too_many_scans", f"the JPEG holds {jpeg.scans} scans, more than {MAX_SCANS}; "
                            "re-encode it (ordinary encoders write a dozen or fewer)")
    if jpeg.uncovered():
        raise ImageRejected("corrupt_image", f"the JPEG's data ends before its declared {jpeg.width}x{jpeg.height} "
                            "frame is covered")
    if jpeg.progressive and jpeg.coefficient_bytes > MAX_COEFFICIENT_BYTES:
        raise ImageRejected("too_many_pixels", f"the progressive JPEG is {jpeg.width}x{jpeg.height}: decoding it "
                            f"buffers {jpeg.coefficient_bytes / 2**20:.0f} MiB of coefficients, more than "
                            f"{MAX_COEFFICIENT_BYTES // 2**20}; send a baseline JPEG or a smaller one", 413)
    return jpeg.progressive


def fit_to_input(image, size: int):
    """A PIL image at `size` x `size` by the one rule every part applies (RESIZE_RULE): the centre
    square is cut in the source's coordinates and only it is resized, so a long thin image costs
    what its square costs.

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
    side = min(w, h)
    left, top = (w - side) // 2, (h - side) // 2
    return image.resize((size, size), Image.BILINEAR, box=(left, top, left + side, top + side))


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
        return self.session.run([OUTPUT_NAME], {self.info.input_name: pixels})[0]

    def probabilities(self, pixels: np.ndarray) -> np.ndarray:
        return softmax(self.logits(pixels))

    @property
    def unknown_threshold(self) -> float | None:
        """The "none of these" score past which an image is unknown (None: never, or an uncalibrated snapshot)."""
        return json.loads(self.info.metadata.get("calibration", "{}")).get("unknown_threshold")

    def answers(self, pixels: np.ndarray) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
        """Class probabilities, "none of these" scores (None from an uncalibrated snapshot) and whether each image
        is unknown, from one run of the graph."""
        names = [o.name for o in self.session.get_outputs()]
        outputs = self.session.run(names, {self.info.input_name: pixels})
        scores = outputs[names.index(UNKNOWN_OUTPUT)] if UNKNOWN_OUTPUT in names else None
        threshold = self.unknown_threshold
        unknown = (scores > threshold) if scores is not None and threshold is not None \
            else np.zeros(len(pixels), dtype=bool)
        return softmax(outputs[names.index(OUTPUT_NAME)]), scores, unknown
