"""Which learner a data directory holds: its lineage's training settings, resolved once at start-up.

Each setting that decides how a lineage trains (LINEAGE_SETTINGS) is taken as set; else as the
lineage already in the data directory was trained (its checkpoint's identity), so a directory made
under an older release's defaults goes on as it was; else its default for the method and backbone
chosen (TUNED_DEFAULTS, PRETRAINED_DEFAULTS). `Runtime.open` asks this once, beside the
checkpoints, and passes the answer down: the settings stay plain data.

>>> from service.settings import Settings
>>> pretrained = Lineage.resolve(Settings(backbone="lite0"), None)  # the default backbone
>>> pretrained.image_size, pretrained.cut, pretrained.head, pretrained.lr, pretrained.augment
(160, 17, 'slda', 0.01, False)
>>> scratch = Lineage.resolve(Settings(backbone="scratch"), None)
>>> scratch.backbone, scratch.image_size, scratch.iterations, scratch.augment, scratch.head
('scratch', 32, 2, True, 'softmax')
>>> scratch.identity()
{'ASER_METHOD': 'cb-sv-duel', 'ASER_STEP': 'joint', 'ASER_LOSS': 'ace', 'ASER_AUGMENT': 'True', 'ASER_ITERATIONS': '2'}
>>> Settings().cut == POOLED  # the settings name the pooled cut without importing torch
True
>>> Lineage.resolve(Settings(), scratch.identity()).backbone  # a directory made from scratch goes on from scratch
'scratch'
>>> old = Lineage.resolve(Settings(loss="ace"), {"ASER_METHOD": "er", "ASER_STEP": "joint", "ASER_LOSS": "ce"})
>>> old.method, old.loss, old.augment, old.iterations, old.taken  # set ones stay; a restore is then refused
('er', 'ace', False, 1, ('method', 'backbone', 'augment', 'iterations'))
>>> Lineage.resolve(Settings(method="ewc", ema=0.99), None).stronger_learner()
{'ema_decay': 0.99}
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

from pydantic import TypeAdapter

from learner.pretrained import POOLED

from .settings import Settings

log = logging.getLogger("aser.worker")

# the settings that decide how a lineage trains (its checkpoints' identity)
LINEAGE_SETTINGS = ("backbone", "image_size", "cut", "latent_bits", "method", "step", "loss", "augment", "iterations",
                    "distill")
# The learner's options where unset: on where the evidence earned it (docs/results.md). ER-ACE with the
# stronger learner's three gains +12.95 +- 2.11 A_T over ER-ACE on Split CIFAR-10 at M=1000 (10 paired
# seeds, 2.1x ER's step); under the KNN-SV memory all three add +1.41 +- 2.64 (5 seeds), not a default,
# but the moving average alone adds +2.14 +- 2.10 (10 paired seeds, under 1% of a step's cost), and
# behind a stream at 2x / 4x ER's pace lean steps add +22.3 +- 5.2 / +22.6 +- 4.9 to it and +4.6 +- 6.2 /
# +4.9 +- 4.3 to the best configuration (3 paired seeds each).
OPTIONS_OFF = {"augment": False, "iterations": 1, "ema": 0.0, "lean_when_behind": False, "distill": 0.0}
# The class-balanced KNN-SV memory (cb-sv-duel) takes ER's options: with them it is +13.39 ± 1.92 A_T (10 paired
# seeds) over the previous default (sv-upd + ACE + EMA) at full length, level with the best (issue 36,
# docs/results.md); its lean form is CBRS's update, as cheap as the reservoir's.
ALL_OPTIONS = {**OPTIONS_OFF, "augment": True, "iterations": 2, "ema": 0.99, "lean_when_behind": True}
TUNED_DEFAULTS = {"er": ALL_OPTIONS, "cb-sv-duel": ALL_OPTIONS,
                  "sv-upd": {**OPTIONS_OFF, "ema": 0.99, "lean_when_behind": True}}
# On the pretrained backbone (docs/results.md, "Useful from the first images"): the memory holds latents, so no
# pixel augmentation; one iteration, the moving average and lr 0.01 as measured; 160 px by the input-size rule;
# streaming LDA serves (80.0 A_T, 78.2 / 82.0 / 84.8 anytime, 5 seeds; the trained linear head 74.6), so the
# memory-fitted logit bias, which corrects the trained head, is off.
PRETRAINED_DEFAULTS = {"options": {**OPTIONS_OFF, "ema": 0.99, "lean_when_behind": True}, "image_size": 160,
                       "lr": 0.01, "head": "slda", "serving_bias": False}
SCRATCH_DEFAULTS = {"image_size": 32, "lr": 0.1, "head": "softmax", "serving_bias": True}


@dataclass(frozen=True)
class Lineage:
    """The learner a data directory holds: every setting that decides it, resolved."""

    method: str
    backbone: str
    image_size: int
    cut: int
    latent_bits: int
    step: str
    loss: str
    augment: bool | str
    iterations: int
    distill: float
    ema: float
    lean_when_behind: bool
    lr: float
    head: str
    serving_bias: bool
    taken: tuple[str, ...] = ()  # the settings taken from the data directory's lineage (unset here)

    @classmethod
    def resolve(cls, settings: Settings, saved: dict[str, str] | None) -> "Lineage":
        """`settings`, with what they leave unset taken from `saved` (the last checkpoint's
        `identity()`; None: no checkpoint, or one from before identities were saved), else defaulted
        for the method and backbone so chosen."""
        lineage_values = _saved_settings(saved)
        values, taken = {}, []
        for name in cls._fields():  # the backbone and the method first: the other defaults follow them
            default = _default(settings, name, values)
            if name in settings.model_fields_set and getattr(settings, name) is not None:
                values[name] = getattr(settings, name)
            elif name in lineage_values:
                values[name] = lineage_values[name]
                if values[name] != default:
                    taken.append(name)
            else:
                values[name] = default
        lineage = cls(**values, taken=tuple(taken))
        lineage.check()
        return lineage

    @classmethod
    def _fields(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls) if f.name != "taken")

    def check(self) -> None:
        """What the combination allows (the method alone and the tokens are `Settings.check_learner`'s)."""
        if self.distill and not self.ema:
            raise ValueError("ASER_DISTILL needs a moving average to teach: set ASER_EMA")
        if self.backbone == "scratch" and self.head in ("slda", "chosen"):
            raise ValueError(f"ASER_HEAD={self.head} reads a pretrained network's frozen features: set "
                             "ASER_BACKBONE=lite0")
        if self.latent_bits not in (8, 16) or (self.latent_bits == 8 and self.cut != POOLED):
            raise ValueError(f"ASER_LATENT_BITS is 16, or 8 at the pooled cut (ASER_CUT={POOLED}); got "
                             f"{self.latent_bits} at cut {self.cut}")
        if self.backbone != "scratch" and self.augment:
            raise ValueError("ASER_AUGMENT crops and flips images; on a pretrained backbone the memory holds latents")

    @property
    def replay(self) -> bool:
        from learner.methods import REPLAY_METHODS
        return self.method in REPLAY_METHODS

    def replay_objective(self) -> dict:
        """`step` and `loss` for the learner: the replay methods'; the others (EWC, A-GEM, fine-tune)
        have a loss of their own and take neither."""
        return {"step": self.step, "loss": self.loss} if self.replay else {}

    def stronger_learner(self) -> dict:
        """The augmentation, iterations, distillation (replay methods) and moving average, where on."""
        chosen = {"augment": (self.replay and self.augment) or None,
                  "iterations": self.iterations if self.replay and self.iterations != 1 else None,
                  "distill": (self.replay and self.distill) or None,
                  "ema_decay": self.ema or None}
        return {k: v for k, v in chosen.items() if v is not None}

    def backbone_settings(self) -> dict:
        """The backbone's own settings, on the pretrained one (the image size is the ingest's)."""
        if self.backbone == "scratch":
            return {}
        return {"backbone": self.backbone, "image_size": self.image_size, "cut": self.cut,
                "latent_bits": self.latent_bits}

    def identity(self) -> dict[str, str]:
        """The settings that decide how the learner trains, as environment variables: a checkpoint made
        under some does not go on under others (the stronger learner's and the backbone's only where on,
        so a data directory made before they existed goes on)."""
        training = {k: v for k, v in self.stronger_learner().items() if k != "ema_decay"}  # the average only serves
        chosen = {**self.backbone_settings(), "method": self.method, **self.replay_objective(), **training}
        return {f"ASER_{k.upper()}": v if isinstance(v, str) else str(v) for k, v in chosen.items()}

    def describe(self) -> str:
        return " ".join(f"{k}={v}" for k, v in {**self.backbone_settings(), **self.replay_objective(),
                                                 **self.stronger_learner(), "lr": self.lr, "head": self.head}.items())


def _saved_settings(saved: dict[str, str] | None) -> dict[str, object]:
    """A checkpoint's identity as settings values; the stronger learner's options and the backbone
    it names only where on, so their absence means off (and scratch)."""
    if not saved:
        return {}
    values = {**{k: str(v) for k, v in OPTIONS_OFF.items() if k in LINEAGE_SETTINGS}, "backbone": "scratch",
              **{k.removeprefix("ASER_").lower(): v for k, v in saved.items()}}
    fields = Settings.model_fields
    return {name: TypeAdapter(fields[name].annotation).validate_strings(values[name])
            for name in LINEAGE_SETTINGS if name in values}


def _default(settings: Settings, name: str, resolved: dict) -> object:
    """A setting's value where neither set nor taken from the lineage: the plain default, else the
    one of the method and backbone resolved so far."""
    plain = getattr(settings, name)
    if plain is not None:  # the method, the backbone and the other settings with a fixed default
        return plain
    pretrained = resolved["backbone"] != "scratch"
    options = PRETRAINED_DEFAULTS["options"] if pretrained else TUNED_DEFAULTS.get(resolved["method"], OPTIONS_OFF)
    if name in options:
        return options[name]
    return (PRETRAINED_DEFAULTS if pretrained else SCRATCH_DEFAULTS)[name]


def replay_batch_on(settings: Settings, device: str) -> int:
    """The replay batch as set, else 20 on a GPU and 10 on a CPU. Issue 37: 20 lifts the default by
    +2.73 ± 1.32 A_T at M=1000 (10 paired seeds), +2.58 ± 3.36 at M=500, +0.84 ± 4.35 at M=200 (5 each);
    on an H100 its step takes 0.98x the default's, on one CPU thread 1.40x (over 3x ER's step there: rule 5,
    docs/results.md).

    >>> replay_batch_on(Settings(), "cuda:0"), replay_batch_on(Settings(), "cpu")
    (20, 10)
    >>> replay_batch_on(Settings(replay_batch=5), "cuda")
    5
    """
    if settings.replay_batch is not None:
        return settings.replay_batch
    return 20 if device.startswith("cuda") else 10


def make_learner_of(lineage: Lineage, settings: Settings, device: str):
    """The learner `lineage` names, with the settings' other knobs (memory size, KNN's k, the seed...)."""
    import torch

    from learner import make_learner
    from learner.backbone import make_backbone

    shape = (3, lineage.image_size, lineage.image_size)
    backbone = make_backbone(lineage.backbone, shape, lineage.image_size, lineage.cut, lineage.latent_bits)
    return make_learner(lineage.method, num_classes=1, mem_size=settings.mem_size, k=settings.k,
                        n_candidates=settings.n_candidates, per_class=settings.per_class,
                        replay_batch=replay_batch_on(settings, device), lr=lineage.lr, **lineage.replay_objective(),
                        **lineage.stronger_learner(), device=device, seed=settings.seed, image_shape=shape,
                        latent_dtype=torch.bfloat16 if settings.latent_bf16 else None, serving_bn=settings.serving_bn,
                        serving_bias=lineage.serving_bias, backbone=backbone,
                        serving_head="slda" if lineage.head in ("slda", "chosen") else None,
                        trained_head_from=trained_head_from(lineage, settings), choose_head=lineage.head == "chosen")


def trained_head_from(lineage: Lineage, settings: Settings) -> int | None:
    """ASER_TRAINED_HEAD_FROM, where the lineage serves streaming LDA (the only head it hands over from)."""
    if settings.trained_head_from is not None and lineage.head != "slda":
        raise ValueError(f"ASER_TRAINED_HEAD_FROM hands serving from streaming LDA to the trained head, but this "
                         f"lineage serves ASER_HEAD={lineage.head}: set ASER_HEAD=slda (lite0's default) or unset it")
    return settings.trained_head_from


def lineage_of(settings: Settings, checkpoints) -> Lineage:
    """The learner the data directory holds: `settings`, going on as its lineage was trained where
    they leave it open (an upgrade whose defaults differ); a restore is then checked against it."""
    lineage = Lineage.resolve(settings, checkpoints.saved_identity())
    if lineage.taken:
        log.warning("the data directory's lineage was trained with %s, which this configuration does not set: "
                    "going on with them (set them to choose otherwise; another lineage needs an empty data "
                    "directory)", " ".join(f"ASER_{k.upper()}={getattr(lineage, k)}" for k in lineage.taken))
    return lineage
