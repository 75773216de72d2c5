"""Operations: health, readiness, status and Prometheus metrics."""

from __future__ import annotations

import shutil
import time
from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from starlette.concurrency import run_in_threadpool

from service.learning.online import HistoryPoint
from service.learning.runtime import Runtime
from service.storage.errors import SleepOff
from service.storage.retention import database_bytes
from service.storage.store import by_label
from service.web.routers.auth import Access
from service.web.routers.errors import error_responses


class Quarantined(BaseModel):
    seq: int
    error: str
    at: float


class WorkerHealth(BaseModel):
    alive: bool
    restarts: int = Field(description="times a failed step made the worker restart from the last checkpoint")
    last_error: str | None
    checkpoint_failures: int
    snapshot_failures: int
    quarantined: int = Field(description="samples set aside because training on them fails every time")
    recent_quarantine: list[Quarantined]


class DamagedFile(BaseModel):
    file: str = Field(description="the file's name when it was found damaged")
    kind: str = Field(description="latent_store, checkpoint or snapshot")
    reason: str = Field(description="what was wrong (SQLite's words, a sha256 or size that differs, missing)")
    set_aside_as: str = Field(description="its name now, beside where it was (docs/operations.md#damaged-files)")
    at: float
    rebuilt: str = Field(description="what the service does instead")


class ClassAccuracy(BaseModel):
    accuracy: float
    samples: int


class OnlineFigures(BaseModel):
    accuracy: float | None = Field(description="test-then-train accuracy on every sample scored so far (each sample "
                                   "predicted by the model about to train on it)")
    window_accuracy: float | None = Field(description="the same over the last `window` samples scored")
    window: int
    samples_scored: int
    samples_unscored: int = Field(description="samples of known classes left unscored: once a sleep's top answers, "
                                  "one batch in ASER_ONLINE_SCORE_TOP_EVERY is scored (its pass costs a fifth of "
                                  "the ingest path)")
    new_class_samples: int = Field(description="samples of a class the model had not learned yet (not in the "
                                   "accuracies)")
    unknown: dict[str, int] = Field(description="samples the model called \"none of these\" before its step: of a "
                                    "known class (false alarms: known_class_samples) and of one it had not learned "
                                    "(finds: new_class_samples)")
    per_class: dict[str, ClassAccuracy]


class Calibrated(BaseModel):
    temperature: float = Field(description="the served logits are divided by it (fitted on the held-back samples)")
    floor: float = Field(description="the share of probability spread evenly over the classes offered: 1 / (n + 2) "
                         "n samples after the newest class's first, so that no answer claims more certainty than "
                         "they can give")
    held_back: int = Field(description="samples held back from training it was fitted on (none: the prior's)")
    stream_temperature: float | None = Field(None, description="where the answer reads a trained top: streaming "
                                             "LDA's own temperature, whose calibrated answer a photo answered by a "
                                             "class the top has not learned yet gets (null: no such class)")
    false_alarm: float = Field(description="the share of known classes' photos \"none of these\" is set to flag "
                               "(ASER_UNKNOWN_FALSE_ALARM)")
    unknown_threshold: float | None = Field(description="an image whose unknown_score passes it is unknown (null: "
                                            "too few held back to say, nothing is called unknown)")
    threshold_samples: int = Field(0, description="known classes' samples scored out of sample that the threshold "
                                   "and the score's scale rest on: the held-back ones and the latest trained ones of "
                                   "each class (0: no threshold yet)")


class Lag(BaseModel):
    seconds: float = Field(description="age of the oldest acknowledged sample the published model has not learned")
    samples: int = Field(description="acknowledged samples it has not learned (the backlog)")
    max_lag_s: float = Field(description="the bound (ASER_MAX_LAG_S; 0: none): beyond it samples are skipped")
    samples_skipped: int = Field(description="samples in the lineage skipped: no gradient step")
    samples_thinned: int = Field(description="of them, those that did not reach the memory update either "
                                 "(ASER_CATCH_UP_MEMORY_SHARE)")
    rehearsal_steps: int = Field(description="replay-only steps taken while the stream was idle")
    lean_when_behind: bool = Field(description="whether the worker steps in the method's cheapest form while behind "
                                   "(ASER_LEAN_WHEN_BEHIND, or the method's default)")
    lean_steps: int = Field(description="stream steps taken in the method's cheapest form, the worker being behind "
                            "(ASER_LEAN_WHEN_BEHIND)")


class Health(BaseModel):
    status: str = Field(description="ok (/healthz); ready, or not ready (/readyz)")
    detail: str | None = Field(None, description="why not ready: the worker's error")


