"""Bearer-token auth with separate write, read and admin tokens. With no token configured the
service is open, which __main__ allows on loopback addresses only."""

from __future__ import annotations

import hmac

from fastapi import Request
from starlette.requests import HTTPConnection

from .inputs import InputError


def check_token(conn: HTTPConnection, role: str) -> None:
    """Raise InputError (401/403) unless the connection's bearer token may act as `role`."""
    settings = conn.app.state.settings
    if not settings.auth_enabled:
        return
    allowed = [t for t in ({"write": settings.write_token, "read": settings.read_token}.get(role),
                           settings.admin_token) if t is not None]
    header = conn.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token:
        raise InputError("unauthorized", "send 'Authorization: Bearer <token>'", 401)
    if not any(hmac.compare_digest(token.encode(), t.get_secret_value().encode()) for t in allowed):
        raise InputError("forbidden", f"this token may not {role}", 403)


def require(role: str):
    """A route dependency: the request's token may act as `role` (write, read or admin)."""
    def check(request: Request) -> None:
        check_token(request, role)

    return check
