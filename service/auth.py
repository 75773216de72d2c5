"""Bearer-token auth with separate write, read and admin tokens. With no token configured the
service is open, which __main__ allows on loopback addresses only."""

from __future__ import annotations

import hmac

from fastapi import Request

from .inputs import InputError


def require(role: str):
    def check(request: Request) -> None:
        settings = request.app.state.settings
        allowed = [t for t in ({"write": settings.write_token, "read": settings.read_token}.get(role),
                               settings.admin_token) if t is not None]
        if not settings.auth_enabled:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise InputError("unauthorized", "send 'Authorization: Bearer <token>'", 401)
        if not any(hmac.compare_digest(token.encode(), t.get_secret_value().encode()) for t in allowed):
            raise InputError("forbidden", f"this token may not {role}", 403)

    return check
