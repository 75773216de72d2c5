"""Every error the HTTP API answers: one JSON body, `{"error": code, "detail": ...}`, with the
status code that fits. Domain errors (storage, worker) and input errors are mapped here and
only here; the routes declare which of these statuses each can return, so the OpenAPI
document lists them with this body."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.routing import Match

from service.metrics import Metrics
from service.storage import errors
from service.web.inputs import InputError

log = logging.getLogger("aser.http")

DOMAIN_STATUS = {
    errors.TooManyClasses: 409,
    errors.SampleIdConflict: 409,
    errors.NotFound: 404,
    errors.NoClassesYet: 409,
    errors.SleepOff: 409,
    errors.SnapshotFailed: 503,
    errors.Unavailable: 503,
    errors.StorageFull: 507,
    errors.NoSnapshotYet: 503,
}

STATUS_TEXT = {
    400: "Malformed request (empty body, invalid JSON)",
    401: "Missing bearer token",
    403: "This token may not do this",
    404: "No such resource",
    408: "The body stalled: send it again",
    409: "Conflicts with the service's state",
    413: "Body, image or sample count over the limit",
    415: "Unsupported media type or image format",
    422: "Invalid request (fields, labels, ids, images)",
    503: "Not available now; retry later",
    507: "The disk is full: nothing was stored; retry after Retry-After seconds",
}
RETRY_AFTER_S = {503: 5, 507: 30}  # statuses a client should retry, and after how long


class ErrorBody(BaseModel):
    error: str = Field(description="a stable machine-readable code, e.g. corrupt_image, id_conflict")
    detail: Any = Field(description="what was wrong: a sentence, or a list of field errors")


def error_responses(*codes: int) -> dict:
    """The `responses=` of a route that may answer these error statuses."""
    return {code: {"model": ErrorBody, "description": STATUS_TEXT[code]} for code in codes}


def error_json(code: str, detail, status: int, headers: dict | None = None) -> JSONResponse:
    if status in RETRY_AFTER_S:
        headers = {"Retry-After": str(RETRY_AFTER_S[status]), **(headers or {})}
    return JSONResponse({"error": code, "detail": detail}, status_code=status, headers=headers)


def as_input_error(exc: Exception) -> InputError:
    """A domain or input error as the InputError (code, detail, status) the API answers."""
    if isinstance(exc, InputError):
        return exc
    for kind, status in DOMAIN_STATUS.items():
        if isinstance(exc, kind):
            return InputError(exc.code, exc.detail, status)
    raise TypeError(f"not an API error: {exc!r}")


def install_error_handlers(app: FastAPI, metrics: Metrics) -> None:
    async def api_error(request: Request, exc: Exception):
        err = as_input_error(exc)
        metrics.requests_rejected.labels(err.code).inc()
        return error_json(err.code, err.detail, err.status)

    app.add_exception_handler(InputError, api_error)
    app.add_exception_handler(errors.ServiceError, api_error)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        metrics.requests_rejected.labels("invalid_request").inc()
        detail = [{"loc": [str(p) for p in e.get("loc", ())], "type": str(e.get("type")), "msg": str(e.get("msg"))}
                  for e in exc.errors()]
        return error_json("invalid_request", detail, 422)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        headers = dict(getattr(exc, "headers", None) or {})
        if exc.status_code == 405:  # Starlette names only the first matching route's methods
            headers["Allow"] = ", ".join(sorted(allowed_methods(request)))
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return error_json(code, exc.detail, exc.status_code, headers)

    @app.exception_handler(ClientDisconnect)
    async def client_went_away(request: Request, exc: ClientDisconnect):
        # not a server error: nothing was stored, and nobody is left to read an answer
        log.info("client disconnected before sending the whole body of %s %s", request.method, request.url.path)
        return error_json("client_disconnected", "the client closed the connection mid-body", 400)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception):
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        return error_json("internal_error", f"{type(exc).__name__}: the service failed on this request", 500)


def allowed_methods(request: Request) -> set[str]:
    """The methods of every route whose path matches the request's."""
    return {m for route in _leaf_routes(request.app.router.routes) if route.matches(request.scope)[0] != Match.NONE
            for m in route.methods}


def _leaf_routes(routes):
    """Routes with methods, looking into included routers (FastAPI >= 0.165 nests them)."""
    for route in routes:
        inner = getattr(route, "original_router", None)
        if inner is not None:
            yield from _leaf_routes(inner.routes)
        elif getattr(route, "methods", None):
            yield route


class BodyLimit:
    """Refuses bodies over max_bytes with 413, by Content-Length or while streaming, and with 408 a
    body that stalls for `read_timeout_s` between two of its chunks or is not whole `deadline_s`
    after it began (a client trickling a byte every few seconds must not hold a connection for
    ever). Paths in `exempt` (the NDJSON stream: unbounded, and idle between a device's samples)
    are checked per message by their route instead."""

    def __init__(self, app, max_bytes: int, read_timeout_s: float, deadline_s: float = float("inf"),
                 exempt: frozenset[str] = frozenset()):
        self.app, self.max_bytes, self.read_timeout_s, self.exempt = app, max_bytes, read_timeout_s, exempt
        self.deadline_s = deadline_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in self.exempt:
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            body = error_json("body_too_large", f"the body ({length.decode(errors='replace')} bytes) exceeds "
                              f"{self.max_bytes} bytes", 413)
            return await body(scope, receive, send)
        seen, complete, cut = 0, False, False
        deadline = asyncio.get_running_loop().time() + self.deadline_s

        async def limited():
            nonlocal seen, complete, cut
            if complete:  # after the body only a disconnect can come, whenever it comes
                return await receive()
            left = deadline - asyncio.get_running_loop().time()
            try:
                message = await asyncio.wait_for(receive(), max(0.0, min(self.read_timeout_s, left)))
            except TimeoutError:
                cut = True
                if left <= self.read_timeout_s:
                    raise InputError("request_timeout", f"the body was not whole after {self.deadline_s:g} s",
                                     408) from None
                raise InputError("request_timeout", f"the body stalled for {self.read_timeout_s:g} s", 408) from None
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                complete = not message.get("more_body", False)
                if seen > self.max_bytes:
                    cut = True
                    raise InputError("body_too_large", f"the body exceeds {self.max_bytes} bytes", 413)
            return message

        async def closing(message):
            # A body cut off mid-way leaves unread bytes on the connection: close it (RFC 9110 15.5.9),
            # else a byte the client sent as the answer left would keep it open for ever.
            if cut and message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close")]}
            await send(message)

        return await self.app(scope, limited, closing)
