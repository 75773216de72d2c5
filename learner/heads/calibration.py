"""Probabilities that mean what they say, and "none of these", fitted on samples no head trained on.

Streaming LDA's Gaussian model, and the nearest class mean while a class is young, answer with far more confidence
than they earn at the scales a device works at (1,280 dimensions, few samples a class): at the end of Split CIFAR-10
the default was wrong 2,000 times in 10,000, 498 of them at more than 0.99. A `Calibration` fitted on the held-back
samples (`learner.heads.held_back`: a few of each class kept out of every head's training, so their answers are
what a new photo gets) divides the served logits by one temperature (Guo et al. 2017), the log-likelihood's best on
them under a log-normal prior around PRIOR_TEMPERATURE worth PRIOR_WEIGHT samples, so that a handful of samples all
answered right cannot drive the temperature to zero (FIRST_PRIOR_TEMPERATURE, alone, while nothing is held back yet).
Then a floor: n samples after the newest class's first, 1 / (n + 2) of the probability is spread evenly over the
classes offered (Laplace's rule of succession, counted again from each new class: the stream has just shown that its
world is not closed), so that in the first minutes (a class
of 12 photos, none held back yet) and ten photos into each new class no answer claims certainty (on Split EuroSAT and
Split CIFAR-10, ten images into each class, the rule counted over every sample left 7.5 and 12 wrong answers above
0.99 a task, this one none); a thousand samples after, it is 0.1%. Neither moves a top-1 answer.

"None of these" scores how unlike every learned class an image is: its distance to the nearest class mean of the
frozen features (1 - cosine similarity to the unit-norm means of streaming LDA's classes), standardised by its mean
and spread on known classes' samples scored out of sample: the held-back samples, and with the distance the latest
trained samples of each class, each against its class's mean without it (`learner.heads.recent_features`); where the
stored latent is a map (below the pooled cut), plus CHANNEL_WEIGHT times the same distance of its channel means, each
part standardised on those samples first; without frozen features (from scratch), the served answer's lack of
confidence (1 - its top probability) on the held-back samples. Over 15 held-out classes of three sets the distance
told a photo of another world better than the lack of confidence or their sum (15 of 15), and a new class of the same
kind of photo not measurably worse than the sum (docs/results/calibration.md). An image is `unknown` past the score's
(1 - false_alarm) quantile on those samples: about `false_alarm` of the photos of known classes are flagged.

Everything a `Calibration` computes is tensor operations only: the ONNX snapshot carries it in its graph.

>>> import torch
>>> sure = torch.tensor([[8.0, 0.0], [0.0, 8.0]]).repeat(20, 1)  # 40 answers, each at 0.9997
>>> fit_temperature(sure, torch.tensor([0, 1, 1, 0]).repeat(10)) > 9  # half of them wrong: near one half
True
>>> fit_temperature(sure, torch.tensor([0, 1]).repeat(20)) < PRIOR_TEMPERATURE  # all right: surer than the prior
True
>>> humble = Calibration(temperature=8.0, floor=0.0)
>>> round(float(humble.probabilities(torch.tensor([[8.0, 0.0]]))[0, 0]), 3)
0.731
>>> early = Calibration(temperature=8.0, floor=1 / (8 + 2))  # after 8 samples: at most 0.95 for two classes
>>> round(float(early.probabilities(torch.tensor([[800.0, 0.0]]))[0, 0]), 3)
0.95
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
from torch.nn import functional as F

PRIOR_TEMPERATURE = 5.0  # Split EuroSAT's and Split CIFAR-10's held-back samples fitted 2.8-10 (docs/results)
# where the served logits' scale was fitted by likelihood already (the trained top's softmax, the pool's temperature
# fitted on these same held-back samples): a prior at 5 held the fit near 1.2-2, the answers less sure than right
# (under a sleep, and a hundred images into a young class; docs/results/calibration.md)
FITTED_PRIOR_TEMPERATURE = 1.0
# while nothing is held back yet (the first classes, under 20 samples each: their class means answer, whose held-back
# samples fit 7-10 later): tf_flowers ten images into each new class 7.4% -> 6.8%, Split EuroSAT and CIFAR-10 unmoved
FIRST_PRIOR_TEMPERATURE = 8.0
PRIOR_WEIGHT = 5.0  # the prior's weight, in held-back samples' log-likelihood
TEMPERATURES = torch.logspace(-1, 3, 161)  # the fit's grid: steps of 6%
FALSE_ALARM = 0.05  # the share of known classes' photos "none of these" flags, by default
MIN_FOR_THRESHOLD = 20  # held-back samples before any image is called unknown
# the weight of the stored latent's channel distance beside the frozen features' (each standardised): a quarter told
# the Mini-ImageNet slice's far set (EuroSAT tiles) 0.958 -> 0.976 and cost no held-out class measurably; a half
# 0.982, at -0.012 ± 0.009 on tf_flowers' (docs/results/calibration.md, a second, middle depth)
CHANNEL_WEIGHT = 0.25


def fit_temperature(logits: torch.Tensor, labels: torch.Tensor, prior: float = PRIOR_TEMPERATURE,
                    weight: float = PRIOR_WEIGHT) -> float:
    """The temperature of most posterior probability for labelled logits [n, classes]: the summed negative
    log-likelihood of softmax(logits / t), plus `weight` (log t - log prior)^2; the prior alone for no samples."""
    penalty = weight * (TEMPERATURES.log() - math.log(prior)) ** 2
    if len(labels):
        logits = logits.float().clamp_min(-1e30)
        nll = torch.stack([F.cross_entropy(logits / t, labels, reduction="sum") for t in TEMPERATURES])
        penalty = penalty + nll
    return float(TEMPERATURES[int(penalty.argmin())])


def blind_answers(served: torch.Tensor, stream: torch.Tensor, blind: torch.Tensor) -> torch.Tensor:
    """Each row of the served probabilities whose answer is a class in `blind` (a mask of the columns: classes whose
    column reads nothing of the trained top, young since its last sleep), replaced by streaming LDA's calibrated row
    where that gives the same answer. The top has not learned such a class, so its share of the pool weighs only the
    classes it knows against it: the pool's margin for the young answer shrinks, and its probability falls far below
    its accuracy (tf_flowers, ten photos into each new class under a sleep: 79% right at 0.53-0.62). Streaming LDA,
    which has learned every class, is the one head whose answer covers it. No top-1 answer moves. Tensor operations
    only (the ONNX snapshot carries it).

    >>> served = torch.tensor([[0.5, 0.125, 0.375], [0.25, 0.625, 0.125]])  # rows answered by classes 0 and 1
    >>> stream = torch.tensor([[0.75, 0.0, 0.25], [0.125, 0.75, 0.125]])
    >>> blind_answers(served, stream, torch.tensor([True, False, False])).tolist()  # class 0 is young
    [[0.75, 0.0, 0.25], [0.25, 0.625, 0.125]]
    """
    answer = served.argmax(1)
    rows = blind.to(served.device)[answer] & (stream.argmax(1) == answer)
    return torch.where(rows[:, None], stream, served)


def unit_means(sums: torch.Tensor, counts: torch.Tensor, num_classes: int) -> torch.Tensor:
    """Unit-norm class means [num_classes, d] from class sums and counts; a class without samples gets a zero row
    (a cosine of 0, below any learned class's on non-negative features)."""
    means = torch.zeros(num_classes, sums.shape[1])
    n = min(num_classes, len(counts))
    seen = torch.nonzero(counts[:n] > 0).flatten()
    means[seen] = F.normalize((sums[seen] / counts[seen, None]).float(), dim=1)
    return means


def seen_cosine(x: torch.Tensor, means: torch.Tensor) -> torch.Tensor:
    """The cosine similarity of rows to each of `unit_means`' rows, a class without samples (a zero row) put below
    any cosine, so never the nearest: the channel means, unlike the frozen features, take either sign."""
    unseen = (means.abs().sum(1) == 0).float()
    return F.normalize(x.float(), dim=1) @ means.T - 3 * unseen


def nearest_distance(x: torch.Tensor, means: torch.Tensor) -> torch.Tensor:
    """1 - the cosine similarity of rows to the nearest seen class's mean (`seen_cosine`)."""
    return 1 - seen_cosine(x, means).max(1).values


@dataclass(frozen=True, eq=False)
class Calibration:
    temperature: float = PRIOR_TEMPERATURE
    # the share of probability spread evenly over the `live` classes (those offered, not forgotten): 1 / (n + 2)
    # n samples after the newest class's first (Laplace's rule of succession), so that no answer claims more
    # certainty than the samples seen can give; negligible once thousands are in
    floor: float = 0.5
    live: torch.Tensor | None = None  # bool [classes]: the classes the floor spreads over (None: every one)
    means: torch.Tensor | None = None  # unit-norm class means of the frozen features [classes, d] (`unit_means`)
    center: float = 0.0  # the raw score's mean on the held-back samples ...
    scale: float = 1.0  # ... and spread
    threshold: float | None = None  # "none of these" past this score (None: too few held back to say)
    false_alarm: float = FALSE_ALARM
    held: int = 0  # held-back samples it was fitted on
    scored: int = 0  # known classes' scores out of sample the threshold rests on (held-back and `known`)
    # where the served answer reads a trained top: the classes whose column reads nothing of it (bool [classes]), and
    # streaming LDA's own temperature, fitted on the same held-back samples (`blind_answers`); None: no such rows
    blind: torch.Tensor | None = None
    stream_temperature: float = PRIOR_TEMPERATURE
    # beside the frozen features, the stored latent's channel means (`channel_distance`): their unit-norm class means
    # [classes, c], and the centre and spread of each distance on the samples the threshold reads (frozen, channels)
    channel_means: torch.Tensor | None = None
    parts: tuple[float, float, float, float] | None = None

    def probabilities(self, logits: torch.Tensor, live: torch.Tensor | None = None, stream: torch.Tensor | None = None,
                      blind: torch.Tensor | None = None) -> torch.Tensor:
        """softmax(logits / temperature), `floor` of it spread over the live classes (`live`: a mask of the logits'
        columns, by default the first columns of `self.live`); with `stream`, streaming LDA's logits of the same
        images, its answer where `blind_answers` says (`blind`: a mask of the columns, by default `self.blind`'s)."""
        if live is None:
            live = self.live[:logits.shape[1]] if self.live is not None else torch.ones(logits.shape[1])
        live = live.to(logits.device).float()
        live = torch.where(live.sum() > 0, live, torch.ones_like(live))  # none offered known: every column
        probabilities = self._floored(logits, self.temperature, live)
        if blind is None and self.blind is not None:
            blind = self.blind[:logits.shape[1]]
        if stream is None or blind is None:
            return probabilities
        # a column streaming LDA has no class for holds the logarithm's clamp (1e-30), which its temperature (often 5
        # and more) would lift to a share: none offered, none given
        stream = torch.where(live > 0, stream, torch.full_like(stream, -1e4))
        return blind_answers(probabilities, self._floored(stream, self.stream_temperature, live), blind)

    def _floored(self, logits: torch.Tensor, temperature: float, live: torch.Tensor) -> torch.Tensor:
        return (1 - self.floor) * torch.softmax(logits / temperature, 1) + self.floor * live / live.sum()

    def unknown_score(self, probabilities: torch.Tensor | None, frozen: torch.Tensor | None = None,
                      channels: torch.Tensor | None = None) -> torch.Tensor:
        """How unlike every learned class each image is, in standard deviations of known classes' scores out of
        sample from their mean (`fit`): the distance of its frozen features to the nearest class mean (and of its
        stored latent's `channels`, where fitted with them), or without them its calibrated probabilities' lack of
        confidence (`probabilities` may be None where the frozen features are read)."""
        return (self.raw_score(probabilities, frozen, channels) - self.center) / self.scale

    def raw_score(self, probabilities: torch.Tensor | None, frozen: torch.Tensor | None = None,
                  channels: torch.Tensor | None = None) -> torch.Tensor:
        if self.means is None or frozen is None:
            return 1 - probabilities.max(1).values
        if self.parts is None:
            return self.distance(frozen)
        if channels is None:
            raise ValueError("this calibration scores the stored latent's channel means too: pass them")
        frozen_center, frozen_scale, channel_center, channel_scale = self.parts
        return ((self.distance(frozen) - frozen_center) / frozen_scale
                + CHANNEL_WEIGHT * (self.channel_distance(channels) - channel_center) / channel_scale)

    def distance(self, frozen: torch.Tensor) -> torch.Tensor:
        """1 - the cosine similarity of frozen features to the nearest class mean (`nearest_distance`, as the latest
        samples' out-of-sample distances are taken)."""
        return nearest_distance(frozen, self.means.to(frozen.device))

    def channel_distance(self, channels: torch.Tensor) -> torch.Tensor:
        """1 - the cosine similarity of the stored latent's channel means to the nearest class's. A photo of another
        world differs in textures and colours that the last layer's pooling partly averages away (Lee et al. 2018
        score several depths)."""
        return nearest_distance(channels, self.channel_means.to(channels.device))

    def unknown(self, scores: torch.Tensor) -> torch.Tensor:
        if self.threshold is None:
            return torch.zeros(len(scores), dtype=torch.bool)
        return scores > self.threshold

    @classmethod
    def fit(cls, logits: torch.Tensor, labels: torch.Tensor, offered: int, live: torch.Tensor,
            frozen: torch.Tensor | None = None, means: torch.Tensor | None = None,
            false_alarm: float = FALSE_ALARM, prior: float = PRIOR_TEMPERATURE,
            known: torch.Tensor | None = None, blind: torch.Tensor | None = None,
            stream_logits: torch.Tensor | None = None, channels: torch.Tensor | None = None,
            channel_means: torch.Tensor | None = None,
            known_channels: torch.Tensor | None = None) -> "Calibration":
        """Fitted on held-back samples (their served logits and labels, their frozen features, and the class means:
        both or neither), `offered` samples after the newest of the `live` classes arrived; `prior`: the
        temperature's prior (`fit_temperature`); `known`: more known classes' `distance`s taken out of sample
        (`learner.heads.recent_features`), which the score's scale and threshold take in beside the held-back ones;
        `blind` and `stream_logits` (streaming LDA's logits of the held-back samples): `blind_answers`, its
        temperature under streaming LDA's prior; `channels` (the held-back samples' stored latents' channel means),
        `channel_means` (the classes', `unit_means`) and `known_channels` (the `known` samples' `channel_distance`s
        out of sample): the score adds their distance at `CHANNEL_WEIGHT`."""
        fitted = cls(fit_temperature(logits, labels, prior), 1 / (offered + 2), live, means, false_alarm=false_alarm,
                     held=len(labels))
        if blind is not None and stream_logits is not None:
            fitted = replace(fitted, blind=blind, stream_temperature=fit_temperature(stream_logits, labels))
        if len(labels) < MIN_FOR_THRESHOLD:
            return fitted
        raw = fitted.raw_score(fitted.probabilities(logits.float()), frozen)
        if known is not None and means is not None and frozen is not None:
            raw = torch.cat([raw, known.float()])
        if channels is not None and channel_means is not None and means is not None and frozen is not None \
                and (known is None) == (known_channels is None):
            fitted = replace(fitted, channel_means=channel_means)
            channel = fitted.channel_distance(channels)
            channel = channel if known_channels is None else torch.cat([channel, known_channels.float()])
            parts = (float(raw.mean()), max(float(raw.std()), 1e-6), float(channel.mean()),
                     max(float(channel.std()), 1e-6))
            raw = (raw - parts[0]) / parts[1] + CHANNEL_WEIGHT * (channel - parts[2]) / parts[3]
            fitted = replace(fitted, parts=parts)
        center, scale = float(raw.mean()), max(float(raw.std()), 1e-6)
        threshold = float(torch.quantile((raw - center) / scale, 1 - false_alarm))
        return replace(fitted, center=center, scale=scale, threshold=threshold, scored=len(raw))

    def summary(self) -> dict:
        return {"temperature": round(self.temperature, 4), "floor": round(self.floor, 6), "held_back": self.held,
                "stream_temperature": None if self.blind is None else round(self.stream_temperature, 4),
                "false_alarm": self.false_alarm,
                "unknown_threshold": None if self.threshold is None else round(self.threshold, 4),
                "threshold_samples": self.scored}
