"""The common frame of every method: a model, its optimizer (plain SGD, or Adam), and one `observe` step per batch.

A learner is fed uint8 images [b, 3, H, W] with integer labels, one mini-batch at a time,
each batch once. Labels beyond the head's width grow the head (a service does not know its
classes in advance). Task boundaries are optional hints (`begin_task`, `end_task`) that only
the task-aware baselines (AGEM, EWC, the retrieval trick) use. The backbone (`learner.networks.backbone`)
decides what trains and what the memory stores: the images themselves from scratch, or a frozen
pretrained part's latents; a learner takes either images or their stored form.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import asdict, replace

import torch
from torch.nn import functional as F

from ..heads.calibration import (
    FALSE_ALARM,
    FIRST_PRIOR_TEMPERATURE,
    FITTED_PRIOR_TEMPERATURE,
    PRIOR_TEMPERATURE,
    Calibration,
    unit_means,
)
from ..heads.ema import WeightAverage
from ..heads.head_choice import HeadChoice
from ..heads.held_back import HeldBack
from ..heads.recent_features import RecentFeatures
from ..heads.serving import Serving
from ..heads.streaming_lda import LinearHead, StreamingClassMeans, make_head
from ..memory.buffer import record_admitted, rows_of
from ..memory.latent import Latent
from ..memory.policy import StepContext
from ..networks.backbone import ScratchBackbone
from ..networks.reduced_resnet import ReducedResNet18
from .classes import HeadClasses
from .corrections import SampleCorrections
from .sleep import SleepConfig, Sleeper


def training_channels_last(device: torch.device, autocast_dtype: torch.dtype | None) -> bool:
    """The memory format that trains fastest: channels_last, except bf16 on CPU, where oneDNN's
    BatchNorm backward ran faster in NCHW on this project's machine."""
    return not (device.type == "cpu" and autocast_dtype == torch.bfloat16)


# where the served model's BatchNorm statistics come from: the moving average of the trained ones, or
# a pass of the averaged weights over the replay memory (`ContinualLearner.refresh_serving`)
SERVING_BN = ("average", "memory")
# what a learner counts, kept in its state
COUNTERS = ("steps", "samples_seen", "samples_skipped", "samples_thinned", "rehearsal_steps", "lean_steps",
            "suspects_kept_out")
# the weights version the frozen network's features are cached under: above any trained one, so that features of
# another space left in the memory's cache read as stale, and never stale themselves
FROZEN_SPACE_VERSION = 2**62
CALIBRATE_EVERY = 50  # steps between calibrations of a served trained top (a choice's: when it is measured)
# the step's form: the paper's plain SGD, or Adam (each parameter's step scaled by its gradient's running RMS)
OPTIMIZERS = ("sgd", "adam")


