"""The HTTP face of one learner: the routers (ingest, predict, snapshots, memory, operations,
dashboard) over one `Runtime` (database, ingest log, learner worker), opened at start-up and
closed at shutdown."""

from __future__ import annotations

from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi_offline import FastAPIOffline

from service import __version__
from service.learning.lineage import check_learner
from service.learning.runtime import Runtime
from service.metrics import Metrics
from service.settings import Settings
from service.web.guard import WebPageGuard, allowed_hosts
from service.web.routers import dashboard, ingest, memory, operations, predict, samples, snapshots
from service.web.routers.auth import Access
from service.web.routers.bodies import BodyModels
from service.web.routers.errors import BodyLimit, install_error_handlers


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()
    check_learner(settings)
    metrics = Metrics()
    models, access = BodyModels(settings), Access(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.runtime = Runtime.open(settings, metrics)
        yield
        app.state.runtime.close()

    # /docs and /redoc load Swagger UI and ReDoc from the package, not a CDN: they work offline
    app = FastAPIOffline(title="ASER continual-learning service", version=__version__, lifespan=lifespan,
                  description="Learns new classes from a stream of labelled images without forgetting the old "
                              "ones (ASER, AAAI 2021); serves predictions and ONNX snapshots.")
    app.state.settings, app.state.metrics = settings, metrics
    # a stream's total size is unbounded; each of its messages is limited instead
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes, read_timeout_s=settings.body_timeout_s,
                       deadline_s=settings.body_deadline_s, exempt=frozenset({"/samples/stream"}))
    app.add_middleware(WebPageGuard, hosts=allowed_hosts(settings.allowed_hosts, settings.host))
    install_error_handlers(app, metrics)
    app.include_router(ingest.router(settings, access, models))
    app.include_router(predict.router(settings, access, models))
    app.include_router(snapshots.router(settings, access))
    app.include_router(memory.router(settings, access))
    app.include_router(samples.router(settings, access, models))
    app.include_router(operations.router(access))
    app.include_router(dashboard.router())
    app.mount("/dashboard/static", dashboard.static_files(), name="dashboard-static")
    use_body_schemas(app, models)
    return app


def use_body_schemas(app: FastAPI, models: BodyModels) -> None:
    """Add the request body models (routes that parse their bodies themselves reference them by
    name) to the generated OpenAPI document's components."""

    def openapi() -> dict:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            doc.setdefault("components", {}).setdefault("schemas", {}).update(models.components)
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi
