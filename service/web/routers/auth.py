"""Bearer tokens for three roles: write (ingest), read (predictions, status, snapshots, metrics)
and admin (snapshots on request; admin may also do everything else).

With no token configured the service is open (and `python -m service` then refuses to bind to
anything but loopback). Once any token is set, every data endpoint needs one:
- a write needs the write token (or admin's);
- a read needs the read token (or admin's); when no read token is set, the write token reads too,
  so that a service configured with only a write token is not left unreadable;
- an admin call needs the admin token; without one configured, admin calls are refused.
`/healthz`, `/readyz`, `/openapi.json` and `/docs` never need a token: they describe the
service, not its data, and orchestrators and API tools must reach them.
"""

from __future__ import annotations

import hmac

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.requests import HTTPConnection

from service.settings import Settings
from service.web.inputs import InputError

ROLES = ("read", "write", "admin")


def accepted_tokens(settings: Settings, role: str) -> list[str]:
    """The tokens that may act as `role` under these settings."""
    own = {"write": [settings.write_token], "admin": [],
           "read": [settings.read_token if settings.read_token is not None else settings.write_token]}[role]
    return [t.get_secret_value() for t in (*own, settings.admin_token) if t is not None]


class Access:
    """Who may act as each role, read from the settings once at start-up and handed to the routers."""

    def __init__(self, settings: Settings):
        self.enabled = settings.auth_enabled
        self.tokens = {role: accepted_tokens(settings, role) for role in ROLES}

    def check(self, conn: HTTPConnection, role: str) -> None:
        """Raise InputError (401/403) unless the connection's bearer token may act as `role`."""
        if not self.enabled:
            return
        scheme, _, token = conn.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise InputError("unauthorized", "send 'Authorization: Bearer <token>'", 401)
        if not any(hmac.compare_digest(token.encode(), t.encode()) for t in self.tokens[role]):
            raise InputError("forbidden", f"this token may not {role}", 403)

    def require(self, role: str):
        """A route dependency: the request's token may act as `role`. Declares the bearer scheme in
        the OpenAPI document when tokens are configured, and nothing when the service is open."""
        if not self.enabled:
            return Depends(lambda: None)
        bearer = HTTPBearer(auto_error=False, description=f"a token that may {role}")

        def check(request: Request, _: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
            self.check(request, role)

        return Depends(check)