class ContinualLearner(Serving, HeadClasses, SampleCorrections):
    name = "learner"

    def __init__(self, num_classes: int, image_shape: tuple[int, int, int] = (3, 32, 32), lr: float = 0.1,
                 device: str | torch.device = "cpu", seed: int = 0, channels_last: bool | None = None,
                 autocast_dtype: torch.dtype | None = None, latent_dtype: torch.dtype | None = None,
                 compile: bool = False, ema_decay: float | None = None, serving_bn: str = "average",
                 serving_bias: bool = False, backbone=None, serving_head: str | None = None,
                 trained_head_from: int | None = None, choose_head: bool | str = False, head_prior: str | None = None,
                 train_every: int = 1, optimizer: str = "sgd", head_lr: float | None = None,
                 sleep: SleepConfig | None = None, sleep_store=None, calibrate: bool = False,
                 false_alarm: float = FALSE_ALARM, frozen_values: bool | None = None, suspect_rule: bool = False):
        self.device = torch.device(device)
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {optimizer!r}; choose one of {', '.join(OPTIMIZERS)}")
        self.optimizer_name = optimizer
        # the linear head's own rate (None: `lr`): a head that starts from random rows under a pretrained top
        # may need more than the top's blocks can take
        self.head_lr = head_lr
        if train_every < 0 or (train_every == 0 and sleep is None):
            raise ValueError(f"train_every must be >= 1 (or 0 with a sleep, which trains the top), got {train_every}")
        # a gradient step on one incoming batch in `train_every`: the others reach the memory and a streaming head
        # only, for a learner whose step costs more than the device can pay on every batch; 0: none (a sleep trains)
        self.train_every = train_every
        self.image_shape = tuple(image_shape)
        self.lr = lr
        if channels_last is None:
            channels_last = training_channels_last(self.device, autocast_dtype)
        # what trains and what the memory stores (`learner.networks.backbone`): by default the paper's network
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
        # built at the first step (`optimizer`): torch.optim's first call imports torch._dynamo (71 MB resident,
        # kept), which a learner whose top trains only in sleeps (a plain step there) never needs
        self._optimizer: torch.optim.Optimizer | None = None
        # serving weights: an average of the trained ones (`learner.heads.ema`), or the trained ones
        self.ema = WeightAverage(self.model, ema_decay) if ema_decay else None
        if serving_bn not in SERVING_BN:
            raise ValueError(f"unknown serving_bn {serving_bn!r}; choose one of {', '.join(SERVING_BN)}")
        if serving_bn == "memory" and not self.backbone.trains_bn:
            raise ValueError("serving_bn='memory' recomputes trained BatchNorm statistics; the pretrained top keeps "
                             "its own")
        self.serving_bn, self.serving_bias = serving_bn, serving_bias
        # a streaming head on the frozen features (`learner.heads.streaming_lda`) serves instead of the trained one
        if serving_head and not hasattr(self.backbone, "frozen_features"):
            raise ValueError("a streaming serving head needs frozen features: the pretrained backbone")
        self.stream_head = make_head(serving_head, self.model.feature_dim) if serving_head else None
        # the streaming head serves while a class is young, the trained one once every class has this many
        if trained_head_from is not None and (self.stream_head is None or trained_head_from < 1):
            raise ValueError("trained_head_from hands serving from a streaming head to the trained one: it needs "
                             "serving_head and a count of at least 1")
        self.trained_head_from = trained_head_from
        # or the stream measures, class by class, which head answers (`learner.heads.head_choice`): on the incoming
        # samples (True, "stream") or on samples held back from training ("held-back"), there with a `head_prior`
        if choose_head and (self.stream_head is None or trained_head_from is not None):
            raise ValueError("choose_head measures the streaming head against the trained one: it needs serving_head "
                             "and no trained_head_from")
        if head_prior is not None and choose_head != "held-back":
            raise ValueError("head_prior is the choice on held-back samples' prior: it needs choose_head='held-back'")
        measure = "stream" if choose_head is True else choose_head
        self.head_choice = HeadChoice(measure=measure, prior=head_prior) if choose_head else None
        # served probabilities divided by a temperature fitted on held-back samples, and "none of these"
        # (`learner.heads.calibration`): the choice's held-back samples, or a set of its own
        self.calibrate, self.false_alarm = calibrate, false_alarm
        # where ASER's values are taken (`values_frozen`): None, in the frozen network's space while the top does not
        # step awake, else in the top's
        self.frozen_values = frozen_values
        self.suspect_rule, self.suspects_kept_out = suspect_rule, 0  # `SampleCorrections.incoming_suspects`
        self.kept_out: set[int] = set()  # keys of the samples the rule kept out of the streaming head
        self._suspect_draws = torch.Generator().manual_seed(7919)  # apart from the training's: runs stay paired
        self.confirmed: set[int] = set()  # keys of samples a person said are labelled right: never suspects
        self._own_held = HeldBack() if calibrate and (self.head_choice is None or self.head_choice.held is None) \
            else None
        # more out-of-sample scores for "none of these"'s threshold than the held-back samples give; beside the frozen
        # features, the stored latents' channel means and their class sums (`Calibration.channel_distance`)
        scores_frozen = calibrate and self.stream_head is not None
        channels = (self.backbone.channels or 0) if scores_frozen else 0
        self.recent_features = RecentFeatures(channels=channels) if scores_frozen else None
        self.channel_sums = StreamingClassMeans(channels) if channels else None
        self._calibration: tuple | None = None  # (the solved head and the counts it was fitted at, the Calibration)
        # a sleep (`learner.methods.sleep`) trains the top over the latents of every sample trained on while idle
        self.sleeper = Sleeper(sleep, self.backbone.stored_shape, self.backbone.stored_dtype == torch.uint8, seed,
                               sleep_store) if sleep is not None else None
        if self.sleeper is not None and self.head_choice is not None and train_every == 0:
            self.head_choice.top_classes = self.sleeper.top_classes  # the top knows only what a sleep taught it
        self._solved = None  # (the class counts it was solved at, the solved streaming head)
        self._solves = 0  # how often it was solved: the held-back measure follows it (`held_measure_due`)
        self._incoming_batch = None  # (stored, frozen) of the batch being learned (`frozen_extract`)
        self._held_measured_at: tuple | None = None  # what the held-back samples were last measured on (`_held_key`)
        self._held_tops: tuple = (None, {})  # (weights version, classes), {id: (stored, the top's probabilities)}
        self._served_copy: ReducedResNet18 | None = None  # corrected on the memory (`refresh_serving`)
        self.generator = torch.Generator().manual_seed(seed)
        self.version = 0  # bumps with every weight change; names the weights features came from
        # bumps where the top's feature layers may change (a step, a load, weights put back), not where only the linear
        # head's rows do (a forgotten class, a correction): what the served top's onnxruntime graph is built from
        self.features_version = 0
        self.steps = 0
        self.samples_seen = 0
        self.samples_skipped = 0  # not trained on: a stream too fast (`pass_through` and `skip`)
        self.samples_thinned = 0  # of them, those that did not even reach the memory update (`skip`)
        self.rehearsal_steps = 0  # replay-only steps taken while the stream was idle
        self.lean_steps = 0  # of the stream steps, those taken lean (behind the stream)
        self.current_task_classes: torch.Tensor | None = None
        self.forgotten: set[int] = set()  # classes removed on request: never predicted again
        self._folded = None  # (version, {(id of the net, dtype): folded f_ext}) for inference
        self._top_graph = None  # ((features_version, id of the served net), the served top in onnxruntime)

    # --- the step ----------------------------------------------------------------------
    def observe(self, images: torch.Tensor, labels: torch.Tensor, lean: bool = False,
                encoded: tuple[torch.Tensor, torch.Tensor | None] | None = None,
                keys: torch.Tensor | None = None) -> dict:
        """Learn from one incoming mini-batch B_n (seen once). Returns step statistics.

        `lean`: the method's cheapest step (the replay methods: one iteration, no augmentation, the
        memory policies' lean forms), for a learner behind its stream (`learner.catch_up`): more of
        the stream gets a step. `encoded`: the batch's `encode_incoming`, where the caller has it. With
        `train_every` k, only every k-th call steps; the others update the memory (and a streaming head) alone.
        `steps` counts the calls. `keys`: the caller's id of each sample (a service's sequence numbers), kept with
        the memory's slots (`ReplayBuffer.keys`: what `correct_sample` finds a sample by)."""
        pixels = images.to(self.device)
        images, frozen = encoded if encoded is not None else self.encode_incoming(pixels)
        labels = labels.to(self.device, torch.long)
        self.ensure_classes(int(labels.max()) + 1)
        trains = self.train_every > 0 and self.steps % self.train_every == 0
        if self.head_choice is not None and trains:  # scored where the top steps: a skipped step saves its forward
            self._score_heads(images, frozen, labels)
        if self.held_back is not None:
            pixels, images, frozen, labels, keys = self._hold_back(pixels, images, frozen, labels, keys)
            if not labels.numel():  # all held back: nothing trains, the call still counts
                self.steps += 1
                return {}
        self._update_stream_head(frozen, labels, keys, images)
        self._keep_for_sleep(images, labels, keys)
        with record_admitted(getattr(self, "buffer", None), pixels, images, keys, *self._admitted_features(frozen)), \
                self._incoming(images, frozen):
            if not trains:
                self._pass_through(images, labels, lean)
                stats = {}
            else:
                stats = self._lean_observe(images, labels) if lean else self._observe(images, labels)
        self.lean_steps += lean and trains
        if self.forgotten:
            self._silence_forgotten()  # whatever the method's step did to those rows
        self.steps += 1
        self.samples_seen += images.shape[0]
        return stats

    def encode_incoming(self, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Incoming images -> their stored form, and the frozen features a streaming head reads (one
        frozen pass for both), or None without one. What `observe` and a service's predictions start from."""
        if self.stream_head is None:
            return self.encode(pixels), None
        return self.backbone.encode_with_features(pixels)

    def _score_heads(self, stored: torch.Tensor, frozen: torch.Tensor, labels: torch.Tensor) -> None:
        """Test, then train: each candidate head answers the samples of classes it has seen, before the step."""
        seen = torch.zeros(self.num_classes, dtype=torch.bool)
        counts = self.stream_head.counts[:self.num_classes]
        seen[:len(counts)] = counts > 0
        known = seen[labels.cpu()].to(labels.device)
        if bool(known.any()):
            self.head_choice.score(self.head_probabilities(stored[known], frozen[known]), labels[known])

    def _hold_back(self, pixels, images, frozen, labels, keys=None):
        """Keep the samples `learner.heads.held_back` picks out of every head's training, choose the heads on
        all those held every `measure_every` steps and when a class arrives, and return the batch that trains."""
        arrival = self.held_back.brings_new_class(labels.cpu())
        held = self.held_back.hold_back(labels.cpu()).to(labels.device)
        if bool(held.any()):
            self.held_back.keep(images[held], frozen[held] if frozen is not None else images[held], labels[held])
            self.samples_seen += int(held.sum())
        # a class's arrival makes it young, which bars the top alone: at once, not at the next mark
        if self.head_choice is not None and (arrival or self.steps % self.head_choice.measure_every == 0):
            self.measure_held()
        keep = ~held
        return (pixels[keep], images[keep], frozen[keep] if frozen is not None else None, labels[keep],
                None if keys is None else keys[keep.cpu()])

    def measure_held(self) -> bool:
        """Under a choice on held-back samples: fit the pool and choose each class's head on all of them, with the
        weights as they are now (once a weights version); returns whether it measured. The step does it every
        `measure_every` steps, an evaluation in process (`candidate_probabilities`) and an idle service before they
        answer, since the top moves within a task."""
        choice = self.head_choice
        if choice is None or choice.held is None:
            return False
        if self.stream_head is not None:
            # streaming LDA as it answers now: a solve it owes (young classes' means move with every sample) is what
            # the measure must read; counted only once made, it would leave the choice as the last solve had it
            self.solved_head()
        if not self.held_measure_due:
            return False
        stored, features, labels = choice.held.stacked()
        choice.choose_on_held(self.head_probabilities(stored, features, top=self.held_top_probabilities()), labels)
        self._held_measured_at = self._held_key()
        return True

    def _held_key(self) -> tuple:
        """What a measure on the held-back samples reads: the weights, the samples held of each class and streaming
        LDA as solved. Awake, a top trained only in sleeps stays while streaming LDA learns young classes: the pool's
        weight and temperature are fitted again as it does, not left as the last sleep fitted them."""
        held = self.head_choice.held
        return self.version, tuple((c, len(s)) for c, s in sorted(held.samples.items())), self._solves

    def held_top_probabilities(self) -> torch.Tensor:
        """The top's probabilities of the held-back samples (in `HeldBack.stacked` order), each computed once a
        weights version: a measure while the top does not move passes only the samples held since."""
        key = (self.version, self.num_classes)
        if self._held_tops[0] != key:
            self._held_tops = (key, {})
        cache = self._held_tops[1]
        stored = [s for _, held in sorted(self.held_back.samples.items()) for s, _ in held]
        new = [s for s in stored if id(s) not in cache]  # the cache holds each tensor: its id stays its own
        if new:
            cache.update({id(s): (s, p) for s, p in zip(new, self.top_probabilities(torch.stack(new).to(self.device)))})
        return torch.stack([cache[id(s)][1] for s in stored])

    @property
    def held_back(self) -> HeldBack | None:
        """The samples kept out of every head's training: the head choice's, or calibration's own."""
        if self.head_choice is not None and self.head_choice.held is not None:
            return self.head_choice.held
        return self._own_held

    def calibration(self, solve: bool = True) -> Calibration | None:
        """With `calibrate`: the temperature and "none of these" fitted on the held-back samples' served answers, fitted
        again when the served head or the samples have changed; None without."""
        if not self.calibrate:
            return None
        solved = self.solved_head(solve) if self.stream_head is not None else None
        # the trained top's answers move every step: measured with the choice, or every CALIBRATE_EVERY steps
        top = (None if self.streams else self._held_measured_at if self.head_choice is not None
               else self.steps // CALIBRATE_EVERY)
        offered = self.held_back.offered
        # fitted again as the samples offered grow by a fifth, not at every batch
        key = (len(self.held_back), len(self.held_back.seen), int(4 * math.log2(offered + 2)), top, self.num_classes,
               len(self.forgotten))
        if self._calibration is None or self._calibration[0] is not solved or self._calibration[1] != key:
            self._calibration = (solved, key, self._fit_calibration())
        return replace(self._calibration[2], floor=1 / (self.held_back.offered_since_newest + 2))

    def _fit_calibration(self) -> Calibration:
        held = self.held_back
        means = None if self.stream_head is None else \
            unit_means(self.stream_head.sums, self.stream_head.counts, self.num_classes)
        live = torch.zeros(self.num_classes, dtype=torch.bool)
        live[[c for c in held.seen if c < self.num_classes]] = True  # offered, not forgotten
        reads_top = self.head_choice is not None and self.head_choice.reads_top(self.num_classes)
        blind, stream_logits = None, None
        if len(held):
            stored, frozen, labels = held.stacked()
            frozen = frozen if self.stream_head is not None else None
            if reads_top and self.stream_head is not None:  # one pass: the served answer and streaming LDA's
                probabilities = self.head_probabilities(stored.to(self.device), frozen,
                                                        top=self.held_top_probabilities())
                logits = self.head_choice.compose(probabilities).clamp_min(1e-30).log()  # as `served_logits`
                blind = self.head_choice.blind_columns(self.num_classes)  # `calibration.blind_answers`
                stream_logits = probabilities["slda"].clamp_min(1e-30).log()
            else:
                logits = self.served_logits(stored.to(self.device), frozen,
                                            self.held_top_probabilities() if reads_top else None).cpu()
        else:
            logits, frozen, labels = torch.zeros(0, self.num_classes), None, torch.zeros(0, dtype=torch.long)
        known = None if self.recent_features is None else \
            self.recent_features.distances(self.stream_head.sums, self.stream_head.counts, means)
        channels, channel_means, known_channels = self._channel_parts(live, stored if len(held) else None)
        return Calibration.fit(logits, labels, held.offered_since_newest, live, frozen, means, self.false_alarm,
                               self._calibration_prior(reads_top), known, blind, stream_logits, channels,
                               channel_means, known_channels)

    def _channel_parts(self, live: torch.Tensor, stored: torch.Tensor | None) -> tuple:
        """What "none of these" reads of the stored latents' channel means (`Calibration.fit`): the held-back
        samples', the classes' unit means and the recent samples' distances out of sample; none until every live
        class has them (a state saved before they were kept has none for the classes it held)."""
        sums = self.channel_sums
        if sums is None or stored is None:
            return None, None, None
        counts = torch.zeros(len(live), dtype=torch.float64)
        counts[:min(len(live), len(sums.counts))] = sums.counts[:len(live)]
        if bool((counts[live] <= 0).any()):
            return None, None, None
        means = unit_means(sums.sums, sums.counts, self.num_classes)
        channels = self.backbone.channel_means(stored).cpu()
        return channels, means, self.recent_features.channel_distances(sums.sums, sums.counts, means)

    def _calibration_prior(self, reads_top: bool) -> float:
        """The temperature's prior for what is served: logits whose scale a likelihood fit set already (the trained
        top's log-probabilities; the pool's temperature, fitted on these same held-back samples), streaming LDA's, or,
        while nothing is held back yet (every class under 20 samples), its nearest class means'."""
        if reads_top or (self.head_choice is not None and self.head_choice.serves_fitted_pool(self.num_classes)):
            return FITTED_PRIOR_TEMPERATURE
        if self.stream_head is not None and not len(self.held_back):
            return FIRST_PRIOR_TEMPERATURE
        return PRIOR_TEMPERATURE

    @property
    def held_measure_due(self) -> bool:
        """Whether held-back samples are there to measure and what a measure reads (`_held_key`) changed since the
        last."""
        choice = self.head_choice
        return (choice is not None and choice.held is not None and bool(choice.held.measured())
                and self._held_measured_at != self._held_key())

    def warm_up(self) -> None:
        """Build what the first step would (the frozen part's onnxruntime session: its trace passes through
        the heap), while the process is small: a service's peak memory then does not stack it on the rest."""
        size = self.backbone.input_size
        self.encode_incoming(torch.zeros(1, 3, size, size, dtype=torch.uint8, device=self.device))

    def _update_stream_head(self, frozen: torch.Tensor | None, labels: torch.Tensor,
                            keys: torch.Tensor | None = None, stored: torch.Tensor | None = None) -> None:
        """Every sample the learner sees, trained on or passed through, reaches the streaming head (but those the
        suspect rule keeps out, whose keys it remembers: a correction puts them in)."""
        if self.stream_head is None:
            return
        if self.suspect_rule:
            keep = ~self.incoming_suspects(frozen, labels).to(labels.device)
            self.suspects_kept_out += int((~keep).sum())
            if keys is not None:
                self.kept_out.update(keys[~keep.cpu()].tolist())
            frozen, labels, stored = frozen[keep], labels[keep], None if stored is None else stored[keep]
            keys = keys[keep.cpu()] if keys is not None else None
            if not labels.numel():
                return
        self.stream_head.update(frozen, labels)
        channels = None
        if self.channel_sums is not None:
            channels = self.backbone.channel_means(stored)
            self.channel_sums.update(channels, labels)
        if self.recent_features is not None:
            self.recent_features.keep(frozen, labels, keys, channels)

    def _keep_for_sleep(self, stored: torch.Tensor, labels: torch.Tensor, keys: torch.Tensor | None = None) -> None:
        if self.sleeper is not None:
            self.sleeper.store.add(stored, labels, keys)

    def refill_sleep_store(self, pixels: torch.Tensor, labels: torch.Tensor, keys: torch.Tensor) -> int:
        """Samples already learned, added again to a sleep's store whose file was lost (a device's damaged flash): their
        stored form as `observe` keeps it, the held-back samples left out as it leaves them (matched by their stored
        form, which the frozen part gives again bit for bit). The store's arrivals so far count as slept on. Returns
        how many were added."""
        stored = self.encode(pixels.to(self.device)).cpu()
        keep = torch.ones(len(labels), dtype=torch.bool)
        if self.held_back is not None and len(self.held_back):
            held = {s.numpy().tobytes() for s in self.held_back.stacked()[0]}
            keep = torch.tensor([s.numpy().tobytes() not in held for s in stored], dtype=torch.bool)
        if bool(keep.any()):
            self.sleeper.store.add(stored[keep].to(self.device), labels[keep].to(self.device), keys[keep])
        self.sleeper.mark = self.sleeper.fresh_mark = self.sleeper.store.arrived
        return int(keep.sum())

    def sleep(self, budget: int | None = None, should_yield=None, fresh: bool = False):
        """Train the top over what the device holds (`learner.methods.sleep`): `budget` sample-updates (by default
        the sleep's epochs times the samples new since the last, plus what a yielded one owes; `fresh`: the top
        started again from its initial weights, the epochs over everything held); a `SleepReport`."""
        if self.sleeper is None:
            raise ValueError("this learner has no sleep: build it with sleep=SleepConfig(...)")
        return self.sleeper.run(self, budget, should_yield, fresh)

    def restart_top(self, seed: int) -> None:
        """The trained weights back to the backbone's initial ones (a pretrained top: ImageNet's, a new linear head
        drawn from `seed`), the serving average with them; forgotten classes stay silent."""
        initial = self.backbone.make_model(self.model.num_classes, seed)
        self.model.load_state_dict(initial.state_dict())
        if self.forgotten:
            self._silence_forgotten()
        if self.ema is not None:
            self.ema.load_state_dict(None, self.model)
        self._optimizer = None  # moments of the weights that are gone
        self.weights_changed()

    def _observe(self, images: torch.Tensor, labels: torch.Tensor) -> dict:
        raise NotImplementedError

    def _lean_observe(self, images: torch.Tensor, labels: torch.Tensor) -> dict:
        return self._observe(images, labels)  # a method without costly options has one form

    def pass_through(self, images: torch.Tensor, labels: torch.Tensor, batch_size: int | None = None,
                     lean: bool = False, keys: torch.Tensor | None = None) -> None:
        """Let samples the learner has no time to train on reach the memory only: no gradient
        step, but the memory update sees them as it sees every sample (so the memory keeps
        sampling the whole stream), `batch_size` at a time (the stream's batch: KNN-SV then scores
        a skipped sample among as many candidates as a trained one); `lean`: through the update's
        lean form, as a lean step would. A learner without a memory only counts them."""
        pixels = images.to(self.device)
        (images, frozen), labels = self.encode_incoming(pixels), labels.to(self.device, torch.long)
        self.ensure_classes(int(labels.max()) + 1)
        self._update_stream_head(frozen, labels, keys, images)
        self._keep_for_sleep(images, labels, keys)
        step = batch_size or labels.numel()
        for i in range(0, labels.numel(), step):
            part = None if keys is None else keys[i:i + step]
            frozen_part = None if frozen is None else frozen[i:i + step]
            with record_admitted(getattr(self, "buffer", None), pixels[i:i + step], images[i:i + step], part,
                                 *self._admitted_features(frozen_part)):
                with self._incoming(images[i:i + step], frozen_part):
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
    @property
    def values_frozen(self) -> bool:
        """Whether ASER's values are taken in the frozen network's feature space (`frozen_values`; unset: where the
        top trains only in sleeps, `train_every` 0, and a streaming head reads those features: every incoming sample
        has them already, and the top's own would cost a second pass over the upper blocks for a space no step
        uses)."""
        if self.stream_head is None:
            return False
        return self.train_every == 0 if self.frozen_values is None else self.frozen_values

    @contextmanager
    def _incoming(self, stored: torch.Tensor, frozen: torch.Tensor | None):
        """The batch being learned and its frozen features, which `frozen_extract` hands back instead of recomputing."""
        self._incoming_batch = (stored, frozen)
        try:
            yield
        finally:
            self._incoming_batch = None

    def _admitted_features(self, frozen: torch.Tensor | None) -> tuple[torch.Tensor | None, int]:
        """What `record_admitted` caches for the slots a step fills: in the frozen space, the batch's features."""
        return (frozen, FROZEN_SPACE_VERSION) if frozen is not None and self.values_frozen else (None, -1)

    def frozen_extract(self, stored: torch.Tensor) -> torch.Tensor:
        """The frozen network's pooled features of stored latents: the incoming batch's as already computed (the
        batch itself, or rows of it: the slots a step filled before its memory update valued them)."""
        incoming = self._incoming_batch
        if incoming is not None and incoming[1] is not None:
            batch, features = incoming
            if stored.shape == batch.shape and stored.data_ptr() == batch.data_ptr():
                return features.float()
            if 0 < len(stored) <= len(batch) and stored.shape[1:] == batch.shape[1:]:
                found, at = rows_of(stored, batch)
                if bool(found.all()):
                    return features[at.to(features.device)].float()
        return self.frozen_features(stored).float()

    def step_context(self, buffer, eligible: torch.Tensor | None = None) -> StepContext:
        """What memory policies see of this learner during a step, under the current weights (or, `values_frozen`,
        in the frozen network's space)."""
        latent = Latent(self.frozen_extract, buffer, FROZEN_SPACE_VERSION) if self.values_frozen \
            else Latent(self.extract, buffer, self.version)
        return StepContext(latent=latent, generator=self.generator,
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
        """One optimizer step on the loss `loss_fn()` computes."""
        self.optimizer.zero_grad(set_to_none=True)
        loss = loss_fn()
        loss.backward()
        self.optimizer.step()
        self.weights_changed()
        return loss.detach()

    def weights_changed(self) -> None:
        """After every optimizer step: a new weights version, and the serving average follows."""
        self.version += 1
        self.features_version += 1
        if self.ema is not None:
            self.ema.update(self.model)

    def rename_weights(self, above: int = 0) -> None:
        """A new `version` without a step (and above `above`), for a served copy corrected while idle
        or a lineage restarted past numbers it served before: whoever keys on the version (a cache,
        a snapshot's metadata) sees the change; cached features look older by as much."""
        self.version = max(self.version, above) + 1
        self.features_version += 1

    def sgd_step(self, images: torch.Tensor, labels: torch.Tensor, extra_loss=None) -> torch.Tensor:
        """One SGD step on the mean cross-entropy of (images, labels) (plus `extra_loss()`)."""
        if extra_loss is None:
            return self.optimize(lambda: self.loss(images, labels))
        return self.optimize(lambda: self.loss(images, labels) + extra_loss())

    def extract(self, images: torch.Tensor, batch_size: int = 512) -> torch.Tensor:
        """f_ext of the trained weights in eval mode, no autograd: uint8 images -> latent features
        (float32). What the memory policies see."""
        return self._eval_map(self.inference_features(self.latent_dtype, serving=False), images, batch_size)

    def teacher_logits(self, images: torch.Tensor) -> torch.Tensor:
        """The moving average's eval-mode logits of uint8 images, without gradients (the
        distillation teacher, `learner.methods.objective`)."""
        with torch.no_grad(), self._autocast():
            return self.averaged_model(self.to_input(images)).float()

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        if self._optimizer is None:
            self._optimizer = self._make_optimizer()
        return self._optimizer

    def _make_optimizer(self, carry_from: torch.optim.Optimizer | None = None) -> torch.optim.Optimizer:
        """A new optimizer over the model's parameters; `carry_from`'s state goes on for those it had (a head
        that grew has new ones: only their moments start afresh)."""
        params = list(self.model.parameters())
        head = list(self.model.head.parameters())
        in_head = {id(p) for p in head}
        groups = [{"params": [p for p in params if id(p) not in in_head]}, {"params": head, "lr": self.head_lr or self.lr}]
        if self.optimizer_name == "adam":
            optimizer = torch.optim.Adam(groups, lr=self.lr)
        else:
            optimizer = torch.optim.SGD(groups, lr=self.lr)
        if carry_from is not None:
            for p in params:
                if p in carry_from.state:
                    optimizer.state[p] = carry_from.state[p]
        return optimizer

    # --- persistence -------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "method": self.name,
            "num_classes": self.model.num_classes,
            "model": self.model.state_dict(),
            "generator": self.generator.get_state(),
            "version": self.version,
            **{name: getattr(self, name) for name in COUNTERS},
            "forgotten": sorted(self.forgotten),
            **({"confirmed": sorted(self.confirmed)} if self.confirmed else {}),
            **({"kept_out": sorted(self.kept_out)} if self.kept_out else {}),
            "backbone": self.backbone.identity(),
            **({"ema": self.ema.state_dict()} if self.ema is not None else {}),
            **({"stream_head": self.stream_head.state_dict()} if self.stream_head is not None else {}),
            # the head as solved last: a resumed learner answers as the one that went on
            **({"solved_head": {"counts": self._solved[0], **asdict(self._solved[1])}} if self._solved else {}),
            **({"head_choice": self.head_choice.state_dict()} if self.head_choice is not None else {}),
            **({"held_back": self._own_held.state_dict()} if self._own_held is not None else {}),
            **({"recent_features": self.recent_features.state_dict()} if self.recent_features is not None else {}),
            **({"channel_sums": self.channel_sums.state_dict()} if self.channel_sums is not None else {}),
            **({"sleeper": self.sleeper.state_dict()} if self.sleeper is not None else {}),
            # plain SGD keeps no state; Adam's moments go on where the learner resumes
            **({"optimizer": {"kind": self.optimizer_name, "state": self.optimizer.state_dict()}}
               if self.optimizer_name != "sgd" else {}),
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
        self._optimizer = None
        saved_optimizer = state.get("optimizer")
        if saved_optimizer and saved_optimizer["kind"] == self.optimizer_name:  # another kind starts afresh
            self.optimizer.load_state_dict(saved_optimizer["state"])
        self.generator.set_state(state["generator"])
        self.version = state["version"] + 1  # cached features from before the load are stale
        self.features_version += 1
        for name in COUNTERS:  # the later ones are absent from states written before them
            setattr(self, name, state.get(name, 0))
        self.forgotten = set(state.get("forgotten", ()))
        self.confirmed = set(state.get("confirmed", ()))
        self.kept_out = set(state.get("kept_out", ()))
        if self.ema is not None:  # a state saved without an average starts it from the weights
            self.ema.load_state_dict(state.get("ema"), self.model)
        if self.stream_head is not None and "stream_head" in state:
            self.stream_head.load_state_dict(state["stream_head"])
        if self.head_choice is not None and "head_choice" in state:
            self.head_choice.load_state_dict(state["head_choice"])
        # the samples kept out of every head's training go on with whichever head now keeps them: a restart under
        # another head (ASER_HEAD, ASER_TRAINED_HEAD_FROM) neither trains on them nor forgets which classes came
        held = state.get("held_back", state.get("head_choice", {}).get("held"))
        loaded = self._own_held is None and "held" in state.get("head_choice", {})  # by the choice, above
        if held is not None and self.held_back is not None and not loaded:
            self.held_back.load_state_dict(held)
        if self.recent_features is not None:  # a state from before them: none kept yet
            self.recent_features.load_state_dict(state.get("recent_features", {}))
        if self.channel_sums is not None and "channel_sums" in state:  # before them: the classes that come again
            self.channel_sums.load_state_dict(state["channel_sums"])  # have them (`_channel_parts`)
        self._calibration = None
        if self.sleeper is not None and "sleeper" in state:
            self.sleeper.load_state_dict(state["sleeper"])
        solved = state.get("solved_head")
        self._solved = (solved["counts"], LinearHead(solved["class_ids"], solved["weight"], solved["bias"])) \
            if solved and self.stream_head is not None else None
