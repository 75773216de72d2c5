"""python -m service: run the learner service with uvicorn on its settings (ASER_* variables)."""

from __future__ import annotations

import ipaddress
import logging
import sys

import uvicorn

from .app import create_app
from .settings import Settings


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def refuse_public_without_token(settings: Settings) -> bool:
    """True (and says why) when asked to listen beyond loopback with no token configured."""
    if not is_loopback(settings.host) and not settings.auth_enabled:
        print(f"refusing to listen on {settings.host} without an API token: set ASER_WRITE_TOKEN, "
              "ASER_READ_TOKEN or ASER_ADMIN_TOKEN, or bind to 127.0.0.1", file=sys.stderr)
        return True
    return False


def main() -> int:
    settings = Settings()
    if refuse_public_without_token(settings):
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level="info")
    return 0


if __name__ == "__main__":
    sys.exit(main())
