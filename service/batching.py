"""Micro-batched predictions: requests that arrive together share one forward pass, so the
throughput grows with concurrent clients instead of queueing behind one another.

Leader and followers, no thread of its own: a request joins the waiting list; if no batch is
being computed, its thread leads one: it takes the waiting requests (up to `max_images` images;
after a pause of `wait_s` for latecomers when the previous batch was shared, i.e. when
requests are known to come together), runs them as one batch through one published model
(the same weights for all of them), and hands each request its rows. A lone client therefore
never waits nor changes threads; concurrent ones queue only behind the batch in progress.

>>> import torch
>>> batcher = PredictBatcher(lambda: (lambda x: x.float().sum(dim=(1, 2, 3), keepdim=True)), 0.001, 64)
>>> model, rows = batcher.run(torch.ones(2, 3, 2, 2, dtype=torch.uint8))
>>> rows.flatten().tolist()
[12.0, 12.0]
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

import torch


class PredictBatcher:
    def __init__(self, current_model: Callable[[], Callable[[torch.Tensor], torch.Tensor]], wait_s: float,
                 max_images: int, on_batch: Callable[[int], None] | None = None):
        """`current_model()` gives the model to use now: a callable images -> per-image rows (the
        learner's published Predictor)."""
        self.current_model, self.wait_s, self.max_images = current_model, wait_s, max_images
        self.on_batch = on_batch  # told each batch's image count (metrics)
        self._waiting: list[tuple[torch.Tensor, Future]] = []
        self._cond = threading.Condition()
        self._leading = False
        self._shared = False  # whether the last batch served several requests

    def run(self, images: torch.Tensor):
        """(the model used, its rows for `images`), computed together with concurrent requests."""
        answer: Future = Future()
        with self._cond:
            self._waiting.append((images, answer))
        while not answer.done():
            with self._cond:
                while self._leading and not answer.done():
                    self._cond.wait()
                if answer.done():
                    break
                self._leading = True
            try:
                self._lead()
            finally:
                with self._cond:
                    self._leading = False
                    self._cond.notify_all()
        return answer.result()

    def _lead(self) -> None:
        if self._shared and self.wait_s:
            time.sleep(self.wait_s)  # requests come together now: let the latecomers join
        with self._cond:
            batch, n = [], 0
            while self._waiting and (not batch or n + len(self._waiting[0][0]) <= self.max_images):
                batch.append(self._waiting.pop(0))
                n += len(batch[-1][0])
        self._shared = len(batch) > 1
        self._answer(batch)

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
