"""Micro-batched, fair predictions: requests that arrive together share one forward pass, so the
throughput grows with concurrent clients instead of queueing behind one another, and a large request
goes in slices, so a device's one-photo request never waits behind another client's thousand.

Leader and followers, no thread of its own: a request joins the waiting line; if no pass is being
computed, its thread leads one: it takes up to `max_images` images from the front of the line (after
a pause of `wait_s` for latecomers when the previous pass was shared, i.e. when requests are known to
come together), runs them as one batch, and hands each request its rows. A request with images left
goes to the back of the line: requests take turns, a slice each. Every slice of a request runs through
the model published when its first slice ran (one set of weights a request, as it reports one
version). A lone client therefore never waits nor changes threads; a small request waits at most for
the pass in progress and one slice of each request ahead of it.

>>> import torch
>>> batcher = PredictBatcher(lambda: (lambda x: x.float().sum(dim=(1, 2, 3), keepdim=True)), 0.001, 64)
>>> model, rows = batcher.run(torch.ones(2, 3, 2, 2, dtype=torch.uint8))
>>> rows.flatten().tolist()
[12.0, 12.0]
>>> sliced = PredictBatcher(lambda: (lambda x: x.float().sum(dim=(1, 2, 3), keepdim=True)), 0.0, 3)
>>> sliced.run(torch.arange(7, dtype=torch.uint8).view(7, 1, 1, 1).expand(7, 3, 1, 1))[1].flatten().tolist()
[0.0, 3.0, 6.0, 9.0, 12.0, 15.0, 18.0]
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch


@dataclass(eq=False)
class _Request:
    images: torch.Tensor
    answer: Future = field(default_factory=Future)
    model: object = None  # pinned at its first slice
    taken: int = 0  # images handed to passes so far
    rows: list = field(default_factory=list)


class PredictBatcher:
    def __init__(self, current_model: Callable[[], Callable[[torch.Tensor], torch.Tensor]], wait_s: float,
                 max_images: int, on_batch: Callable[[int], None] | None = None):
        """`current_model()` gives the model to use now: a callable images -> per-image rows (the
        learner's published Predictor); `max_images`: images a pass at most, and a request's slice."""
        self.current_model, self.wait_s, self.max_images = current_model, wait_s, max_images
        self.on_batch = on_batch  # told each pass's image count (metrics)
        self._waiting: list[_Request] = []
        self._cond = threading.Condition()
        self._leading = False
        self._shared = False  # whether the last pass served several requests

    def run(self, images: torch.Tensor):
        """(the model used, its rows for `images`), computed in passes shared with concurrent requests."""
        request = _Request(images)
        answer = request.answer
        with self._cond:
            self._waiting.append(request)
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
            slices, n = [], 0
            while self._waiting and n < self.max_images:
                request = self._waiting.pop(0)
                k = min(len(request.images) - request.taken, self.max_images - n)
                slices.append((request, request.images[request.taken:request.taken + k]))
                request.taken += k
                n += k
        self._shared = len(slices) > 1
        model = self.current_model()
        for request, _ in slices:
            request.model = request.model or model
        for pinned in {id(r.model): r.model for r, _ in slices}.values():
            self._answer(pinned, [(r, part) for r, part in slices if r.model is pinned])
        with self._cond:  # requests with images left take their turn again, at the back of the line
            self._waiting.extend(r for r, _ in slices if not r.answer.done() and r.taken < len(r.images))

    def _answer(self, model, slices: list) -> None:
        try:
            rows = model(torch.cat([part for _, part in slices]) if len(slices) > 1 else slices[0][1])
        except Exception as exc:  # every request of the pass learns why
            for request, _ in slices:
                request.answer.set_exception(exc)
            return
        if self.on_batch is not None:
            self.on_batch(len(rows))
        start = 0
        for request, part in slices:
            request.rows.append(rows[start:start + len(part)])
            start += len(part)
            if request.taken == len(request.images):
                request.answer.set_result((model, torch.cat(request.rows) if len(request.rows) > 1
                                           else request.rows[0]))
