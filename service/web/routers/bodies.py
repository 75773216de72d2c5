"""Request bodies: their models (the OpenAPI document is generated from the same models the
parser validates with, so the two cannot disagree) and their parsing (JSON, multipart, NDJSON).

Images travel as base64 strings in JSON (the custom string format `image-base64`: PNG, JPEG,
WebP or BMP bytes, standard or URL-safe alphabet, padding optional) and as files in multipart.
A label is 1 to `max_label_length` characters, with no control or invisible format characters
(zero-width joiners, bidi overrides, byte-order marks: Unicode category Cf) and no leading or
trailing whitespace, taken in Unicode NFC, so labels that look alike are one class. A sample id, optional, is the client's name for one sample (1-128 of
A-Z a-z 0-9 . _ : -): a sample sent again with the same id is stored once.
"""

from __future__ import annotations

import json
import sys
import unicodedata
from collections.abc import AsyncIterator
from functools import cached_property
from typing import Annotated

from fastapi import Query, Request
from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, TypeAdapter, ValidationError
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException

from service.settings import Settings
from service.web.inputs import InputError, decode_base64


def category_ranges(category: str) -> str:
    """The code points of a Unicode category as the body of a regex class (\\U escapes).

    >>> import re
    >>> invisible = re.compile(f"[{category_ranges('Cf')}]")
    >>> [bool(invisible.match(chr(cp))) for cp in (0x200B, 0x202E, 0xFEFF, ord("a"))]
    [True, True, True, False]
    """
    spans, start = [], None
    for cp in range(sys.maxunicode + 2):
        inside = cp <= sys.maxunicode and unicodedata.category(chr(cp)) == category
        if inside and start is None:
            start = cp
        elif not inside and start is not None:
            spans.append(f"\\U{start:08x}" + (f"-\\U{cp - 1:08x}" if cp - 1 > start else ""))
            start = None
    return "".join(spans)


CONTROL = r"\x00-\x1f\x7f-\x9f" + category_ranges("Cf")  # and the invisible format characters
LABEL_PATTERN = rf"^[^\s{CONTROL}](?:[^{CONTROL}]*[^\s{CONTROL}])?$"
SAMPLE_ID_PATTERN = r"^[A-Za-z0-9._:-]{1,128}$"
IMAGE_FORMATS = ("image/png", "image/jpeg", "image/webp", "image/bmp")
NDJSON_TYPES = ("application/x-ndjson", "application/jsonl")
STRICT_TYPES = ConfigDict(strict=True, regex_engine="python-re")
STRICT = ConfigDict(extra="forbid", **STRICT_TYPES)


IMAGE_QUERY = Query(..., min_length=1, description="the image (PNG, JPEG, WebP, BMP), base64url",
                    json_schema_extra={"format": "image-base64url"})
K_QUERY = Query(3, ge=1, description="how many labels to answer (capped at the service's limit)")


