"""Web pages a device's browser opens must not reach the service: two checks before any route.

- Host allow-list (`ASER_ALLOWED_HOSTS`): a page on attacker.example that rebinds its name to
  127.0.0.1 sends `Host: attacker.example`; a service that answers only its own names gives it
  nothing (400 `invalid_host`). Unset, the names allowed are the loopback ones when the service
  listens on loopback (where it may run without tokens) and any name otherwise (tokens are
  required there, and a proxy's name is not known in advance). `/healthz` and `/readyz` answer
  any name: they hold no data, and orchestrators probe by address.
- Origin check: a browser marks a cross-site form POST or WebSocket with its page's `Origin`; an
  unsafe request (POST, PUT, PATCH, DELETE, or a WebSocket) from another origin without a bearer
  token is refused (403 `cross_origin`). Pages cannot attach a bearer token across origins without
  a CORS preflight, which this service never grants; devices and scripts send no `Origin`.
- Fetch Metadata (OWASP's resource isolation policy): a browser that strips `Origin` (an extension, a
  privacy setting) still says where a request comes from in `Sec-Fetch-Site`; an unsafe request
  marked `cross-site`, or `same-site` (another origin of the same site), without a bearer token is
  refused too (403 `cross_site`). `same-origin` and `none` (typed by the user) pass; so does a
  client that sends no such header.

>>> host_name("127.0.0.1:8000"), host_name("[::1]:80"), host_name("Example.org")
('127.0.0.1', '::1', 'example.org')
"""

from __future__ import annotations

import ipaddress
import json
from urllib.parse import urlsplit

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
SAFE_METHODS = {"GET", "HEAD", "OPTIONS"}
FOREIGN_SITES = {"cross-site", "same-site"}  # Sec-Fetch-Site values of a request from another origin
PROBES = {"/healthz", "/readyz"}


def host_name(value: str) -> str:
    """The name of a Host header or an origin's netloc, without its port, lower case."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1:value.find("]")] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def allowed_hosts(configured: list[str] | None, bind_host: str) -> frozenset[str] | None:
    """The host names to answer; None: any.

    >>> sorted(allowed_hosts(None, "127.0.0.1")), allowed_hosts(None, "0.0.0.0"), allowed_hosts(["*"], "127.0.0.1")
    (['127.0.0.1', '::1', 'localhost'], None, None)
    """
    if configured:
        return None if "*" in configured else frozenset(host_name(h) for h in configured)
    return frozenset({*LOOPBACK_NAMES, host_name(bind_host)}) if is_loopback(bind_host) else None


class WebPageGuard:
    """Pure ASGI middleware: the Host and Origin checks above, for HTTP and WebSocket alike."""

    def __init__(self, app, hosts: frozenset[str] | None):
        self.app, self.hosts = app, hosts

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        host = host_name(headers.get("host", ""))
        if self.hosts is not None and host not in self.hosts and scope["path"] not in PROBES:
            return await self._refuse(scope, send, 400, "invalid_host",
                                      f"this service does not answer to the host name {host!r} (ASER_ALLOWED_HOSTS)")
        origin = headers.get("origin")
        unsafe = scope["type"] == "websocket" or scope.get("method", "GET") not in SAFE_METHODS
        if unsafe and "authorization" not in headers:
            if origin and not _same_origin(origin, headers.get("host", "")):
                return await self._refuse(scope, send, 403, "cross_origin",
                                          f"a request from the web page at {origin} needs a bearer token")
            site = headers.get("sec-fetch-site", "").strip().lower()
            if site in FOREIGN_SITES:
                return await self._refuse(scope, send, 403, "cross_site",
                                          f"a request from a {site} web page needs a bearer token")
        return await self.app(scope, receive, send)

    @staticmethod
    async def _refuse(scope, send, status: int, code: str, detail: str) -> None:
        if scope["type"] == "websocket":  # closed before the handshake: the client sees HTTP 403
            await send({"type": "websocket.close", "code": 1008, "reason": code})
            return
        body = json.dumps({"error": code, "detail": detail}).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


def _same_origin(origin: str, host_header: str) -> bool:
    return origin != "null" and urlsplit(origin).netloc.lower() == host_header.strip().lower()
