"""The common frame of every method: a model, plain SGD, and one `observe` step per batch.

A learner is fed uint8 images [b, 3, H, W] with integer labels, one mini-batch at a time,
each batch once. Labels beyond the head's width grow the head (a service does not know its
classes in advance). Task boundaries are optional hints (`begin_task`, `end_task`) that only
the task-aware baselines (AGEM, EWC, the retrieval trick) use. The backbone (`learner.backbone`)
decides what trains and what the memory stores: the images themselves from scratch, or a frozen
pretrained part's latents; a learner takes either images or their stored form.
"""

from __future__ import annotations

from contextlib import contextmanager
from copy import deepcopy

import torch
from torch.nn import functional as F

from .backbone import ScratchBackbone
from .bias_correction import fit_logit_bias
from .ema import WeightAverage
from .latent import Latent
from .model import ReducedResNet18, recompute_bn
from .policy import StepContext
from .streaming import make_head


def training_channels_last(device: torch.device, autocast_dtype: torch.dtype | None) -> bool:
    """The memory format that trains fastest: channels_last, except bf16 on CPU, where oneDNN's
    BatchNorm backward ran faster in NCHW on this project's machine."""
    return not (device.type == "cpu" and autocast_dtype == torch.bfloat16)


FORGOTTEN_LOGIT = -1e4
# a streaming head's logits may lie far below zero (LDA's): a class it has not seen sits further still
UNSEEN_LOGIT = -1e30
# where the served model's BatchNorm statistics come from: the moving average of the trained ones, or
# a pass of the averaged weights over the replay memory (`ContinualLearner.refresh_serving`)
SERVING_BN = ("average", "memory")


