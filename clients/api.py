"""Python client for the learner service (httpx).

Every sample it sends carries an id (a random UUID unless you give one), and it retries on its
own after a lost connection, a timeout or a 429/5xx answer, with growing pauses: the service
stores a sample id once, so a retry never stores a sample twice. The streams resend whatever
was not acknowledged.

>>> client = ServiceClient("http://127.0.0.1:8000")          # doctest: +SKIP
>>> client.add_samples(["cat", "dog"], [cat_png, dog_png])     # doctest: +SKIP
{'accepted': 2, 'stored': 2, 'duplicates': 0, 'first_seq': 1, 'last_seq': 2, 'seqs': [1, 2]}
>>> client.predict([cat_png], k=1)                             # doctest: +SKIP
{'model_version': 7, 'steps': 3, 'results': [[{'label': 'cat', 'probability': 0.91}]]}
"""

from __future__ import annotations

import base64
import itertools
import json
import time
import uuid
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from urllib.parse import quote

import httpx

RETRY_STATUSES = {429, 500, 502, 503, 504, 507}  # 507: the service's disk is full, for now


class ServiceError(RuntimeError):
    """The service answered with an error: `status`, `error` code and `detail`."""

    def __init__(self, status: int, error: str, detail):
        super().__init__(f"{status} {error}: {detail}")
        self.status, self.error, self.detail = status, error, detail


def new_id() -> str:
    return uuid.uuid4().hex


def encode_sample(label: str, image: bytes, sample_id: str | None = None) -> dict:
    sample = {"label": label, "image": base64.b64encode(image).decode()}
    if sample_id is not None:
        sample["id"] = sample_id
    return sample


def settled(status: dict) -> bool:
    """Whether a /status says the learner has trained on everything received and serves that
    step's corrections and choice of heads (a server without the field has neither)."""
    return not status["backlog"] and status.get("serving_current", True)


def retry_after(failure: Exception | httpx.Response, cap: float = 60.0) -> float:
    """The seconds an answer's Retry-After header asks for (0 without one), at most `cap`.

    >>> retry_after(httpx.Response(507, headers={"Retry-After": "30"}))
    30.0
    """
    if not isinstance(failure, httpx.Response):
        return 0.0
    try:
        return min(cap, float(failure.headers.get("retry-after", 0)))
    except ValueError:
        return 0.0


class Retry:
    """Pauses between attempts: `backoff` seconds, doubling, at most `attempts` tries."""

    def __init__(self, attempts: int = 6, backoff: float = 0.25, max_pause: float = 8.0):
        self.attempts, self.backoff, self.max_pause = attempts, backoff, max_pause

    def pauses(self) -> Iterator[float]:
        for i in range(self.attempts - 1):
            yield min(self.max_pause, self.backoff * 2 ** i)