class Storage(BaseModel):
    database_bytes: int = Field(description="the SQLite database on disk, its write-ahead log included")
    disk_free_bytes: int = Field(description="free space on the data directory's file system")
    retention_pixels_dropped: int = Field(description="trained samples whose pixels retention dropped (this run)")
    retention_ids_dropped: int = Field(description="rows deleted past the exactly-once horizon (this run)")
    retention_freed_bytes: int = Field(description="bytes given back to the file system (this run)")
    retention_last_run: float | None
    retention_last_error: str | None
    over_cap: bool = Field(description="the database stays above ASER_RETAIN_MAX_MB after retention's last run: "
                           "nothing trained was left to drop (the cap is soft: ingest goes on)")
    pixel_store: PixelStoreStatus | None = Field(None, description="with ASER_SLEEP and ASER_PIXEL_STORE_MB: the "
                                                 "photos kept for the night, whatever retention drops")


class PixelStoreStatus(BaseModel):
    samples: int = Field(description="photos the night's pixel store holds (JPEG at the input size)")
    bytes: int = Field(description="their JPEG bytes")
    capacity_bytes: int = Field(description="ASER_PIXEL_STORE_MB; when full, a new photo evicts a random one of the "
                                "largest class")
    classes: dict[str, int] = Field(description="photos held per class")
    write_failures: int = Field(description="steps whose photos a full disk refused")


class SleepStore(BaseModel):
    samples: int = Field(description="samples whose latents the store holds (8 bits, a scale a channel)")
    capacity: int = Field(description="the most it holds (ASER_SLEEP_STORE_MB); then a new sample evicts a random "
                          "one of the largest class")
    disk_bytes: int
    write_failures: int = Field(description="steps whose latents a full disk refused (the step itself went on)")
    per_class: dict[str, int]


class SleepSchedule(BaseModel):
    idle_s: float = Field(description="a sleep after this long without a sample to train (ASER_SLEEP_IDLE_S) ...")
    min_new: int = Field(description="... once this many are new since the last began (ASER_SLEEP_MIN_NEW)")
    night_idle_s: float | None = Field(description="a night's sleep, fresh, after this long idle "
                                       "(ASER_SLEEP_FRESH_IDLE_S) ...; null: fresh only on request")
    night_min_new: int = Field(0, description="... once this many have arrived since the last fresh one began "
                               "(ASER_SLEEP_MIN_NEW, and ASER_SLEEP_FRESH_GROWTH times those before it)")


class SleepStatus(BaseModel):
    state: Literal["awake", "sleeping"]
    progress: dict[str, int | bool] | None = Field(description="the sleep in progress: sample-updates taken, its "
                                                   "budget, and whether it is fresh")
    schedule: SleepSchedule
    new_samples: int = Field(description="samples trained on, or relabelled, since the last sleep began (an idle "
                             "sleep waits for ASER_SLEEP_MIN_NEW)")
    owed: int = Field(description="sample-updates a sleep that yielded to arriving samples left for the next")
    fresh_asked: bool = Field(False, description="the next sleep trains the top again from ImageNet's weights over "
                              "everything held (POST /sleep?fresh=true, or a fresh sleep that yielded)")
    new_since_fresh: int = Field(0, description="samples arrived since the last fresh sleep began (a night's "
                                 "sleep waits for schedule.night_min_new)")
    sleeps: int = Field(description="sleeps in the lineage")
    sample_updates: int
    cpu_seconds: float
    top_classes: list[str] = Field(description="classes the sleeps have taught the top (the others are answered by "
                                   "streaming LDA)")
    last: dict | None = Field(description="the last sleep: budget, updates, steps, cpu_seconds, held_before and "
                              "held_after (the served answer's accuracy on the held-back samples), kept (false: "
                              "worse on them, rolled back), yielded, fresh, classes")
    store: SleepStore


class Status(BaseModel):
    samples_received: int = Field(description="samples acknowledged since the log began")
    samples_trained: int = Field(description="samples in the model's lineage")
    trained_upto: int = Field(description="the last sequence number the model has seen")
    backlog: int = Field(description="acknowledged samples waiting to be trained on")
    classes: list[str]
    online: OnlineFigures
    buffer: dict[str, int] = Field(description="replay memory: samples per class")
    buffer_size: int
    model_version: int
    steps: int
    serving_current: bool = Field(description="the served model carries the corrections of the learner's latest "
                                  "step, and its choice of heads was measured on those weights (false for a moment "
                                  "after training, until the idle worker refits and measures them)")
    serving_head: str = Field(description="the head answering now: slda (streaming LDA on the frozen features), "
                              "softmax (the trained head), ncm, or chosen (ASER_HEAD=chosen: each class by its head "
                              "in head_choice); with ASER_TRAINED_HEAD_FROM it changes as classes grow")
    head_choice: dict | None = Field(None, description="with ASER_HEAD=chosen: each candidate head's share of right "
                                     "answers over the classes' recent samples, scored before each step "
                                     "(window_accuracy: slda, top, mix, pool and the served answer), and per class the "
                                     "head answering it and each candidate's share (null below its minimum count); "
                                     "measured on held-back samples (measure: held-back), their accuracies "
                                     "(held_back) and the prior, where one is set; pool: the pooled candidate's "
                                     "weight on the top, its temperature and the classes the weight applies to "
                                     "(those measured when it was fitted; the others' term is streaming LDA's)")
    last_step_ms: float
    method: str
    config: dict[str, bool | int | float | str]
    worker: WorkerHealth
    error: str | None = Field(description="why the worker thread ended, if it did")
    damaged_files: list[DamagedFile] = Field(description="derived files found damaged when this run opened them, set "
                                             "aside and rebuilt")
    device: str
    lag: Lag
    storage: Storage
    sleep: SleepStatus | None = Field(None, description="with ASER_SLEEP: the top's training while the device is idle")
    calibration: Calibrated | None = Field(None, description="with ASER_CALIBRATE: what divides the served logits and "
                                           "calls an image \"none of these\" (learner.heads.calibration)")
    uptime_s: float