def _integral(value):
    """JSON Schema counts 5.0 as an integer; strict pydantic would not."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


Integer = Annotated[int, BeforeValidator(_integral)]


class BodyModels:
    """The request models of one service, with its limits (label length, samples per request)."""

    def __init__(self, settings: Settings):
        label = Annotated[str, Field(min_length=1, max_length=settings.max_label_length, pattern=LABEL_PATTERN,
                                     description="the class name (taken in Unicode NFC)", examples=["airplane"]),
                          AfterValidator(lambda text: unicodedata.normalize("NFC", text))]
        sample_id = Annotated[str, Field(pattern=SAMPLE_ID_PATTERN, description="the client's id of this sample; "
                                         "a repeated id is acknowledged again and stored once",
                                         examples=["6f1c2a0e9b3d4c58a7e2f0b1c9d8e7a6"])]
        image = Annotated[str, Field(min_length=1, json_schema_extra={"format": "image-base64"},
                                     description="PNG, JPEG, WebP or BMP bytes, base64")]
        n = settings.max_samples_per_request

        class Sample(BaseModel):
            model_config = STRICT
            label: label
            image: image
            id: sample_id = None  # optional, not nullable

        class SampleBatch(BaseModel):
            model_config = STRICT
            samples: list[Sample] = Field(min_length=1, max_length=n)

        class PredictImages(BaseModel):
            model_config = STRICT
            images: list[image] = Field(min_length=1, max_length=settings.max_predict_images)
            k: Integer = Field(None, ge=1, description="how many labels per image (capped at the service's limit)")

        class PredictImage(BaseModel):
            model_config = STRICT
            image: image
            k: Integer = Field(None, ge=1, description="how many labels (capped at the service's limit)")

        class Relabel(BaseModel):
            model_config = STRICT
            label: label

        self.labels = TypeAdapter(list[label], config=STRICT_TYPES)
        self.ids = TypeAdapter(list[sample_id], config=STRICT_TYPES)
        self.Sample, self.SampleBatch = Sample, SampleBatch
        self.PredictImages, self.PredictImage = PredictImages, PredictImage
        self.Relabel = Relabel
        self.max_samples, self.max_predict = n, settings.max_predict_images
        self.settings = settings

    # --- parsing -----------------------------------------------------------------------
    def samples(self, body: bytes | str) -> list:
        """A JSON sample or {'samples': [...]} -> Sample models."""
        data = parse_json(body)
        self.check_count(data, "samples", self.max_samples)
        model = self.SampleBatch if isinstance(data, dict) and "samples" in data else self.Sample
        parsed = validate(model, data)
        return parsed.samples if model is self.SampleBatch else [parsed]

    def predict_json(self, body: bytes) -> tuple[list[bytes], int | None]:
        data = parse_json(body)
        self.check_count(data, "images", self.max_predict)
        model = self.PredictImages if isinstance(data, dict) and "images" in data else self.PredictImage
        parsed = validate(model, data)
        images = parsed.images if model is self.PredictImages else [parsed.image]
        return [decode_base64(t, f"image {i}") for i, t in enumerate(images)], parsed.k

    def relabel(self, body: bytes) -> str:
        """{"label": ...} -> the label, validated as at ingest."""
        return validate(self.Relabel, parse_json(body)).label

    def check_count(self, data, key: str, limit: int) -> None:
        """Too many samples (or images) is one rule with one answer in every form: 413 too_many_samples."""
        items = data.get(key) if isinstance(data, dict) else None
        if isinstance(items, list) and len(items) > limit:
            raise too_many(limit, len(items))

    # --- OpenAPI -------------------------------------------------------------------------
    @cached_property
    def components(self) -> dict:
        """JSON schemas of the models, for #/components/schemas."""
        out = {}
        for model in (self.Sample, self.SampleBatch, self.PredictImages, self.PredictImage, self.Relabel):
            schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
            out.update(schema.pop("$defs", {}))
            out[model.__name__] = schema
        for schema in out.values():
            for prop in schema["properties"].values():
                if prop.get("default", 0) is None:  # optional fields are left out, never null
                    del prop["default"]
        return out

    def multipart(self, what: str, with_labels: bool) -> dict:
        n = self.max_samples if with_labels else self.max_predict
        props = {"image": {"type": "array", "minItems": 1, "maxItems": n,
                           "items": {"type": "string", "format": "binary"}, "description": f"the {what}' images"}}
        required = ["image"]
        if with_labels:
            label = self.components["Sample"]["properties"]["label"]
            props["label"] = {"type": "array", "minItems": 1, "maxItems": n, "items": label,
                              "description": "one label for all images, or one per image in order"}
            props["id"] = {"type": "array", "maxItems": n, "items": self.components["Sample"]["properties"]["id"],
                           "description": "optional: one sample id per image, in order"}
            required.append("label")
        return {"schema": {"type": "object", "properties": props, "required": required, "additionalProperties": False},
                "encoding": {"image": {"contentType": ", ".join(IMAGE_FORMATS)}}}

    def ingest_body(self) -> dict:
        return {"requestBody": {"required": True, "content": {
            "application/json": {"schema": {"anyOf": [ref("Sample"), ref("SampleBatch")]}},
            "multipart/form-data": self.multipart("samples", with_labels=True)}}}

    def stream_body(self) -> dict:
        """Any lines are taken: each is judged alone, and a line that is not a Sample or a
        SampleBatch is refused in its own acknowledgement while the stream goes on."""
        line = {"anyOf": [ref("Sample"), ref("SampleBatch")]}
        return {"requestBody": {"required": True, "description": "one JSON sample (or batch) per line; each line is "
                                "validated alone (x-line-schema) and answered by its own acknowledgement",
                                "content": {t: {"schema": {"x-line-schema": line}} for t in NDJSON_TYPES}}}

    def relabel_body(self) -> dict:
        return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref("Relabel")}}}}

    def predict_body(self) -> dict:
        return {"requestBody": {"required": True, "content": {
            "application/json": {"schema": {"anyOf": [ref("PredictImages"), ref("PredictImage")]}},
            "multipart/form-data": self.multipart("predictions", with_labels=False)}}}


def ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def parse_json(body: bytes | str):
    if not body or not body.strip():
        raise InputError("empty_body", "the request body is empty", 400)
    try:
        return json.loads(body)
    except RecursionError:
        raise InputError("invalid_json", "the body is nested too deeply", 400) from None
    except ValueError as exc:
        raise InputError("invalid_json", f"the body is not valid JSON: {exc}", 400) from exc


def validate(model: type[BaseModel] | TypeAdapter, data):
    try:
        return model.validate_python(data) if isinstance(model, TypeAdapter) else model.model_validate(data)
    except ValidationError as exc:
        raise InputError("invalid_request", validation_detail(exc), 422) from exc
    except RecursionError:
        raise InputError("invalid_json", "the body is nested too deeply", 400) from None


