"""Micro-batched predictions: requests that arrive together share one forward pass, so the
throughput grows with concurrent clients instead of queueing behind one another.

One thread takes the oldest waiting request, gathers those arriving within `wait_s` (up to
`max_images` images), runs them as one batch through one published model (the same weights
for all of them), and hands each request its rows. A lone request waits at most `wait_s`.

>>> import torch
>>> batcher = PredictBatcher(lambda: (lambda x: x.float().sum(dim=(1, 2, 3), keepdim=True)), 0.001, 64)
>>> model, probs = batcher.run(torch.ones(2, 3, 2, 2, dtype=torch.uint8))
>>> probs.flatten().tolist()
[12.0, 12.0]
>>> batcher.close()
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

import torch

_STOP = object()


class PredictBatcher:
    def __init__(self, current_model: Callable[[], Callable[[torch.Tensor], torch.Tensor]], wait_s: float,
                 max_images: int, on_batch: Callable[[int], None] | None = None):
        """`current_model()` gives the model to use now: a callable images -> per-image rows (the
        learner's published Predictor's `probabilities`, say, or the Predictor itself)."""
        self.current_model, self.wait_s, self.max_images = current_model, wait_s, max_images
        self.on_batch = on_batch  # told each batch's image count (metrics)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name="predict-batcher", daemon=True)
        self._thread.start()

    def run(self, images: torch.Tensor):
        """(the model used, its rows for `images`), computed together with concurrent requests."""
        answer: Future = Future()
        self._queue.put((images, answer))
        return answer.result()

    def close(self) -> None:
        self._queue.put(_STOP)
        self._thread.join(timeout=10)

    def _serve(self) -> None:
        while (first := self._queue.get()) is not _STOP:
            batch = self._gather(first)
            if batch[-1] is _STOP:
                batch.pop()
                self._answer(batch)
                return
            self._answer(batch)

    def _gather(self, first) -> list:
        batch, n = [first], len(first[0])
        deadline = time.monotonic() + self.wait_s
        while n < self.max_images:
            try:
                item = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            batch.append(item)
            if item is _STOP:
                break
            n += len(item[0])
        return batch

    def _answer(self, batch: list) -> None:
        model = self.current_model()
        try:
            rows = model(torch.cat([images for images, _ in batch]) if len(batch) > 1 else batch[0][0])
        except Exception as exc:  # every request of the batch learns why
            for _, answer in batch:
                answer.set_exception(exc)
            return
        if self.on_batch is not None:
            self.on_batch(len(rows))
        start = 0
        for images, answer in batch:
            answer.set_result((model, rows[start:start + len(images)]))
            start += len(images)
