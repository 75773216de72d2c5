"""Python client for the learner service (httpx).

>>> client = ServiceClient("http://127.0.0.1:8000")          # doctest: +SKIP
>>> client.add_samples(["cat", "dog"], [cat_png, dog_png])     # doctest: +SKIP
{'accepted': 2, 'first_seq': 1, 'last_seq': 2}
>>> client.predict([cat_png], k=1)                             # doctest: +SKIP
{'model_version': 7, 'steps': 3, 'results': [[{'label': 'cat', 'probability': 0.91}]]}
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterable, Iterator, Sequence

import httpx


class ServiceError(RuntimeError):
    """The service answered with an error: `status`, `error` code and `detail`."""

    def __init__(self, status: int, error: str, detail):
        super().__init__(f"{status} {error}: {detail}")
        self.status, self.error, self.detail = status, error, detail


def encode_sample(label: str, image: bytes) -> dict:
    return {"label": label, "image": base64.b64encode(image).decode()}


class ServiceClient:
    def __init__(self, base_url: str, token: str | None = None, timeout: float = 30.0):
        self.base_url, self.token = base_url.rstrip("/"), token
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.Client(base_url=self.base_url, headers=self.headers, timeout=timeout)

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> "ServiceClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check(self, response: httpx.Response) -> dict:
        if response.status_code >= 400:
            try:
                body = response.json()
            except ValueError:
                body = {"error": "http_error", "detail": response.text}
            raise ServiceError(response.status_code, body.get("error", "http_error"), body.get("detail"))
        return response.json()

    def add_samples(self, labels: Sequence[str], images: Sequence[bytes]) -> dict:
        """Send labelled encoded images (PNG/JPEG bytes); returns once they are durably logged."""
        if len(labels) != len(images):
            raise ValueError(f"{len(labels)} labels for {len(images)} images")
        samples = [encode_sample(label, img) for label, img in zip(labels, images)]
        return self._check(self.http.post("/samples", json={"samples": samples}))

    def stream_samples(self, samples: Iterable[tuple[str, bytes]]) -> list[dict]:
        """NDJSON over one chunked POST: one line per (label, image); returns one ack per line
        (an ack with 'error' refused that line alone)."""
        lines = (json.dumps(encode_sample(label, img)).encode() + b"\n" for label, img in samples)
        response = self.http.post("/samples/stream", content=lines, headers={"content-type": "application/x-ndjson"})
        if response.status_code >= 400:
            self._check(response)
        return [json.loads(line) for line in response.text.splitlines() if line.strip()]

    def websocket(self) -> "SampleSocket":
        """A long-lived WebSocket for ingest: `send(labels, images)` returns each message's ack."""
        return SampleSocket(self.base_url, self.headers)

    def create_snapshot(self) -> dict:
        """Export the current model to ONNX now (admin); returns the snapshot record."""
        return self._check(self.http.post("/snapshots", timeout=180))

    def snapshots(self) -> list[dict]:
        return self._check(self.http.get("/snapshots"))["snapshots"]

    def download_snapshot(self, snapshot: int | str = "latest") -> bytes:
        """The .onnx bytes of a snapshot id, or of the latest one."""
        response = self.http.get(f"/snapshots/{snapshot}")
        if response.status_code >= 400:
            self._check(response)
        return response.content

    def add_files(self, label: str | Sequence[str], images: Sequence[bytes], content_type: str = "image/png") -> dict:
        """The same as multipart: one label for all images, or one label per image."""
        files = [("image", (f"{i}", img, content_type)) for i, img in enumerate(images)]
        labels = [label] if isinstance(label, str) else list(label)
        return self._check(self.http.post("/samples", files=files, data={"label": labels}))

    def predict(self, images: Sequence[bytes], k: int = 3) -> dict:
        payload = {"images": [base64.b64encode(img).decode() for img in images], "k": k}
        return self._check(self.http.post("/predict", json=payload))

    def predict_one(self, image: bytes, k: int = 3) -> dict:
        """GET /predict with the image as a base64url query parameter (small images)."""
        encoded = base64.urlsafe_b64encode(image).decode().rstrip("=")
        return self._check(self.http.get("/predict", params={"image": encoded, "k": k}))

    def status(self) -> dict:
        return self._check(self.http.get("/status"))

    def metrics(self) -> str:
        response = self.http.get("/metrics")
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
    """Ingest over one WebSocket (`/samples/ws`); each message is acknowledged after its commit."""

    def __init__(self, base_url: str, headers: dict):
        from websockets.sync.client import connect

        url = "ws" + base_url[len("http"):] + "/samples/ws"
        self.ws = connect(url, additional_headers=headers, max_size=2**24).__enter__()  # closed by close()

    def send(self, labels: Sequence[str], images: Sequence[bytes]) -> dict:
        """Send one message (one or many samples) and wait for its ack."""
        samples = [encode_sample(label, img) for label, img in zip(labels, images, strict=True)]
        self.ws.send(json.dumps({"samples": samples}))
        return json.loads(self.ws.recv())

    def pipeline(self, batches: Iterable[tuple[Sequence[str], Sequence[bytes]]], window: int = 8) -> Iterator[dict]:
        """Send batches with up to `window` unacknowledged messages in flight; yields the acks in order."""
        in_flight = 0
        for labels, images in batches:
            self.ws.send(json.dumps({"samples": [encode_sample(a, b) for a, b in zip(labels, images, strict=True)]}))
            in_flight += 1
            if in_flight >= window:
                yield json.loads(self.ws.recv())
                in_flight -= 1
        for _ in range(in_flight):
            yield json.loads(self.ws.recv())

    def close(self) -> None:
        self.ws.close()

    def __enter__(self) -> "SampleSocket":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