class ContinualLearner:
    name = "learner"

    def __init__(self, num_classes: int, image_shape: tuple[int, int, int] = (3, 32, 32), lr: float = 0.1,
                 device: str | torch.device = "cpu", seed: int = 0, channels_last: bool | None = None,
                 autocast_dtype: torch.dtype | None = None, latent_dtype: torch.dtype | None = None,
                 compile: bool = False, ema_decay: float | None = None, serving_bn: str = "average",
                 serving_bias: bool = False, backbone=None, serving_head: str | None = None):
        self.device = torch.device(device)
        self.image_shape = tuple(image_shape)
        self.lr = lr
        if channels_last is None:
            channels_last = training_channels_last(self.device, autocast_dtype)
        # what trains and what the memory stores (`learner.backbone`): by default the paper's network
        self.backbone = backbone or ScratchBackbone(self.image_shape, channels_last)
        channels_last = channels_last and self.backbone.name == "scratch"
        self.backbone.channels_last = channels_last
        self.channels_last = channels_last
        self.autocast_dtype = autocast_dtype
        # the memory policies' feature passes (S_sub, candidates) may run in reduced precision
        # while training and predictions stay in autocast_dtype (fp32 by default)
        self.latent_dtype = latent_dtype or autocast_dtype
        self.model = self.backbone.make_model(num_classes, seed)
        self.model.to(self.device)
        if channels_last:
            self.model.to(memory_format=torch.channels_last)
        self.model.train()
        # torch.compile fuses the training step's elementwise work (BatchNorm, ReLU, adds); it
        # costs ~30 s of compilation at the first step, so it is an option
        self.train_forward = torch.compile(self.model) if compile else self.model
        self.optimizer = self._make_optimizer()
        # serving weights: an average of the trained ones (`learner.ema`), or the trained ones
        self.ema = WeightAverage(self.model, ema_decay) if ema_decay else None
        if serving_bn not in SERVING_BN:
            raise ValueError(f"unknown serving_bn {serving_bn!r}; choose one of {', '.join(SERVING_BN)}")
        if serving_bn == "memory" and not self.backbone.trains_bn:
            raise ValueError("serving_bn='memory' recomputes trained BatchNorm statistics; the pretrained top keeps "
                             "its own")
        self.serving_bn, self.serving_bias = serving_bn, serving_bias
        # a streaming head on the frozen features (`learner.streaming`) serves instead of the trained one
        if serving_head and not hasattr(self.backbone, "frozen_features"):
            raise ValueError("a streaming serving head needs frozen features: the pretrained backbone")
        self.stream_head = make_head(serving_head, self.model.feature_dim) if serving_head else None
        self._solved = None  # (samples_seen, the solved streaming head)
        self._served_copy: ReducedResNet18 | None = None  # corrected on the memory (`refresh_serving`)
        self.generator = torch.Generator().manual_seed(seed)
        self.version = 0  # bumps with every weight change; names the weights features came from
        self.steps = 0
        self.samples_seen = 0
        self.samples_skipped = 0  # not trained on: a stream too fast (`pass_through` and `skip`)
        self.samples_thinned = 0  # of them, those that did not even reach the memory update (`skip`)
        self.rehearsal_steps = 0  # replay-only steps taken while the stream was idle
        self.lean_steps = 0  # of the stream steps, those taken lean (behind the stream)
        self.current_task_classes: torch.Tensor | None = None
        self.forgotten: set[int] = set()  # classes removed on request: never predicted again
        self._folded = None  # (version, {(id of the net, dtype): folded f_ext}) for inference

    # --- the step ----------------------------------------------------------------------
    def observe(self, images: torch.Tensor, labels: torch.Tensor, lean: bool = False) -> dict:
        """Learn from one incoming mini-batch B_n (seen once). Returns step statistics.

        `lean`: the method's cheapest step (the replay methods: one iteration, no augmentation, the
        memory policies' lean forms), for a learner behind its stream (`learner.catch_up`): more of
        the stream gets a step."""
        pixels = images.to(self.device)
        images, labels = self.encode(pixels), labels.to(self.device, torch.long)
        self.ensure_classes(int(labels.max()) + 1)
        self._update_stream_head(images, labels)
        with self._pictures_of_admitted(pixels, images):
            stats = self._lean_observe(images, labels) if lean else self._observe(images, labels)
        self.lean_steps += lean
        if self.forgotten:
            self._silence_forgotten()  # whatever the method's step did to those rows
        self.steps += 1
        self.samples_seen += images.shape[0]
        return stats

    def _update_stream_head(self, stored: torch.Tensor, labels: torch.Tensor) -> None:
        """Every sample the learner sees, trained on or passed through, reaches the streaming head."""
        if self.stream_head is not None:
            self.stream_head.update(self.backbone.frozen_features(stored), labels)

    @contextmanager
    def _pictures_of_admitted(self, pixels: torch.Tensor, stored: torch.Tensor):
        """On a latent memory, a small picture of each sample the step admits (`ReplayBuffer.pictures`:
        what a person browsing the memory sees); the step's stored latents tell which sample a slot took."""
        buffer = getattr(self, "buffer", None)
        if buffer is None or pixels is stored or pixels.dtype != torch.uint8:  # images kept as they are
            yield
            return
        offered = buffer.n_seen
        yield
        slots = torch.nonzero(buffer.entered[:buffer.size] >= offered).flatten().to(buffer.device)
        if slots.numel():
            kept = buffer.images[slots].flatten(1)
            same = (kept[:, None, :] == stored.flatten(1).to(kept.device)[None]).all(2)  # [slots, batch]
            found, sample = same.any(1), same.float().argmax(1)
            buffer.keep_pictures(slots[found], pixels[sample[found]])

    def _observe(self, images: torch.Tensor, labels: torch.Tensor) -> dict:
        raise NotImplementedError

    def _lean_observe(self, images: torch.Tensor, labels: torch.Tensor) -> dict:
        return self._observe(images, labels)  # a method without costly options has one form

    def pass_through(self, images: torch.Tensor, labels: torch.Tensor, batch_size: int | None = None,
                     lean: bool = False) -> None:
        """Let samples the learner has no time to train on reach the memory only: no gradient
        step, but the memory update sees them as it sees every sample (so the memory keeps
        sampling the whole stream), `batch_size` at a time (the stream's batch: KNN-SV then scores
        a skipped sample among as many candidates as a trained one); `lean`: through the update's
        lean form, as a lean step would. A learner without a memory only counts them."""
        pixels = images.to(self.device)
        images, labels = self.encode(pixels), labels.to(self.device, torch.long)
        self.ensure_classes(int(labels.max()) + 1)
        self._update_stream_head(images, labels)
        step = batch_size or labels.numel()
        with self._pictures_of_admitted(pixels, images):
            for i in range(0, labels.numel(), step):
                self._pass_through(images[i:i + step], labels[i:i + step], lean)
        self.samples_skipped += images.shape[0]

    def _pass_through(self, images: torch.Tensor, labels: torch.Tensor, lean: bool) -> None:
        pass

    def skip(self, labels: torch.Tensor) -> None:
        """Count samples the learner has no time for, not even for the memory update (thinned by
        `learner.catch_up`); their classes still get head rows."""
        if labels.numel():
            self.ensure_classes(int(labels.max()) + 1)
        self.samples_skipped += labels.numel()
        self.samples_thinned += labels.numel()

    def rehearse(self) -> dict | None:
        """One replay-only step from the memory (the stream is idle); None if there is nothing to
        rehearse. It never sees a stream sample, so it scores none."""
        stats = self._rehearse()
        if stats is not None:
            self.rehearsal_steps += 1
            if self.forgotten:
                self._silence_forgotten()
        return stats

    def _rehearse(self) -> dict | None:
        return None

    def begin_task(self, classes) -> None:
        """Optional hint: the classes of the task that starts now."""
        self.current_task_classes = torch.as_tensor(list(classes), dtype=torch.long, device=self.device)

    def end_task(self) -> None:
        """Optional hint: the current task has ended."""

    # --- helpers shared by the methods -------------------------------------------------
    def step_context(self, buffer, eligible: torch.Tensor | None = None) -> StepContext:
        """What memory policies see of this learner during a step, under the current weights."""
        return StepContext(latent=Latent(self.extract, buffer, self.version), generator=self.generator,
                           model=self.model, lr=self.lr, num_classes=self.num_classes, to_input=self.to_input,
                           eligible=eligible)

    def encode(self, images: torch.Tensor) -> torch.Tensor:
        """Incoming uint8 images -> the form the memory stores and the top trains on (the images
        themselves from scratch; the frozen part's latents on the pretrained backbone)."""
        return self.backbone.encode(images)

    def to_input(self, stored: torch.Tensor) -> torch.Tensor:
        return self.backbone.to_input(stored)

    @contextmanager
    def _autocast(self):
        if self.autocast_dtype is None:
            yield
        else:
            with torch.autocast(self.device.type, dtype=self.autocast_dtype):
                yield

    def forward_logits(self, images: torch.Tensor) -> torch.Tensor:
        """Train-mode forward pass: uint8 images -> float32 logits."""
        with self._autocast():
            logits = self.train_forward(self.to_input(images))
        return logits.float()

    def loss(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.forward_logits(images), labels)

    def optimize(self, loss_fn) -> torch.Tensor:
        """One SGD step on the loss `loss_fn()` computes."""
        self.optimizer.zero_grad(set_to_none=True)
        loss = loss_fn()
        loss.backward()
        self.optimizer.step()
        self.weights_changed()
        return loss.detach()

    def weights_changed(self) -> None:
        """After every optimizer step: a new weights version, and the serving average follows."""
        self.version += 1
        if self.ema is not None:
            self.ema.update(self.model)

    def rename_weights(self, above: int = 0) -> None:
        """A new `version` without a step (and above `above`), for a served copy corrected while idle
        or a lineage restarted past numbers it served before: whoever keys on the version (a cache,
        a snapshot's metadata) sees the change; cached features look older by as much."""
        self.version = max(self.version, above) + 1

    def sgd_step(self, images: torch.Tensor, labels: torch.Tensor, extra_loss=None) -> torch.Tensor:
        """One SGD step on the mean cross-entropy of (images, labels) (plus `extra_loss()`)."""
        if extra_loss is None:
            return self.optimize(lambda: self.loss(images, labels))
        return self.optimize(lambda: self.loss(images, labels) + extra_loss())

    def extract(self, images: torch.Tensor, batch_size: int = 512) -> torch.Tensor:
        """f_ext of the trained weights in eval mode, no autograd: uint8 images -> latent features
        (float32). What the memory policies see."""
        return self._eval_map(self.inference_features(self.latent_dtype, serving=False), images, batch_size)

    def serving_features(self, images: torch.Tensor, batch_size: int = 512) -> torch.Tensor:
        """f_ext of the serving weights (the EMA, if on): what predictions and NCM use; under a
        streaming serving head, the frozen features it reads."""
        if self.stream_head is not None:
            return self._eval_map(lambda x: x, images, batch_size, self.frozen_features)
        return self._eval_map(self.inference_features(self.autocast_dtype), images, batch_size)

    def frozen_features(self, images: torch.Tensor) -> torch.Tensor:
        return self.backbone.frozen_features(self.encode(images))

    def pixel_features(self):
        """uint8 pixels [n, 3, H, W] -> the features the served head reads, as a function that later
        steps do not change (what a service's predictions run between steps); `served_head` goes with it."""
        if self.stream_head is not None:
            return self.frozen_features  # no trained weights on this path
        features = self.inference_features(self.autocast_dtype)
        return lambda images: features(self.to_input(self.encode(images)))

    def served_head(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The served linear head over class ids 0..num_classes-1 (weight, bias): the serving weights'
        head, or the streaming head as solved now, where a class it has not seen (or forgot) gets a
        zero row and a bias no logit reaches."""
        if self.stream_head is None:
            head = self.serving_model.head
            return head.weight.detach(), head.bias.detach()
        solved = self.solved_head()
        weight = torch.zeros(self.num_classes, solved.weight.shape[1], device=self.device)
        bias = torch.full((self.num_classes,), UNSEEN_LOGIT, device=self.device)
        weight[solved.class_ids] = solved.weight.to(self.device)
        bias[solved.class_ids] = solved.bias.to(self.device)
        return weight, bias

    def solved_head(self):
        """The streaming head solved on what it has seen so far (once per new sample count)."""
        if self._solved is None or self._solved[0] != (self.samples_seen, self.samples_skipped):
            self._solved = ((self.samples_seen, self.samples_skipped), self.stream_head.head())
        return self._solved[1]

    def logits(self, images: torch.Tensor, batch_size: int = 512, serving: bool = True) -> torch.Tensor:
        """Eval-mode logits of the serving weights (or, `serving=False`, of the trained ones)."""
        if serving and self.stream_head is not None:
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

    def teacher_logits(self, images: torch.Tensor) -> torch.Tensor:
        """The moving average's eval-mode logits of uint8 images, without gradients (the
        distillation teacher, `learner.objective`)."""
        with torch.no_grad(), self._autocast():
            return self.averaged_model(self.to_input(images)).float()

    def refresh_serving(self) -> None:
        """Correct a copy of the averaged weights on the replay memory as it is now, for serving:
        with serving_bn="memory" its BatchNorm statistics are recomputed (SWA's `update_bn`,
        `learner.model.recompute_bn`: one train-mode pass over the memory, no gradients); with
        serving_bias its head's bias takes the offsets fitted on the memory's logits
        (`learner.bias_correction`: one eval pass). Run it where predictions are taken (an
        evaluation, a publication), not every step. Without either, or without a memory to
        correct on, `averaged_model` serves."""
        buffer = getattr(self, "buffer", None)
        self._folded = None  # the served weights change
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
            self._folded = None

    def inference_features(self, dtype: torch.dtype | None = None, serving: bool = True):
        """Eval-mode f_ext with BatchNorm folded into the convolutions (in `dtype`, fp32 by
        default), of the serving weights (or the trained ones), built once per weights. The folded
        tensors are new storage: later training steps do not change them."""
        if self._folded is None or self._folded[0] != self.version:
            self._folded = (self.version, {})
        cache, net = self._folded[1], self.serving_model if serving else self.model
        if (id(net), dtype) not in cache:
            cache[(id(net), dtype)] = self.backbone.features(net, dtype)
        return cache[(id(net), dtype)]

    def predict(self, images: torch.Tensor, batch_size: int = 512, serving: bool = True) -> torch.Tensor:
        return self.logits(images, batch_size, serving).argmax(1)

    def predict_features(self, features: torch.Tensor, batch_size: int = 512) -> torch.Tensor:
        """The serving head's answers on `serving_features` of some images: what `predict` answers
        on those images, without a second pass through the network (the head runs on the same
        chunks), so one feature pass serves several heads (an evaluation's corrections)."""
        if self.stream_head is not None:
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

    @property
    def num_classes(self) -> int:
        return self.model.num_classes

    def ensure_classes(self, n: int) -> None:
        """Grow the head to at least n classes (new rows start from the default init)."""
        if n > self.model.num_classes:
            self.model.grow(n)
            if self.ema is not None:
                self.ema.grow(self.model)
            self.optimizer = self._make_optimizer()
            self.version += 1
            if self._served_copy is not None:  # the served copy answers the new classes too
                self.refresh_serving()

    def forget_class(self, class_id: int) -> int:
        """Forget a class: its samples leave the memory and its head output is silenced for good
        (a label sent again later must come as a new class id). Returns the memory samples removed."""
        self.forgotten.add(class_id)
        self._silence_forgotten()
        if self.stream_head is not None:
            self.stream_head.forget(class_id)
            self._solved = None
        self.version += 1
        buffer = getattr(self, "buffer", None)
        return buffer.remove_class(class_id) if buffer is not None else 0

    def _silence_forgotten(self) -> None:
        # a logit of -1e4 gets probability exactly 0 in float32 softmax, so the row also gets no
        # gradient; finite, so no inf - inf anywhere
        with torch.no_grad():
            for net in {self.model, self.averaged_model, self.serving_model}:
                rows = [c for c in self.forgotten if c < net.num_classes]
                net.head.weight[rows] = 0.0
                net.head.bias[rows] = FORGOTTEN_LOGIT

    def _make_optimizer(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.model.parameters(), lr=self.lr)

    # --- persistence -------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "method": self.name,
            "num_classes": self.model.num_classes,
            "model": self.model.state_dict(),
            "generator": self.generator.get_state(),
            "version": self.version,
            "steps": self.steps,
            "samples_seen": self.samples_seen,
            "samples_skipped": self.samples_skipped,
            "samples_thinned": self.samples_thinned,
            "rehearsal_steps": self.rehearsal_steps,
            "lean_steps": self.lean_steps,
            "forgotten": sorted(self.forgotten),
            "backbone": self.backbone.identity(),
            **({"ema": self.ema.state_dict()} if self.ema is not None else {}),
            **({"stream_head": self.stream_head.state_dict()} if self.stream_head is not None else {}),
        }

    def load_state_dict(self, state: dict) -> None:
        if state["method"] != self.name:
            raise ValueError(f"state is for method {state['method']!r}, this learner is {self.name!r}")
        saved = state.get("backbone", {"backbone": "scratch"})  # states from before backbones were scratch
        if saved != self.backbone.identity():
            raise ValueError(f"state was trained on backbone {saved}, this learner's is {self.backbone.identity()} "
                             f"(the backbone setting must match the data it resumes)")
        self.ensure_classes(state["num_classes"])
        self.model.load_state_dict(state["model"])
        self.optimizer = self._make_optimizer()
        self.generator.set_state(state["generator"])
        self.version = state["version"] + 1  # cached features from before the load are stale
        self.steps = state["steps"]
        self.samples_seen = state["samples_seen"]
        self.samples_skipped = state.get("samples_skipped", 0)  # absent from states written before them
        self.samples_thinned = state.get("samples_thinned", 0)
        self.rehearsal_steps = state.get("rehearsal_steps", 0)
        self.lean_steps = state.get("lean_steps", 0)
        self.forgotten = set(state.get("forgotten", ()))
        if self.ema is not None:  # a state saved without an average starts it from the weights
            self.ema.load_state_dict(state.get("ema"), self.model)
        if self.stream_head is not None and "stream_head" in state:
            self.stream_head.load_state_dict(state["stream_head"])
        self._solved = None