class ServiceClient:
    def __init__(self, base_url: str, token: str | None = None, timeout: float = 30.0, retry: Retry | None = None):
        self.base_url, self.token = base_url.rstrip("/"), token
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.Client(base_url=self.base_url, headers=self.headers, timeout=timeout)
        self.retry = retry or Retry()

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> "ServiceClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _send(self, method: str, path: str, retry: bool = True, **kwargs) -> httpx.Response:
        """One request, retried after transport errors and 429/5xx answers when `retry`."""
        pauses = self.retry.pauses() if retry else iter(())
        while True:
            try:
                response = self.http.request(method, path, **kwargs)
                if response.status_code not in RETRY_STATUSES:
                    return response
                failure: Exception | httpx.Response = response
            except httpx.TransportError as exc:
                failure = exc
            pause = next(pauses, None)
            if pause is None:
                if isinstance(failure, httpx.Response):
                    return failure
                raise failure
            time.sleep(max(pause, retry_after(failure)))

    def _json(self, method: str, path: str, **kwargs) -> dict:
        return self._check(self._send(method, path, **kwargs))

    @staticmethod
    def _check(response: httpx.Response) -> dict:
        if response.status_code >= 400:
            try:
                body = response.json()
            except ValueError:
                body = {"error": "http_error", "detail": response.text}
            raise ServiceError(response.status_code, body.get("error", "http_error"), body.get("detail"))
        return response.json()

    # --- ingest ----------------------------------------------------------------------
    def add_samples(self, labels: Sequence[str], images: Sequence[bytes], ids: Sequence[str] | None = None) -> dict:
        """Send labelled encoded images (PNG/JPEG bytes); returns once they are durably logged.
        Retried until acknowledged; `ids` (default: new UUIDs) make the retries safe."""
        if len(labels) != len(images) or (ids is not None and len(ids) != len(images)):
            raise ValueError(f"{len(labels)} labels and {len(ids or images)} ids for {len(images)} images")
        ids = list(ids) if ids is not None else [new_id() for _ in images]
        samples = [encode_sample(label, img, i) for label, img, i in zip(labels, images, ids)]
        return self._json("POST", "/samples", json={"samples": samples})

    def add_files(self, label: str | Sequence[str], images: Sequence[bytes], content_type: str = "image/png",
                  ids: Sequence[str] | None = None) -> dict:
        """The same as multipart: one label for all images, or one label per image."""
        files = [("image", (f"{i}", img, content_type)) for i, img in enumerate(images)]
        labels = [label] if isinstance(label, str) else list(label)
        ids = list(ids) if ids is not None else [new_id() for _ in images]
        return self._json("POST", "/samples", files=files, data={"label": labels, "id": ids})

    def stream_samples(self, samples: Iterable[tuple], chunk: int = 500) -> list[dict]:
        """NDJSON: one line per (label, image) or (label, image, id), sent in chunked POSTs of
        `chunk` lines; returns one ack per sample, in order (an ack with 'error' refused that
        sample alone). Lines left unacknowledged by a cut connection are sent again."""
        acks: list[dict] = []
        it = iter(samples)
        while batch := list(itertools.islice(it, chunk)):
            lines = [json.dumps(encode_sample(s[0], s[1], s[2] if len(s) > 2 else new_id())) + "\n" for s in batch]
            acks.extend(self._stream_chunk(lines, first=len(acks) + 1))
        return acks

    def _stream_chunk(self, lines: list[str], first: int) -> list[dict]:
        acks: list[dict] = []
        pauses = self.retry.pauses()
        while len(acks) < len(lines):
            before = len(acks)
            try:
                with self.http.stream("POST", "/samples/stream", content="".join(lines[before:]).encode(),
                                      headers={"content-type": "application/x-ndjson"}) as response:
                    if 400 <= response.status_code and response.status_code not in RETRY_STATUSES:
                        response.read()
                        self._check(response)
                    if response.status_code < 400:
                        for line in filter(str.strip, response.iter_lines()):
                            ack = json.loads(line)
                            if ack.get("status") in RETRY_STATUSES:
                                break  # not stored: resend from this line on
                            acks.append({**ack, "message": first + len(acks)})
            except httpx.TransportError:
                pass
            if len(acks) > before:
                pauses = self.retry.pauses()
                continue
            pause = next(pauses, None)
            if pause is None:
                raise ServiceError(503, "stream_failed", f"{len(lines) - len(acks)} lines left unacknowledged")
            time.sleep(pause)
        return acks

    def websocket(self) -> "SampleSocket":
        """A long-lived WebSocket for ingest: `send(labels, images)` returns each message's ack;
        `pipeline` keeps several messages in flight and resends them after a reconnect."""
        return SampleSocket(self.base_url, self.headers, self.retry)

    # --- snapshots, predictions, status ------------------------------------------------
    def create_snapshot(self) -> dict:
        """Export the current model to ONNX now (admin); returns the snapshot record."""
        return self._check(self._send("POST", "/snapshots", retry=False, timeout=180))

    def snapshots(self) -> list[dict]:
        return self._json("GET", "/snapshots")["snapshots"]

    def download_snapshot(self, snapshot: int | str = "latest") -> bytes:
        """The .onnx bytes of a snapshot id, or of the latest one."""
        response = self._send("GET", f"/snapshots/{snapshot}")
        if response.status_code >= 400:
            self._check(response)
        return response.content

    def predict(self, images: Sequence[bytes], k: int = 3) -> dict:
        payload = {"images": [base64.b64encode(img).decode() for img in images], "k": k}
        return self._json("POST", "/predict", json=payload)

    def predict_one(self, image: bytes, k: int = 3) -> dict:
        """GET /predict with the image as a base64url query parameter (small images)."""
        encoded = base64.urlsafe_b64encode(image).decode().rstrip("=")
        return self._json("GET", "/predict", params={"image": encoded, "k": k})

    def status(self) -> dict:
        return self._json("GET", "/status")

    def forget_class(self, label: str) -> dict:
        """Forget a class for good (admin): its samples, memory, predictions and snapshots."""
        return self._json("DELETE", f"/classes/{quote(label, safe='')}", retry=False, timeout=180)

    def sample(self, seq: int) -> dict:
        """One sample by its sequence number: label, state, whether its pixels are kept and the memory holds it."""
        return self._json("GET", f"/samples/{int(seq)}")

    def suspects(self, limit: int = 20, recent: int = 0) -> list[dict]:
        """The memory's samples most likely mislabelled, most suspected first; with `recent`, those among the latest
        `recent` learned samples (valued on request: a frozen pass each)."""
        params = {"limit": limit, **({"recent": recent} if recent else {})}
        return self._json("GET", "/suspects", params=params, timeout=180)["suspects"]

    def relabel(self, seq: int, label: str) -> dict:
        """Give a sample its right label (admin); the same label again changes nothing (safe to retry)."""
        return self._json("PATCH", f"/samples/{int(seq)}", json={"label": label}, timeout=180)

    def forget_sample(self, seq: int) -> dict:
        """Forget one sample for good (admin); asked again, the same answer (safe to retry)."""
        return self._json("DELETE", f"/samples/{int(seq)}", timeout=180)

    def sleep(self, fresh: bool = False) -> dict:
        """With ASER_SLEEP (admin): train the top over what the service holds as soon as no sample waits; `fresh`:
        from ImageNet's weights again, over everything held (offline training's CPU)."""
        return self._json("POST", "/sleep" + ("?fresh=true" if fresh else ""), retry=False)

    def drain(self, timeout: float = 600, pause: float = 0.3) -> dict:
        """The status once the learner has trained on everything it received (backlog 0) and
        serves that step's corrections and choice of heads (`serving_current`), or the last status
        seen when `timeout` seconds ran out: check its backlog."""
        deadline = time.monotonic() + timeout
        while not settled(status := self.status()) and time.monotonic() < deadline:
            time.sleep(pause)
        return status

    def metrics(self) -> str:
        response = self._send("GET", "/metrics")
        if response.status_code >= 400:
            self._check(response)
        return response.text

    def healthy(self) -> bool:
        try:
            return self.http.get("/healthz").status_code == 200
        except httpx.HTTPError:
            return False

    def ready(self) -> bool:
        try:
            return self.http.get("/readyz").status_code == 200
        except httpx.HTTPError:
            return False


