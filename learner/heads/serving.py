"""What a learner serves, apart from how it trains: the served weights (the moving average, or its
copy corrected on the replay memory), their eval-mode features with BatchNorm folded in, the served
head (the trained one, or a streaming head solved on the frozen features, or the streaming head
while a class is young and the trained one after: `streams`), and predictions.
`ContinualLearner` inherits it; every name here reads the learner's own state."""

from __future__ import annotations

from contextlib import contextmanager
from copy import deepcopy

import torch

from ..networks.lite0 import POOLED
from ..networks.reduced_resnet import ReducedResNet18, recompute_bn
from .bias_correction import fit_logit_bias
from .head_choice import UNFITTED_POOL, candidates

# a streaming head's logits may lie far below zero (LDA's): a class it has not seen sits further still
UNSEEN_LOGIT = -1e30


class Serving:
    @property
    def streams(self) -> bool:
        """Whether the streaming head serves now: always, or with `trained_head_from` while some class
        seen (and not forgotten) has fewer samples than that; the trained head answers otherwise."""
        if self.stream_head is None or self.head_choice is not None:  # a measured choice: `served_choice`
            return False
        if self.trained_head_from is None:
            return True
        return self.stream_head.youngest() < self.trained_head_from

    def serving_features(self, images: torch.Tensor, batch_size: int = 512) -> torch.Tensor:
        """f_ext of the serving weights (the EMA, if on): what predictions and NCM use; under a
        streaming serving head, the frozen features it reads."""
        if self.streams:
            return self._eval_map(lambda x: x, images, batch_size, self.frozen_features)
        return self._eval_map(self.inference_features(self.autocast_dtype), images, batch_size)

    def frozen_features(self, images: torch.Tensor) -> torch.Tensor:
        """The frozen network's pooled features of images (or stored latents): what a streaming head reads."""
        return self.backbone.encode_with_features(images)[1]

    def encoded_features(self):
        """(stored, frozen features) of images (`encode_incoming`) -> the features the served head reads,
        as a function that later steps do not change (what a service's predictions run between steps);
        `served_head` goes with it."""
        if self.streams:
            return lambda stored, frozen: frozen  # no trained weights on this path
        features = self.inference_features(self.autocast_dtype)
        return lambda stored, frozen: features(self.to_input(stored))

    def served_head(self, solve: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """The served linear head over class ids 0..num_classes-1 (weight, bias): the serving weights'
        head, or the streaming head as solved now (`stream_head_rows`)."""
        if not self.streams:
            head = self.serving_model.head
            return head.weight.detach(), head.bias.detach()
        return self.stream_head_rows(solve)

    def served_choice(self, solve: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Under a measured choice (`learner.heads.head_choice`): streaming LDA's rows (`stream_head_rows`) and each
        class's head, which `served_head` (the top's) joins; None otherwise."""
        if self.head_choice is None:
            return None
        return (*self.stream_head_rows(solve), self.head_choice.choice(self.num_classes))

    def stream_head_rows(self, solve: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """The streaming head as solved now (`solved_head`), over class ids 0..num_classes-1: a class it has not
        seen (or forgot) gets a zero row and a bias no logit reaches."""
        solved = self.solved_head(solve)
        weight = torch.zeros(self.num_classes, solved.weight.shape[1], device=self.device)
        bias = torch.full((self.num_classes,), UNSEEN_LOGIT, device=self.device)
        weight[solved.class_ids] = solved.weight.to(self.device)
        bias[solved.class_ids] = solved.bias.to(self.device)
        return weight, bias

    def solved_head(self, solve: bool = True):
        """The streaming head solved on what it has seen, solved again when it says it is due
        (`StreamingClassMeans.solve_due`: streaming LDA's solve costs O(d^3)); with `solve` False, as solved
        last (a learner behind its stream publishes what it skipped without paying for a solve)."""
        if self._solved is None or (solve and self.stream_head.solve_due(self._solved[0])):
            self._solved = (self.stream_head.counts.clone(), self.stream_head.head())
            self._solves += 1
        return self._solved[1]

    def top_probabilities(self, stored: torch.Tensor, batch_size: int = 64) -> torch.Tensor:
        """The serving top's softmax of stored latents, on the CPU; `batch_size` a pass (a sleep's held-back
        samples at once would hold every one's activations)."""
        features, head = self.inference_features(self.autocast_dtype), self.serving_model.head
        with torch.inference_mode(), self._autocast():  # the top's BatchNorm is in eval mode either way
            parts = [torch.softmax(head(features(self.to_input(chunk))).float(), 1).cpu()
                     for chunk in stored.split(batch_size)]
        return torch.cat(parts) if parts else torch.zeros(0, self.num_classes)

    def head_probabilities(self, stored: torch.Tensor, frozen: torch.Tensor, with_top: bool = True,
                           top: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Each candidate head's probabilities (`learner.heads.head_choice.CANDIDATES`) of stored latents and their
        frozen features, over class ids 0..num_classes-1, on the CPU. `with_top` False: without the top's pass (its
        probabilities all ones), for a composition that does not read them (`HeadChoice.reads_top`); `top`: the top's
        probabilities already computed (`held_top_probabilities`)."""
        slda = torch.softmax(self.solved_head().full_logits(frozen.cpu().float(), self.num_classes), 1)
        if top is None:
            top = self.top_probabilities(stored) if with_top else None
        return candidates(slda, top, self.head_choice.pool_of(self.num_classes) if self.head_choice is not None
                          else UNFITTED_POOL)

    def candidate_probabilities(self, images: torch.Tensor, batch_size: int = 512) -> dict[str, torch.Tensor]:
        """`head_probabilities` of images (or stored latents), and the served ones under the measured choice (measured
        on the held-back samples first, where they are and the weights changed since: an evaluation in process; a
        service measures when idle, and while its stream keeps it busy serves the choice of the last measure)."""
        self.measure_held()
        parts = []
        for i in range(0, images.shape[0], batch_size):
            probabilities = self.head_probabilities(*self.backbone.encode_with_features(images[i:i + batch_size]))
            parts.append({**probabilities, "served": self.head_choice.compose(probabilities)})
        return {k: torch.cat([p[k] for p in parts]) for k in parts[0]} if parts else {}

    def logits(self, images: torch.Tensor, batch_size: int = 512, serving: bool = True) -> torch.Tensor:
        """Eval-mode logits of the serving weights (or, `serving=False`, of the trained ones); where the learner
        calibrates, the logarithms of the calibrated probabilities (`calibration`)."""
        calibration = self.calibration() if serving else None
        if calibration is not None and self.head_choice is not None and len(images):  # streaming LDA's answer too
            return self.calibrated(self.candidate_probabilities(images, batch_size)).log().to(self.device)
        logits = self._logits(images, batch_size, serving)
        return logits if calibration is None else calibration.probabilities(logits.cpu()).log().to(logits.device)

    def unknown_scores(self, images: torch.Tensor, batch_size: int = 512) -> torch.Tensor:
        """"None of these" scores of images (`learner.heads.calibration.Calibration.unknown_score`); with
        `calibrate` only. The distance score reads no answer: one encoding a batch, no head."""
        calibration = self.calibration()
        if calibration.means is None or self.stream_head is None:
            return calibration.unknown_score(torch.softmax(self.logits(images, batch_size), 1).cpu())

        def scores(batch: torch.Tensor) -> torch.Tensor:
            stored, frozen = self.backbone.encode_with_features(batch)
            channels = None if calibration.parts is None else self.backbone.channel_means(stored).cpu().float()
            return calibration.unknown_score(None, frozen.cpu().float(), channels)
        return self._eval_map(lambda x: x, images, batch_size, scores)

    def calibrated(self, candidates: dict[str, torch.Tensor]) -> torch.Tensor:
        """The served probabilities of `candidate_probabilities`, calibrated (`calibration`: streaming LDA's answer
        where the served one is a class the top has not learned)."""
        calibration, served = self.calibration(), candidates["served"]
        if calibration is None:
            return served
        stream = candidates["slda"].clamp_min(1e-30).log()
        return calibration.probabilities(served.clamp_min(1e-30).log(), stream=stream)

    def served_logits(self, stored: torch.Tensor, frozen: torch.Tensor | None = None,
                      top: torch.Tensor | None = None) -> torch.Tensor:
        """The served head's logits of stored latents (or images) and their frozen features, before calibration;
        `top`: the top's probabilities of them, where already computed."""
        if self.head_choice is not None:
            # no served class reads the top: the same answers without its pass (the held-back fits' cost)
            reads_top = self.head_choice.reads_top(self.num_classes)
            probabilities = self.head_probabilities(stored, frozen, reads_top, top if reads_top else None)
            return self.head_choice.compose(probabilities).clamp_min(1e-30).log()
        if self.streams:
            return self.solved_head().full_logits(frozen.cpu().float(), self.num_classes)
        return self._logits(stored, 512, True)

    def _logits(self, images: torch.Tensor, batch_size: int, serving: bool) -> torch.Tensor:
        if serving and self.head_choice is not None:  # the log of the served probabilities
            served = self.candidate_probabilities(images, batch_size).get("served", torch.zeros(0, self.num_classes))
            return served.to(self.device).clamp_min(1e-30).log()
        if serving and self.streams:
            head, n = self.solved_head(), self.num_classes
            return self._eval_map(lambda f: head.full_logits(f, n).to(f.device), images, batch_size,
                                  self.frozen_features)
        features = self.inference_features(self.autocast_dtype, serving)
        head = (self.serving_model if serving else self.model).head
        return self._eval_map(lambda x: head(features(x)), images, batch_size)

    @property
    def averaged_model(self) -> ReducedResNet18:
        """The moving average with `ema_decay`, else the trained weights."""
        return self.ema.model if self.ema is not None else self.model

    @property
    def serving_model(self) -> ReducedResNet18:
        """The weights predictions come from: `averaged_model`, or with serving_bn="memory" or
        serving_bias its copy corrected on the memory at the last `refresh_serving`."""
        return self._served_copy if self._served_copy is not None else self.averaged_model

    def refresh_serving(self) -> None:
        """Correct a copy of the averaged weights on the replay memory as it is now, for serving:
        with serving_bn="memory" its BatchNorm statistics are recomputed (SWA's `update_bn`,
        `learner.networks.reduced_resnet.recompute_bn`: one train-mode pass over the memory, no gradients); with
        serving_bias its head's bias takes the offsets fitted on the memory's logits
        (`learner.heads.bias_correction`: one eval pass). Run it where predictions are taken (an
        evaluation, a publication), not every step. Without either, or without a memory to
        correct on, `averaged_model` serves."""
        buffer = getattr(self, "buffer", None)
        self._folded = self._top_graph = None  # the served weights change
        self._held_tops = (None, {})  # ... under the same version: the top's probabilities of held samples go
        if (self.serving_bn != "memory" and not self.serving_bias) or buffer is None or len(buffer) == 0:
            self._served_copy = None
            return
        images, labels = buffer.images[:len(buffer)], buffer.labels[:len(buffer)]
        if self.serving_bn == "memory":
            copy = recompute_bn(self.averaged_model, images, self.to_input)
        else:
            copy = deepcopy(self.averaged_model).eval().requires_grad_(False)
        if self.serving_bias:
            features = self.backbone.features(copy)  # the inference path: no normalisation passes
            logits = self._eval_map(lambda x: copy.head(features(x)), images, 512)
            with torch.no_grad():
                copy.head.bias += fit_logit_bias(logits, labels, copy.num_classes).to(copy.head.bias.device)
        self._served_copy = copy
        if self.forgotten:
            self._silence_forgotten()

    @contextmanager
    def serving_from(self, bn: str | None = None, bias: bool | None = None):
        """Serve with other corrections (`bn`: "average" or "memory"; `bias`), refreshed now,
        inside the block, then as before: the benchmark evaluates them on the same run."""
        before = self.serving_bn, self.serving_bias, self._served_copy
        self.serving_bn = before[0] if bn is None else bn
        self.serving_bias = before[1] if bias is None else bias
        self.refresh_serving()
        try:
            yield self
        finally:
            self.serving_bn, self.serving_bias, self._served_copy = before
            self._folded = self._top_graph = None

    def inference_features(self, dtype: torch.dtype | None = None, serving: bool = True):
        """Eval-mode f_ext with BatchNorm folded into the convolutions (in `dtype`, fp32 by
        default), of the serving weights (or the trained ones), built once per weights. The folded
        tensors are new storage: later training steps do not change them."""
        if serving and self._top_in_runtime(dtype):  # rebuilt (seconds, in a child process) only for new features
            key = (self.features_version, id(self.serving_model))
            if self._top_graph is None or self._top_graph[0] != key:
                self._top_graph = (key, self.backbone.features(self.serving_model, dtype, runtime=True))
            return self._top_graph[1]
        if self._folded is None or self._folded[0] != self.version:
            self._folded = (self.version, {})
        cache, net = self._folded[1], self.serving_model if serving else self.model
        if (id(net), dtype) not in cache:
            cache[(id(net), dtype)] = self.backbone.features(net, dtype)
        return cache[(id(net), dtype)]

    def _top_in_runtime(self, dtype: torch.dtype | None) -> bool:
        """Whether the served top runs in onnxruntime (`learner.networks.frozen_runtime.TopGraph`): on the CPU in
        fp32, a top above the pooled cut that trains only in sleeps (its weights hold between two)."""
        return (self.device.type == "cpu" and dtype is None and self.train_every == 0
                and getattr(self.backbone, "cut", POOLED) < POOLED)

    def predict(self, images: torch.Tensor, batch_size: int = 512, serving: bool = True) -> torch.Tensor:
        return self.logits(images, batch_size, serving).argmax(1)

    def predict_features(self, features: torch.Tensor, batch_size: int = 512) -> torch.Tensor:
        """The serving head's answers on `serving_features` of some images: what `predict` answers
        on those images, without a second pass through the network (the head runs on the same
        chunks), so one feature pass serves several heads (an evaluation's corrections)."""
        if self.streams:
            return self.solved_head().predict(features.cpu()).to(self.device)
        head = self.serving_model.head
        with torch.inference_mode():
            answers = [head(chunk.to(self.device)).argmax(1) for chunk in features.split(batch_size)]
        return torch.cat(answers) if answers else torch.zeros(0, dtype=torch.long, device=self.device)

    def _eval_map(self, fn, images: torch.Tensor, batch_size: int, to_input=None) -> torch.Tensor:
        was_training = self.model.training
        self.model.eval()
        to_input = to_input or self.to_input
        try:
            with torch.inference_mode():
                outs = [fn(to_input(images[i:i + batch_size].to(self.device)))
                        for i in range(0, images.shape[0], batch_size)]
            return torch.cat(outs).float().clone() if outs else torch.zeros(0)
        finally:
            self.model.train(was_training)
