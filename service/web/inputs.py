"""Validation of what clients send: images within the byte limit, read by the snapshot format's one
input rule (`learner.formats.snapshot.read_image`: accepted formats and modes, pixel and aspect
bounds from the header, whole data, EXIF orientation, the centre square brought to image_size;
`strict` refuses any other size instead) into RGB uint8 [3, H, W]. Bad input is an InputError.
No torch here: the inference replica decodes with it too."""

from __future__ import annotations

import base64
import binascii

import numpy as np

from learner.formats.snapshot import ImageRejected, read_image


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
        return read_image(data, size, strict)
    except ImageRejected as exc:
        raise InputError(exc.code, exc.detail, exc.status) from exc


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
