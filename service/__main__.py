"""python -m service: run the learner service with uvicorn on its settings (ASER_* variables)."""

from __future__ import annotations

import logging
import sys

import uvicorn

from .guard import is_loopback
from .server import quiet_probes, with_header_timeout
from .settings import Settings


def serve(make_app) -> int:
    """Run `make_app(settings)` with uvicorn; refuse a non-loopback bind without a token."""
    settings = Settings()
    if not is_loopback(settings.host) and not settings.auth_enabled:
        print(f"refusing to listen on {settings.host} without an API token: set ASER_WRITE_TOKEN, "
              "ASER_READ_TOKEN or ASER_ADMIN_TOKEN, or bind to 127.0.0.1", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("uvicorn.access").addFilter(quiet_probes)

    uvicorn.run(make_app(settings), host=settings.host, port=settings.port, log_level="info",
                http=with_header_timeout(settings.header_timeout_s), limit_concurrency=settings.max_connections,
                timeout_keep_alive=5)
    return 0


def main() -> int:
    from .app import create_app  # here, not above: the replica serves through this module without torch

    return serve(create_app)


if __name__ == "__main__":
    sys.exit(main())
