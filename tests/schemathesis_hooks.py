"""What schemathesis needs to know about our API beyond JSON Schema (loaded with
SCHEMATHESIS_HOOKS=tests.schemathesis_hooks):

- the custom string formats `image-base64` and `image-base64url`, and the image media types of
  the multipart bodies: valid examples are real CIFAR-10 images (JSON Schema cannot say "a
  decodable 32x32 picture"), in every accepted format;
- `format: binary`, used here only by the multipart image parts: real images too (schemathesis
  would otherwise send its smallest sample files, 1x1 pixels, which this model refuses);
- how an `application/x-ndjson` body is written: one JSON value per line;
- the one multipart rule a schema cannot state: the `label` fields are one for all images or one
  per image, and `id` fields, if any, one per image. The same filter drops positive multipart cases whose
  labels break the schema's own label rule: schemathesis's coverage phase builds one such
  "example" for multipart bodies with an `encoding` and would count it as valid data. And it
  drops the negative multipart cases a form cannot carry: a number or null in a text part is
  text (`null` is a good label).
"""

from __future__ import annotations

import base64
import io
import json
import re
import zipfile
from pathlib import Path

import schemathesis
from hypothesis import strategies as st
from PIL import Image
from schemathesis.transport.serialization import Binary

from service.web.routers.bodies import LABEL_PATTERN

ZIP = Path(__file__).resolve().parents[2] / "shared" / "datasets" / "cifar10-jpeg.zip"


def real_images(n: int = 8) -> dict[str, list[bytes]]:
    """n real CIFAR-10 training images in each format the service accepts."""
    with zipfile.ZipFile(ZIP) as z:
        names = sorted(x for x in z.namelist() if x.endswith(".jpg") and "/train/" in x)[::997][:n]
        jpegs = [z.read(x) for x in names]
    out = {"image/jpeg": jpegs}
    for media, fmt in (("image/png", "PNG"), ("image/webp", "WEBP"), ("image/bmp", "BMP")):
        out[media] = []
        for data in jpegs:
            buf = io.BytesIO()
            Image.open(io.BytesIO(data)).save(buf, fmt)
            out[media].append(buf.getvalue())
    return out


IMAGES = real_images()
ALL = [img for imgs in IMAGES.values() for img in imgs]

schemathesis.openapi.format("image-base64", st.sampled_from([base64.b64encode(i).decode() for i in ALL]))
schemathesis.openapi.format("image-base64url",
                            st.sampled_from([base64.urlsafe_b64encode(i).decode().rstrip("=") for i in ALL]))
schemathesis.openapi.format("binary", st.sampled_from(ALL).map(Binary))
for media_type, images in IMAGES.items():
    schemathesis.openapi.media_type(media_type, st.sampled_from(images))


@schemathesis.serializer("application/x-ndjson", "application/jsonl")
def ndjson(ctx, value) -> bytes:
    lines = value if isinstance(value, list) else [value]
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


def as_list(value) -> list:
    return value if isinstance(value, list) else [] if value is None else [value]


def as_form_text(values: list) -> list | None:
    """Scalars as schemathesis writes them into form parts (JSON text: null becomes "null"); None
    if some value is not a scalar at all."""
    if any(isinstance(v, (dict, list)) for v in values):
        return None
    return [v if isinstance(v, str) else json.dumps(v) for v in values]


@schemathesis.hook
def filter_case(ctx, case) -> bool:
    """Drop multipart cases that break the rules above when meant as valid, and those meant as
    invalid that a form cannot make invalid: a number or a null in a text part arrives as text,
    which may be a perfectly good label or id."""
    body, meta = case.body, case.meta
    if not (case.media_type or "").startswith("multipart/") or not isinstance(body, dict) or "label" not in body:
        return True
    present = {key: [body[key]] if body[key] is None else as_list(body[key]) for key in ("label", "id") if key in body}
    labels, ids = as_form_text(present["label"]), as_form_text(present.get("id", []))
    images = as_list(body.get("image"))
    valid = (labels is not None and ids is not None and len(images) > 0
             and all(re.match(LABEL_PATTERN, x) for x in labels)
             and len(labels) in (1, len(images)) and len(ids) in (0, len(images)))
    positive = meta is None or meta.generation.mode.is_positive
    return valid if positive else not valid