class SampleSocket:
    """Ingest over one WebSocket (`/samples/ws`); each message is acknowledged after its commit.
    Every sample carries an id, so messages resent after a reconnect are stored once."""

    def __init__(self, base_url: str, headers: dict, retry: Retry | None = None):
        self.url = "ws" + base_url[len("http"):] + "/samples/ws"
        self.headers, self.retry = headers, retry or Retry()
        self.sent = 0  # messages acknowledged through this object, for the acks' numbering
        self.ws = self._connect()

    def _connect(self):
        from websockets.sync.client import connect

        return connect(self.url, additional_headers=self.headers, max_size=2**24).__enter__()  # closed by close()

    @staticmethod
    def message(labels: Sequence[str], images: Sequence[bytes], ids: Sequence[str] | None = None) -> str:
        ids = ids if ids is not None else [new_id() for _ in images]
        return json.dumps({"samples": [encode_sample(a, b, i) for a, b, i in zip(labels, images, ids, strict=True)]})

    def send(self, labels: Sequence[str], images: Sequence[bytes], ids: Sequence[str] | None = None) -> dict:
        """Send one message (one or many samples) and wait for its ack."""
        return next(self.pipeline([(labels, images, ids)], window=1))

    def pipeline(self, batches: Iterable[tuple], window: int = 8) -> Iterator[dict]:
        """Send batches (labels, images[, ids]) with up to `window` unacknowledged messages in
        flight; yields the acks in order. After a lost connection it reconnects and resends
        the messages in flight."""
        from websockets.exceptions import ConnectionClosed

        in_flight: deque[str] = deque()
        batches = iter(batches)
        exhausted = False
        pauses = self.retry.pauses()
        while in_flight or not exhausted:
            try:
                while not exhausted and len(in_flight) < window:
                    batch = next(batches, None)
                    if batch is None:
                        exhausted = True
                        break
                    in_flight.append(self.message(*batch))
                    self.ws.send(in_flight[-1])
                if in_flight:
                    ack = json.loads(self.ws.recv())
                    if ack.get("status") in RETRY_STATUSES:
                        raise ConnectionError(f"message not stored: {ack.get('detail')}")  # resend what is in flight
                    in_flight.popleft()
                    self.sent += 1
                    pauses = self.retry.pauses()
                    yield {**ack, "message": self.sent}
            except (ConnectionClosed, OSError):
                pause = next(pauses, None)
                if pause is None:
                    raise
                time.sleep(pause)
                self._reconnect(in_flight)

    def _reconnect(self, in_flight: deque[str]) -> None:
        try:
            self.ws.close()
        except Exception:
            pass
        try:
            self.ws = self._connect()
            for message in in_flight:
                self.ws.send(message)
        except OSError:
            pass  # the next send or receive fails again, and the pipeline pauses longer

    def close(self) -> None:
        self.ws.close()

    def __enter__(self) -> "SampleSocket":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