class SleepRequested(BaseModel):
    requested: bool
    fresh: bool = Field(description="the top trained again from ImageNet's weights, not from where it is")
    budget: int = Field(description="sample-updates the sleep will take at most, as things stand")
    new_samples: int


def labelled_choice(summary: dict, classes: list[str | None]) -> dict:
    """`HeadChoice.summary` by class label (a forgotten class left out)."""
    def known(c: int) -> bool:
        return c < len(classes) and classes[c] is not None
    pool = summary["pool"]
    if "classes" in pool:
        pool = {**pool, "classes": [classes[c] for c in pool["classes"] if known(c)]}
    return {"measure": summary["measure"], "window_accuracy": summary["window_accuracy"],
            **{k: summary[k] for k in ("prior", "held_back") if k in summary}, "pool": pool,
            "classes": {classes[c]: v for c, v in summary["classes"].items() if known(c)}}


def status(rt: Runtime) -> dict:
    worker, store = rt.worker, rt.store
    published = worker.published  # read once: the model and the memory of one step
    p, memory = published.predictor, published.memory
    classes = store.classes()
    n_quarantined, recent = store.quarantined()
    backlog = store.pending(p.trained_upto)
    return {
        "samples_received": store.received(),
        "samples_trained": p.samples_trained,
        "trained_upto": p.trained_upto,
        "backlog": backlog,
        "classes": [c for c in classes if c is not None],
        "online": worker.online.summary(classes),
        "buffer": by_label(classes, memory.class_counts()),
        "buffer_size": len(memory.class_ids),
        "model_version": p.version,
        "steps": p.steps,
        "serving_current": published.current,
        "serving_head": p.head_name,
        "head_choice": None if p.choice_summary is None else labelled_choice(p.choice_summary, classes),
        "last_step_ms": round(1000 * worker.last_step_seconds, 2),
        "method": worker.lineage.method,
        "config": {**worker.spec.config(), "batch_size": rt.settings.batch_size},
        "worker": {"alive": worker.alive, "restarts": worker.restarts, "last_error": worker.last_error,
                   "checkpoint_failures": worker.checkpointing.failures,
                   "snapshot_failures": worker.snapshots.failures, "quarantined": n_quarantined,
                   "recent_quarantine": recent},
        "error": None if worker.error is None else repr(worker.error),
        "damaged_files": worker.damage.report(),
        "device": worker.device,
        "lag": {"seconds": round(worker.lag_seconds(), 3), "samples": backlog,
                "max_lag_s": rt.settings.max_lag_s, "samples_skipped": p.samples_skipped,
                "samples_thinned": p.samples_thinned, "rehearsal_steps": p.rehearsal_steps,
                "lean_when_behind": worker.lag.lean_when_behind, "lean_steps": p.lean_steps},
        "storage": storage(rt),
        "sleep": sleep_status(worker, classes),
        "calibration": p.calibration.summary() if p.calibration is not None else None,
        "uptime_s": round(time.time() - rt.started, 1),
    }