PATTERN_RULES = {
    LABEL_PATTERN: "a label has no control or invisible format characters and no leading or trailing whitespace",
    SAMPLE_ID_PATTERN: "a sample id is 1 to 128 characters of A-Z a-z 0-9 . _ : -",
}


def validation_detail(exc: ValidationError) -> list[dict]:
    """Pydantic's errors as plain JSON: where, what, and the message (a pattern in words)."""
    return [{"loc": [str(p) for p in e["loc"]], "type": e["type"],
             "msg": PATTERN_RULES.get((e.get("ctx") or {}).get("pattern"), e["msg"])} for e in exc.errors()]


def content_kind(request: Request) -> str:
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype == "application/json":
        return "json"
    if ctype == "multipart/form-data":
        return "multipart"
    raise InputError("unsupported_media_type", "send application/json or multipart/form-data", 415)


def too_many(limit: int, got: int | None = None) -> InputError:
    return InputError("too_many_samples", f"at most {limit} samples (images) per request"
                      + (f", got {got}" if got is not None else ""), 413)


async def read_form(request: Request, models: BodyModels, with_labels: bool):
    """The images (and labels and ids) of a multipart body; any other field is refused, as JSON
    refuses unknown fields. Without labels (a prediction): the images and the `k` fields."""
    n = models.max_samples if with_labels else models.max_predict
    try:
        form = await request.form(max_files=n, max_fields=3 * n)  # images sent as text parts are fields
    except HTTPException as exc:  # Starlette's multipart limits and parse errors
        if "Too many" in str(exc.detail):
            raise too_many(n) from None
        raise InputError("invalid_multipart", f"the multipart body cannot be parsed: {exc.detail}", 400) from None
    known = {"image", "label", "id"} if with_labels else {"image", "k"}
    unknown = sorted({key for key in form.keys() if key not in known})
    if unknown:
        raise InputError("invalid_request", f"unknown multipart fields {unknown}; send {sorted(known)}", 422)
    parts = form.getlist("image")
    if not parts:
        raise InputError("invalid_request", "a multipart body needs one or more 'image' parts", 422)
    if len(parts) > n:
        raise too_many(n, len(parts))
    blobs = [await p.read() if isinstance(p, UploadFile) else text_part_bytes(p) for p in parts]
    files = parts
    if not with_labels:
        return blobs, [v for v in form.getlist("k") if isinstance(v, str)], []
    labels = [v for v in form.getlist("label") if isinstance(v, str)]
    ids = [v for v in form.getlist("id") if isinstance(v, str)]
    if len(labels) == 1 and len(files) > 1:
        labels = labels * len(files)  # one label for the whole upload
    if len(labels) != len(files) or (ids and len(ids) != len(files)):
        raise InputError("invalid_request", f"got {len(files)} images, {len(labels)} labels and {len(ids)} ids; "
                                            "send one label per image (or one for all) and, if any, one id per image",
                         422)
    labels, ids = validate(models.labels, labels), validate(models.ids, ids)
    return blobs, labels, ids or [None] * len(blobs)


async def predict_request_images(request: Request, models: BodyModels) -> tuple[list[bytes], int | None]:
    """The images (and k) of a POST /predict body, JSON or multipart."""
    if content_kind(request) == "json":
        return models.predict_json(await request.body())
    blobs, k_fields, _ = await read_form(request, models, with_labels=False)
    if not k_fields:
        return blobs, None
    if len(k_fields) > 1 or not k_fields[0].strip().isdigit() or int(k_fields[0]) < 1:
        raise InputError("invalid_request", f"k must be one whole number of 1 or more, got {k_fields}", 422)
    return blobs, int(k_fields[0])


def text_part_bytes(text: str) -> bytes:
    """The bytes of a multipart part sent without a filename, which Starlette hands over as text
    (decoded as UTF-8 when valid, else as Latin-1). Image files are not valid UTF-8 (JPEG has
    0xFF bytes, PNG starts with 0x89; an all-ASCII file reads the same both ways), so Latin-1
    gives their bytes back; text with characters beyond Latin-1 was UTF-8 and is not an image."""
    try:
        return text.encode("latin-1")
    except UnicodeEncodeError:
        return text.encode("utf-8")


async def ndjson_lines(chunks: AsyncIterator[bytes], max_line: int) -> AsyncIterator[bytes | InputError]:
    """Non-empty lines of a streamed body; a line over max_line bytes becomes an InputError."""
    pending, skipping = b"", False
    async for chunk in chunks:
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for line in lines:
            if skipping:
                skipping = False
                continue
            if line.strip():
                yield line
        if len(pending) > max_line:
            if not skipping:
                yield InputError("body_too_large", f"a line may hold {max_line} bytes", 413)
            pending, skipping = b"", True
    if pending.strip() and not skipping:
        yield pending
