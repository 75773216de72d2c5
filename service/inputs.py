"""Validation of what clients send: images (PNG or JPEG, also WebP and BMP) of any size within
the byte limit, brought to image_size x image_size by the snapshot format's one rule (shorter
side resized, centre square cropped: `learner.snapshot_format.fit_to_input`; `strict` refuses
any other size instead), converted to RGB uint8 [3, H, W]. Bad input is an InputError.
No torch here: the inference replica decodes with it too."""

from __future__ import annotations

import base64
import binascii
import io
import warnings

import numpy as np
from PIL import Image

from learner.snapshot_format import fit_to_input

ACCEPTED_FORMATS = {"PNG", "JPEG", "WEBP", "BMP"}
CONVERTIBLE_MODES = {"RGB", "RGBA", "L", "LA", "P"}  # channels we can read as RGB without guessing


class InputError(ValueError):
    """A client's input is invalid; `status` is the HTTP status to answer with."""

    def __init__(self, code: str, detail: str, status: int = 422):
        super().__init__(detail)
        self.code, self.detail, self.status = code, detail, status


def decode_base64(text: str, what: str = "image") -> bytes:
    """Standard or URL-safe base64, padding optional."""
    if not isinstance(text, str) or not text:
        raise InputError("invalid_base64", f"{what} must be a non-empty base64 string")
    cleaned = text.strip().replace("-", "+").replace("_", "/")
    cleaned += "=" * (-len(cleaned) % 4)
    try:
        return base64.b64decode(cleaned, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InputError("invalid_base64", f"{what} is not valid base64: {exc}") from exc


def decode_image(data: bytes, size: int, max_bytes: int, strict: bool = False) -> np.ndarray:
    """Encoded image bytes -> uint8 [3, size, size]. Raises InputError with a clear reason."""
    if not data:
        raise InputError("empty_image", "the image is empty")
    if len(data) > max_bytes:
        raise InputError("image_too_large", f"the image has {len(data)} bytes, the limit is {max_bytes}", 413)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as im:
                fmt, mode, (w, h) = im.format, im.mode, im.size
                if fmt not in ACCEPTED_FORMATS:
                    raise InputError("unsupported_format", f"image format {fmt} is not accepted; send PNG or JPEG", 415)
                if strict and (w, h) != (size, size):
                    raise InputError("wrong_shape", f"the image is {w}x{h}, this model takes {size}x{size}")
                if mode not in CONVERTIBLE_MODES:
                    raise InputError("unsupported_mode", f"image mode {mode} is not accepted; send RGB or grayscale")
                im.load()  # decodes fully: truncated or corrupt data fails here
                rgb = np.asarray(fit_to_input(im.convert("RGB"), size), dtype=np.uint8)
    except InputError:
        raise
    except Exception as exc:  # PIL raises many types for corrupt data
        raise InputError("corrupt_image", f"the image cannot be decoded: {exc}") from exc
    return np.ascontiguousarray(rgb.transpose(2, 0, 1))


def decode_images(blobs: list[bytes], size: int, max_bytes: int, strict: bool = False) -> np.ndarray:
    """Several encoded images -> uint8 [N, 3, size, size]; an error names the image at fault."""
    images = []
    for i, blob in enumerate(blobs):
        try:
            images.append(decode_image(blob, size, max_bytes, strict))
        except InputError as exc:
            detail = f"image {i}: {exc.detail}" if len(blobs) > 1 else exc.detail
            raise InputError(exc.code, detail, exc.status) from exc
    return np.stack(images)