def sleep_status(worker, classes: list[str | None]) -> dict | None:
    sleeper, store, loop = worker.learner.sleeper, worker.latent_store, worker.loop
    if sleeper is None or store is None:
        return None
    current = sleeper.current
    labels = {c: classes[c] for c in range(len(classes)) if classes[c] is not None}
    last = sleeper.last
    return {"state": "awake" if current is None else "sleeping",
            "progress": None if current is None else {"updates": current.updates, "budget": current.budget,
                                                      "fresh": current.fresh},
            "schedule": {"idle_s": loop.sleep_idle_s, "min_new": loop.sleep_min_new,
                         "night_idle_s": loop.night_idle_s,
                         "night_min_new": sleeper.night_needs(loop.sleep_min_new, loop.sleep_fresh_growth)},
            "new_samples": sleeper.new_samples, "owed": sleeper.owed, "fresh_asked": sleeper.fresh_asked,
            "new_since_fresh": sleeper.new_since_fresh, "sleeps": sleeper.sleeps,
            "sample_updates": sleeper.updates, "cpu_seconds": round(sleeper.cpu_seconds, 2),
            "top_classes": [labels[c] for c in sorted(sleeper.top_classes) if c in labels],
            "last": None if last is None else {**last, "classes": [labels[c] for c in last["classes"] if c in labels]},
            "store": {"samples": len(store), "capacity": store.capacity, "disk_bytes": store.disk_bytes,
                      "write_failures": store.write_failures,
                      "per_class": {labels[c]: n for c, n in store.class_counts().items() if c in labels}}}


def storage(rt: Runtime) -> dict:
    t, pixels = rt.retention.totals, rt.worker.pixels
    return {"database_bytes": database_bytes(rt.db), "disk_free_bytes": shutil.disk_usage(rt.settings.data_dir).free,
            "retention_pixels_dropped": t.pixels_dropped, "retention_ids_dropped": t.ids_dropped,
            "retention_freed_bytes": t.freed_bytes, "retention_last_run": t.last_run,
            "retention_last_error": t.last_error, "over_cap": t.over_cap,
            "pixel_store": None if pixels is None else pixel_store_status(pixels.summary(), rt.store.classes())}


def pixel_store_status(summary: dict, classes: list[str | None]) -> dict:
    return {**summary, "classes": by_label(classes, summary["classes"])}


def router(access: Access) -> APIRouter:
    api = APIRouter(tags=["operations"])

    @api.get("/status", response_model=Status, dependencies=[access.require("read")],
             responses=error_responses(401, 403))
    async def get_status(request: Request):
        """Counters, the replay memory per class, the classes, the model version, worker health."""
        return await run_in_threadpool(status, request.app.state.runtime)

    @api.get("/metrics", dependencies=[access.require("read")], response_class=Response,
             responses={200: {"description": "Prometheus text format",
                              "content": {"text/plain": {"schema": {"type": "string"}}}},
                        **error_responses(401, 403)})
    async def prometheus_metrics(request: Request):
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        rt: Runtime = request.app.state.runtime
        st = await run_in_threadpool(status, rt)
        rt.metrics.observe_status(st)
        return Response(generate_latest(rt.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @api.post("/sleep", status_code=202, response_model=SleepRequested, dependencies=[access.require("admin")],
              responses=error_responses(401, 403, 409, 422))
    async def sleep(request: Request, fresh: Annotated[bool, Query()] = False):
        """Sleep now (ASER_SLEEP): as soon as no sample waits, the top trains over the latent store for its budget
        (ASER_SLEEP_EPOCHS times the samples new since the last sleep, and what a yielded one owes), yielding to
        samples that arrive. `fresh=true`: the top starts again from ImageNet's weights and trains for
        ASER_SLEEP_FRESH_EPOCHS (unset: ASER_SLEEP_EPOCHS) passes over everything the store holds (offline training
        on the device, at its CPU; a fresh sleep that yields is undone and runs again at the next idle sleep).
        /status's `sleep` follows it."""
        worker = request.app.state.runtime.worker
        if worker.learner.sleeper is None:
            raise SleepOff("this service does not sleep: start it with ASER_SLEEP=true")
        worker.request_sleep(fresh)
        sleeper = worker.learner.sleeper
        return {"requested": True, "fresh": fresh or sleeper.fresh_asked, "budget": sleeper.budget(fresh),
                "new_samples": sleeper.new_samples}

    @api.get("/history", response_model=list[HistoryPoint], dependencies=[access.require("read")],
             responses=error_responses(401, 403, 422))
    async def history(request: Request, since: Annotated[int, Query(ge=0, le=2**63 - 1)] = 0,
                      limit: Annotated[int, Query(ge=1, le=10_000)] = 1000):
        """The time series of training, a point every few steps, oldest first: the points after
        `since` samples trained, at most `limit` of them (ask again with the last one's
        `samples_trained` for more)."""
        points = await run_in_threadpool(request.app.state.runtime.worker.history.since, since, limit)
        return points

    @api.get("/healthz", response_model=Health)
    async def healthz():
        """Liveness: the process answers."""
        return {"status": "ok"}

    @api.get("/readyz", response_model=Health,
             responses={503: {"model": Health, "description": "the learner worker has stopped"}})
    async def readyz(request: Request):
        """Readiness: the learner worker runs."""
        worker = request.app.state.runtime.worker
        if not worker.alive:
            return JSONResponse({"status": "not ready", "detail": repr(worker.error)}, status_code=503)
        return {"status": "ready"}

    return api
