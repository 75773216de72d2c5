"""Predictions from the learner's latest published weights."""

from __future__ import annotations

import torch
from fastapi import APIRouter, Request
from pydantic import BaseModel, Field
from starlette.concurrency import run_in_threadpool

from learner.formats.snapshot import top_k
from service.learning.runtime import Runtime
from service.settings import Settings
from service.storage.errors import NoClassesYet
from service.web.inputs import decode_base64, decode_images
from service.web.routers.auth import Access
from service.web.routers.bodies import IMAGE_QUERY, K_QUERY, BodyModels, predict_request_images
from service.web.routers.errors import error_responses


class Label(BaseModel):
    label: str
    probability: float


class Prediction(BaseModel):
    model_version: int
    steps: int
    top: list[Label]
    unknown: bool = Field(description="far from every learned class: \"none of these\" (ASER_CALIBRATE)")
    unknown_score: float | None = Field(description="how unlike every learned class (0: a typical photo of one; "
                                        "unknown past the threshold /status gives); null without a calibration")


class Predictions(BaseModel):
    model_version: int
    steps: int
    results: list[list[Label]]
    unknown: list[bool] = Field(description="per image, as `results`: far from every learned class")
    unknown_score: list[float | None] = Field(description="per image: how unlike every learned class")


def predict(runtime: Runtime, blobs: list[bytes], k: int, settings: Settings) -> dict:
    images = torch.from_numpy(decode_images(blobs, runtime.image_size, settings.max_image_bytes,
                                            settings.strict_image_size))
    if not runtime.worker.predictor.labels:
        raise NoClassesYet("the model has not learned any class yet")
    # one forward pass with the requests arriving meanwhile, one model for all of them
    predictor, rows = runtime.batcher.run(images)  # probabilities, then the "none of these" score
    probs, scores = rows[:, :-1], rows[:, -1]
    unknown = predictor.calibration.unknown(scores) if predictor.calibration is not None \
        else torch.zeros(len(scores), dtype=torch.bool)
    return {"model_version": predictor.version, "steps": predictor.steps,
            "results": top_k(probs.numpy(), predictor.classes, min(k, settings.max_top_k)),
            "unknown": unknown.tolist(),
            "unknown_score": [None if s != s else round(s, 4) for s in scores.tolist()]}


def router(settings: Settings, access: Access, models: BodyModels) -> APIRouter:
    api = APIRouter(tags=["predict"])

    @api.get("/predict", response_model=Prediction, dependencies=[access.require("read")],
             responses=error_responses(401, 403, 409, 413, 415, 422))
    async def get_predict(request: Request, image: str = IMAGE_QUERY, k: int = K_QUERY):
        """The top-k labels of one image passed in the query (small images)."""
        metrics = request.app.state.metrics
        with metrics.predict_latency.time():
            answer = await run_in_threadpool(predict, request.app.state.runtime, [decode_base64(image)], k, settings)
        return {"model_version": answer["model_version"], "steps": answer["steps"], "top": answer["results"][0],
                "unknown": answer["unknown"][0], "unknown_score": answer["unknown_score"][0]}

    @api.post("/predict", response_model=Predictions, dependencies=[access.require("read")],
              openapi_extra=models.predict_body(), responses=error_responses(400, 401, 403, 409, 413, 415, 422))
    async def post_predict(request: Request, k: int = K_QUERY):
        """The top-k labels of one or many images: JSON (`{images: [...], k?}`) or multipart files."""
        blobs, k_body = await predict_request_images(request, models)
        with request.app.state.metrics.predict_latency.time():
            return await run_in_threadpool(predict, request.app.state.runtime, blobs, k_body or k, settings)

    return api
