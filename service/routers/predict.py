"""Predictions from the learner's latest published weights."""

from __future__ import annotations

import torch
from fastapi import APIRouter, Query, Request
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool

from ..errors import NoClassesYet
from ..inputs import InputError, decode_base64, decode_image
from ..settings import Settings
from ..worker import LearnerWorker
from .auth import require
from .bodies import BodyModels, content_kind, read_form
from .errors import error_responses

IMAGE_QUERY = Query(..., min_length=1, description="the image (PNG, JPEG, WebP, BMP), base64url",
                    json_schema_extra={"format": "image-base64url"})
K_QUERY = Query(3, ge=1, description="how many labels to answer (capped at the service's limit)")


class Label(BaseModel):
    label: str
    probability: float


class Prediction(BaseModel):
    model_version: int
    steps: int
    top: list[Label]


class Predictions(BaseModel):
    model_version: int
    steps: int
    results: list[list[Label]]


def decode_many(blobs: list[bytes], settings: Settings) -> torch.Tensor:
    images = []
    for i, blob in enumerate(blobs):
        try:
            images.append(decode_image(blob, settings.image_size, settings.max_image_bytes))
        except InputError as exc:
            raise InputError(exc.code, f"image {i}: {exc.detail}" if len(blobs) > 1 else exc.detail, exc.status) from exc
    return torch.stack(images)


def top_k(probs: torch.Tensor, classes, k: int) -> list[list[dict]]:
    """[n, classes] probabilities -> per image the k most likely labels with their probabilities
    (a forgotten class, None in `classes`, is never one of them)."""
    live = [i for i, label in enumerate(classes) if label is not None]
    top = torch.topk(probs[:, live], min(k, len(live)), dim=1)
    return [[{"label": classes[live[int(c)]], "probability": round(float(p), 6)} for p, c in zip(ps, cs)]
            for ps, cs in zip(top.values, top.indices)]


def predict(worker: LearnerWorker, blobs: list[bytes], k: int, settings: Settings) -> dict:
    images = decode_many(blobs, settings)
    predictor = worker.predictor  # one consistent model for the whole request
    if not predictor.labels:
        raise NoClassesYet("the model has not learned any class yet")
    return {"model_version": predictor.version, "steps": predictor.steps,
            "results": top_k(predictor.probabilities(images), predictor.classes, min(k, settings.max_top_k))}


async def predict_request_images(request: Request, models: BodyModels) -> tuple[list[bytes], int | None]:
    """The images (and k) of a POST /predict body, JSON or multipart."""
    if content_kind(request) == "json":
        return models.predict_json(await request.body())
    blobs, _, _ = await read_form(request, models, with_labels=False)
    return blobs, None


def router(settings: Settings, models: BodyModels) -> APIRouter:
    api = APIRouter(tags=["predict"])

    @api.get("/predict", response_model=Prediction, dependencies=[require(settings, "read")],
             responses=error_responses(401, 403, 409, 413, 415, 422))
    async def get_predict(request: Request, image: str = IMAGE_QUERY, k: int = K_QUERY):
        """The top-k labels of one image passed in the query (small images)."""
        metrics = request.app.state.metrics
        with metrics.predict_latency.time():
            answer = await run_in_threadpool(predict, request.app.state.runtime.worker, [decode_base64(image)], k,
                                             settings)
        return {"model_version": answer["model_version"], "steps": answer["steps"], "top": answer["results"][0]}

    @api.post("/predict", response_model=Predictions, dependencies=[require(settings, "read")],
              openapi_extra=models.predict_body(), responses=error_responses(400, 401, 403, 409, 413, 415, 422))
    async def post_predict(request: Request, k: int = K_QUERY):
        """The top-k labels of one or many images: JSON (`{images: [...], k?}`) or multipart files."""
        blobs, k_body = await predict_request_images(request, models)
        with request.app.state.metrics.predict_latency.time():
            return await run_in_threadpool(predict, request.app.state.runtime.worker, blobs, k_body or k, settings)

    return api
