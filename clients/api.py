"""Python client for the learner service (httpx).

>>> client = ServiceClient("http://127.0.0.1:8000")          # doctest: +SKIP
>>> client.add_samples(["cat", "dog"], [cat_png, dog_png])     # doctest: +SKIP
{'accepted': 2, 'first_seq': 1, 'last_seq': 2}
>>> client.predict([cat_png], k=1)                             # doctest: +SKIP
{'model_version': 7, 'steps': 3, 'results': [[{'label': 'cat', 'probability': 0.91}]]}
"""

from __future__ import annotations

import base64
from collections.abc import Sequence

import httpx


class ServiceError(RuntimeError):
    """The service answered with an error: `status`, `error` code and `detail`."""

    def __init__(self, status: int, error: str, detail):
        super().__init__(f"{status} {error}: {detail}")
        self.status, self.error, self.detail = status, error, detail


class ServiceClient:
    def __init__(self, base_url: str, token: str | None = None, timeout: float = 30.0):
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.Client(base_url=base_url, headers=headers, timeout=timeout)

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
        samples = [{"label": label, "image": base64.b64encode(img).decode()} for label, img in zip(labels, images)]
        return self._check(self.http.post("/samples", json={"samples": samples}))

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
