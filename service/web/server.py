"""What uvicorn needs besides the app, for months on a device (`python -m service`, the replica too):

- a header timeout: uvicorn's h11 protocol, with a connection whose request headers are not
  complete `header_timeout_s` after it opened (or after its first byte past the previous answer)
  closed. uvicorn bounds the idle time between requests (keep-alive) but not a client that sends
  half a header and stalls; on a small device a few hundred such sockets are an outage;
- an access log without the scrapes and probes;
- a C heap that gives memory back: glibc's allocator keeps a heap per thread (up to 8 a core) and, once a
  large block is freed, raises its threshold for serving large blocks from them, so the frozen part's and
  the streaming head's buffers stay resident as fragments (the learner's peak went from 690 to 790 MB over
  600 camera photos, docs/results/speed-and-memory.md). Two heaps, and large blocks always mapped apart.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

M_ARENA_MAX = -8  # glibc's mallopt parameter (malloc.h)
ARENAS = 2


def bound_the_heap() -> bool:
    """Two malloc arenas, not one a thread (before any thread starts): what a long-running service on
    a small device wants from glibc. No fixed mmap threshold: mapping every tensor of a step apart
    made a training step 1.45x its CPU (docs/operations.md, the C heap). Returns whether it applied."""
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_ARENA_MAX, ARENAS))


def with_header_timeout(header_timeout_s: float) -> type[H11Protocol]:
    """An H11Protocol class that enforces `header_timeout_s` (uvicorn takes the class as `http=`)."""

    class HeaderTimeoutProtocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self.conn.their_state is h11.IDLE:  # bytes of a new request's headers
                self._arm()
            super().data_received(data)

        def handle_events(self) -> None:
            super().handle_events()
            if self.conn.their_state is not h11.IDLE:  # the headers are in (or a WebSocket took over)
                self._disarm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            if self._header_timer is None:
                self._header_timer = self.loop.call_later(header_timeout_s, self._headers_timed_out)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_timed_out(self) -> None:
            self._header_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

    return HeaderTimeoutProtocol


QUIET_PATHS = ("/metrics", "/healthz", "/readyz")


def quiet_probes(record: logging.LogRecord) -> bool:
    """Drop the access-log lines of scrapes and probes (one every few seconds, for months).

    >>> quiet_probes(logging.makeLogRecord({"args": ("127.0.0.1:5", "GET", "/metrics", "1.1", 200)}))
    False
    >>> quiet_probes(logging.makeLogRecord({"args": ("127.0.0.1:5", "POST", "/samples", "1.1", 201)}))
    True
    """
    args = record.args if isinstance(record.args, tuple) else ()
    return not (len(args) >= 3 and str(args[2]).split("?")[0] in QUIET_PATHS)
