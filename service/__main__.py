"""python -m service: run the learner service with uvicorn on its settings (ASER_* variables).

`python -m service recover-log`: copy what can still be read of a damaged ingest log (ASER_DATA_DIR's aser.db) into a
new one, the damaged file set aside beside it (`service.storage.salvage`)."""

from __future__ import annotations

import logging
import socket
import sys
import textwrap

import uvicorn
from pydantic import ValidationError

from service.settings import Settings
from service.storage.errors import DamagedIngestLog
from service.storage.integrity import check_ingest_log
from service.web.guard import is_loopback
from service.web.server import bound_the_heap, quiet_probes, with_header_timeout


def usage(what: str) -> str:
    """`--help`: every setting, its default and what it does (environment variables or .env)."""
    lines = [f"usage: python -m {what}" + (" [recover-log]" if what == "service" else ""), "",
             "Settings come from ASER_* environment variables or a .env file:", ""]
    for name, field in Settings.model_fields.items():
        default = "(unset)" if field.default is None else repr(field.default)
        lines.append(f"  ASER_{name.upper():<28} default {default}")
        if field.description:
            lines += [f"      {line}" for line in textwrap.wrap(field.description, 90)]
    return "\n".join(lines)


def startup_settings(check=None) -> Settings:
    """The settings, checked before anything opens; a bad one is one line naming it and SystemExit(2)."""
    try:
        settings = Settings()
        if check is not None:
            check(settings)
    except ValidationError as exc:
        for error in exc.errors():
            name = "ASER_" + "_".join(str(p) for p in error["loc"][:1]).upper()
            print(f"error: {name}: {error['msg']} (got {error.get('input')!r})", file=sys.stderr)
        raise SystemExit(2) from None
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    except DamagedIngestLog as exc:  # the data, not the settings: exit 1
        print(f"error: {exc.detail}", file=sys.stderr)
        raise SystemExit(1) from None
    if not is_loopback(settings.host) and not settings.auth_enabled:
        print(f"error: refusing to listen on {settings.host} without an API token: set ASER_WRITE_TOKEN, "
              "ASER_READ_TOKEN or ASER_ADMIN_TOKEN, or bind to 127.0.0.1", file=sys.stderr)
        raise SystemExit(2)
    with socket.socket(socket.AF_INET6 if ":" in settings.host else socket.AF_INET) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            probe.bind((settings.host, settings.port))
        except OSError as exc:
            print(f"error: cannot listen on {settings.host}:{settings.port} (ASER_HOST, ASER_PORT): {exc.strerror}",
                  file=sys.stderr)
            raise SystemExit(2) from None
    return settings


def serve(make_app, what: str = "service", check=None) -> int:
    """Run `make_app(settings)` with uvicorn once the settings pass `startup_settings`."""
    if {"-h", "--help"} & set(sys.argv[1:]):
        print(usage(what))
        return 0
    bound_the_heap()
    settings = startup_settings(check)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("uvicorn.access").addFilter(quiet_probes)

    uvicorn.run(make_app(settings), host=settings.host, port=settings.port, log_level="info",
                http=with_header_timeout(settings.header_timeout_s), limit_concurrency=settings.max_connections,
                timeout_keep_alive=5)
    return 0


def main() -> int:
    if sys.argv[1:2] == ["recover-log"]:
        from service.storage.salvage import recover_ingest_log

        return recover_ingest_log(Settings().database_path)
    from service.learning.lineage import check_learner
    from service.web.app import create_app  # here, not above: the replica serves through this module without torch

    def check(settings: Settings) -> None:  # what a replica does not need
        check_learner(settings)
        check_ingest_log(settings.database_path)

    return serve(create_app, "service", check)


if __name__ == "__main__":
    sys.exit(main())
