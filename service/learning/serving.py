"""What readers of a running learner see, replaced whole between two steps: the predictor (an
immutable inference model) and a copy of the replay memory (`Published`), kept up to the learner
by the `Publisher` (the served copy's corrections on the memory, the NCM head, the version lease).

A predictor takes uint8 pixels to class probabilities through the learner's served path
(`ContinualLearner.encode_incoming`, `encoded_features` and `served_head`): the folded network from scratch; on
the pretrained backbone the frozen part (once, in onnxruntime), the latent as stored and the top's features, or the
frozen features under streaming LDA, or both under a measured choice of head (`served_choice`; the frozen ones
alone while no class reads the top). Training never changes one already published.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass

import torch

from learner.heads.calibration import Calibration
from learner.heads.head_choice import UNFITTED_POOL, reads_top, serve
from learner.heads.ncm import ncm_head
from learner.methods.base import ContinualLearner
from service.storage.checkpoints import VersionLease
from service.storage.errors import StorageFull

log = logging.getLogger("aser.worker")


@dataclass(frozen=True)
class Predictor:
    """An immutable inference model and the progress it stands for."""

    encode: object  # uint8 pixels -> (stored form, frozen features or None): the frozen part, run once
    features: object  # (stored form, frozen features) -> the features the head reads (None: a choice not reading it)
    head_weight: torch.Tensor
    head_bias: torch.Tensor
    classes: tuple[str | None, ...]  # by class id; None: forgotten
    version: int
    steps: int
    samples_trained: int
    trained_upto: int
    samples_skipped: int = 0
    samples_thinned: int = 0
    rehearsal_steps: int = 0
    lean_steps: int = 0
    normalize: bool = False  # the head takes unit-norm features (the NCM head)
    streams: bool = False  # a streaming head on the frozen features answers (`ContinualLearner.streams`)
    # under a measured choice (`ContinualLearner.served_choice`): streaming LDA's rows on the frozen features, each
    # class's head (`learner.heads.head_choice.CANDIDATES`) and what the stream measured of each (`HeadChoice.summary`)
    stream_head: tuple[torch.Tensor, torch.Tensor] | None = None
    choice: torch.Tensor | None = None
    choice_summary: dict | None = None
    pool: tuple = UNFITTED_POOL  # the pooled candidate's (weight a class, temperature): `HeadChoice.pool_of`
    # the temperature and "none of these" fitted on the held-back samples (`ContinualLearner.calibration`), or None
    calibration: Calibration | None = None
    channel_means: object = None  # stored form -> its channel means (`PretrainedBackbone.channel_means`)

    @classmethod
    def from_learner(cls, learner: ContinualLearner, classes: list[str], trained_upto: int,
                     ncm: tuple[torch.Tensor, torch.Tensor] | None = None, solve: bool = True) -> "Predictor":
        """The learner's served head, or `ncm` (`learner.heads.ncm.ncm_head`) on unit-norm features; `solve`: the
        streaming head solved again where due (else as solved last)."""
        weight, bias = ncm if ncm is not None else learner.served_head(solve)
        # classes ingested but not yet trained on have no head row yet; they are not answered
        n = min(len(classes), weight.shape[0])
        chosen = learner.served_choice(solve) if ncm is None else None
        pool = UNFITTED_POOL if chosen is None else learner.head_choice.pool_of(learner.num_classes)
        # a choice that reads no top's answer needs no copy of the top (`answers_encoded`)
        features = learner.encoded_features() if chosen is None or reads_top(chosen[2][:n], pool[0][:n]) else None
        return cls(learner.encode_incoming, features, weight.detach()[:n].clone(),
                   bias.detach()[:n].clone(), tuple(classes[:n]), learner.version, learner.steps, learner.samples_seen,
                   trained_upto, learner.samples_skipped, learner.samples_thinned, learner.rehearsal_steps,
                   learner.lean_steps, normalize=ncm is not None, streams=ncm is None and learner.streams,
                   stream_head=None if chosen is None else (chosen[0][:n].clone(), chosen[1][:n].clone()),
                   choice=None if chosen is None else chosen[2][:n].clone(),
                   choice_summary=None if chosen is None else learner.head_choice.summary(),
                   pool=(pool[0][:n].clone(), pool[1]) if chosen is not None else pool,
                   calibration=None if ncm is not None else learner.calibration(solve),
                   channel_means=learner.backbone.channel_means)

    @property
    def head_name(self) -> str:
        """The head answering: slda (streaming LDA on the frozen features), ncm, softmax (the trained one),
        or chosen (each class by the head the stream measured best on it)."""
        return "chosen" if self.choice is not None else "slda" if self.streams else "ncm" if self.normalize \
            else "softmax"

    @property
    def labels(self) -> tuple[str, ...]:
        """The classes it answers (learned, not forgotten)."""
        return tuple(c for c in self.classes if c is not None)

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        """Rows of uint8 images' class probabilities, each with its "none of these" score last (`answers`)."""
        probabilities, scores = self.answers(images)
        return torch.cat([probabilities, scores[:, None]], 1)

    def answers(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Class probabilities of uint8 images [n, 3, H, W] and their "none of these" scores (NaN without a
        calibration), on the CPU whatever device the model is on."""
        with torch.inference_mode():
            return self.answers_encoded(*self.encode(images.to(self.head_weight.device)))

    def probabilities(self, images: torch.Tensor) -> torch.Tensor:
        return self.answers(images)[0]

    def answers_encoded(self, stored: torch.Tensor, frozen: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """`answers` of images already through `encode` (the learner's own step encodes once)."""
        with torch.inference_mode():
            stream = None
            if self.choice is None:
                logits = self._head_logits(stored, frozen)
            else:
                streaming = torch.softmax(torch.nn.functional.linear(frozen.to(self.head_weight.device).float(),
                                                                     *self.stream_head), 1)
                # no class reads the top (before a sleep): the same answers without its pass over the upper stages
                top = torch.softmax(self._head_logits(stored, frozen), 1) if self.reads_top else None
                logits = serve(streaming, top, self.choice, self.pool).clamp_min(1e-30).log()
                stream = streaming.clamp_min(1e-30).log()
            if self.calibration is None:
                probabilities = torch.softmax(logits, 1)
                return probabilities.cpu(), torch.full((len(logits),), float("nan"))
            probabilities = self.calibration.probabilities(logits, stream=stream)
            channels = None if self.calibration.parts is None else self.channel_means(stored)
            return probabilities.cpu(), self.calibration.unknown_score(probabilities, frozen, channels).cpu()

    def _head_logits(self, stored: torch.Tensor, frozen: torch.Tensor | None) -> torch.Tensor:
        features = self.features(stored, frozen).float()
        if self.normalize:
            features = torch.nn.functional.normalize(features, dim=1)
        return torch.nn.functional.linear(features, self.head_weight, self.head_bias)

    @property
    def reads_top(self) -> bool:
        """Under a measured choice, whether its answers read the top's (`learner.heads.head_choice.reads_top`):
        `from_learner` keeps the top's features only then."""
        return self.choice is not None and self.features is not None


@dataclass(frozen=True)
class MemoryView:
    """A copy of the replay memory as of one step: class id, stream position and a picture per slot
    (the pixels themselves from scratch; on the pretrained backbone, whose slots hold latents, the
    small picture kept of each, `ReplayBuffer.pictures`)."""

    class_ids: tuple[int, ...]
    entered: tuple[int, ...]  # samples trained when the slot was written
    images: torch.Tensor  # uint8 [size, 3, H, W]
    seqs: tuple[int, ...] = ()  # the ingest log's sequence number of each slot's sample (-1: not known)

    @classmethod
    def of(cls, learner: ContinualLearner) -> "MemoryView":
        buffer = getattr(learner, "buffer", None)
        if buffer is None:
            return cls((), (), torch.zeros(0, dtype=torch.uint8), ())
        n = buffer.size
        pictures = buffer.pictures if buffer.images.dtype != torch.uint8 or buffer.images.dim() != 4 else buffer.images
        if pictures is None:  # a latent memory restored from before pictures were kept
            pictures = torch.zeros((buffer.capacity, 3, 1, 1), dtype=torch.uint8)
        return cls(tuple(buffer.labels[:n].tolist()), tuple(buffer.entered[:n].tolist()), pictures[:n].cpu().clone(),
                   tuple(buffer.keys[:n].tolist()))

    def class_counts(self) -> dict[int, int]:
        return dict(sorted(Counter(self.class_ids).items()))


class MemoryDerived:
    """When something derived from the memory (the NCM head, the served copy's corrections) is
    remade: every `every` steps of progress, and whenever the memory's classes change."""

    def __init__(self, every: int):
        self.every, self.at, self.classes = every, -(10**9), set()

    def due(self, progress: int, classes: set[int], force: bool = False) -> bool:
        return force or progress - self.at >= self.every or classes != self.classes

    def made(self, progress: int, classes: set[int]) -> None:
        self.at, self.classes = progress, classes


@dataclass(frozen=True)
class Published:
    """What readers see of the learner after one step: its predictor and its memory, together."""

    predictor: Predictor
    memory: MemoryView
    current: bool = True  # the served corrections are those of the learner's latest step


class Publisher:
    """Keeps what readers see up to the learner, between two steps: with ASER_SERVING_BN=memory or
    ASER_SERVING_BIAS the served copy corrected on the memory (`ContinualLearner.refresh_serving`), with
    ASER_HEAD=ncm the class means of the memory, each every N steps of progress and whenever the memory's
    classes change; then one `Published`, swapped whole, its version reserved first (`VersionLease`)."""

    def __init__(self, versions: VersionLease, ncm: bool, serving_refresh_steps: int, ncm_refresh_steps: int):
        self.versions, self.ncm = versions, ncm
        self.serving_refresh_steps, self.ncm_refresh_steps = serving_refresh_steps, ncm_refresh_steps
        self.published: Published | None = None
        self.restart()

    def restart(self) -> None:
        """A learner (re)loaded from a checkpoint: everything derived from the memory is remade."""
        self._ncm_head, self._ncm_made = None, MemoryDerived(self.ncm_refresh_steps)
        self._served_made = MemoryDerived(self.serving_refresh_steps)

    def publish(self, learner: ContinualLearner, classes: list[str | None], trained_upto: int, progress: int,
                refresh: bool = False, solve: bool = True) -> None:
        """Bring the corrections due up to `learner` (all of them with `refresh`) and publish it; `solve`
        False: the streaming head as solved last (`Predictor.from_learner`)."""
        self._refresh_serving(learner, progress, refresh)
        self._refresh_ncm_head(learner, progress, refresh)
        try:
            self.versions.cover(learner.version)
        except StorageFull:  # the database logs the episode; learning and serving go on, reserved once space returns
            pass
        known = set(self.published.predictor.labels) if self.published is not None else None
        # one object, one swap: a reader never sees the model of one step beside the memory of another
        self.published = Published(Predictor.from_learner(learner, classes, trained_upto, self._ncm_head, solve),
                                   MemoryView.of(learner), self.current(learner, progress))
        if known is not None:
            labels = self.published.predictor.labels
            for label in sorted(set(labels) - known):
                log.info("learner: new class %r (%d classes, step %d)", label, len(labels), learner.steps)

    def current(self, learner: ContinualLearner, progress: int) -> bool:
        """Whether the served copy carries the corrections of the learner's latest step, and the choice of heads
        on held-back samples (`ContinualLearner.measure_held`) was measured on its weights."""
        return self._corrected(learner, progress) and not learner.held_measure_due

    def _corrected(self, learner: ContinualLearner, progress: int) -> bool:
        return not _corrects_serving(learner) or self._served_made.at == progress

    def correct_now(self, learner: ContinualLearner, progress: int) -> bool:
        """The served copy's corrections and choice of heads brought up to the learner now, under a new weights
        version (other answers from the same step); False when they were current already."""
        if self.current(learner, progress):
            return False
        if not self._corrected(learner, progress):
            self._refresh_serving(learner, progress, force=True)
        learner.rename_weights()
        learner.measure_held()  # under the new version: the choice changes what is served too
        return True

    def _refresh_serving(self, learner: ContinualLearner, progress: int, force: bool) -> None:
        if not _corrects_serving(learner):
            return
        classes = _memory_classes(learner)
        if self._served_made.due(progress, classes, force):
            learner.refresh_serving()
            self._served_made.made(progress, classes)

    def _refresh_ncm_head(self, learner: ContinualLearner, progress: int, force: bool) -> None:
        """The class means from a feature pass over the memory: a new class is answered at once, a
        forgotten one never again."""
        if not self.ncm:
            return
        classes = _memory_classes(learner)
        if self._ncm_made.due(progress, classes, force):
            self._ncm_head = ncm_head(learner)
            self._ncm_made.made(progress, classes)


def _corrects_serving(learner: ContinualLearner) -> bool:
    return learner.serving_bn == "memory" or learner.serving_bias


def _memory_classes(learner: ContinualLearner) -> set[int]:
    buffer = getattr(learner, "buffer", None)
    return set(buffer.class_counts()) if buffer is not None else set()
