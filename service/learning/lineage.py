"""Which learner a data directory holds: its lineage's training settings, resolved once at start-up.

Each setting that decides how a lineage trains (LINEAGE_SETTINGS) is taken as set; else as the
lineage already in the data directory was trained (its checkpoint's identity), so a directory made
under an older release's defaults goes on as it was; else its default for the method and backbone
chosen (TUNED_DEFAULTS, PRETRAINED_DEFAULTS). `describe_learner` asks this once at start-up, beside the
checkpoints, and hands down the answer (a `LearnerSpec`): the settings stay plain data.

>>> from service.settings import Settings
>>> pretrained = Lineage.resolve(Settings(backbone="lite0", sleep=False), None)  # the default backbone, awake
>>> pretrained.image_size, pretrained.cut, pretrained.head, pretrained.lr, pretrained.augment
(160, 17, 'slda', 0.01, False)
>>> scratch = Lineage.resolve(Settings(backbone="scratch"), None)
>>> scratch.backbone, scratch.image_size, scratch.iterations, scratch.augment, scratch.head
('scratch', 32, 2, True, 'softmax')
>>> scratch.identity()
{'ASER_METHOD': 'cb-sv-duel', 'ASER_STEP': 'joint', 'ASER_LOSS': 'ace', 'ASER_AUGMENT': 'True', 'ASER_ITERATIONS': '2'}
>>> Lineage.resolve(Settings(sleep=False), None).cut == POOLED, Lineage.resolve(Settings(), None).cut
(True, 11)
>>> Lineage.resolve(Settings(), None).head  # a sleep's top serves where its held-back samples show it
'chosen'
>>> made_awake = {"ASER_BACKBONE": "lite0", "ASER_CUT": str(POOLED), "ASER_METHOD": "cb-sv-duel"}
>>> Lineage.resolve(Settings(), made_awake).head  # a directory made before sleep was the default goes on awake
'slda'
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

from learner.networks.lite0 import POOLED
from service.settings import Settings

log = logging.getLogger("aser.worker")

# the settings that decide how a lineage trains (its checkpoints' identity)
LINEAGE_SETTINGS = ("backbone", "image_size", "cut", "latent_bits", "method", "step", "loss", "augment", "iterations",
                    "distill")
# The learner's options where unset: on where the evidence earned it (docs/results/options.md and asers-memory.md).
# ER-ACE with the stronger learner's three gains +12.95 +- 2.11 A_T over ER-ACE on Split CIFAR-10 at M=1000 (10
# paired seeds, 2.1x ER's step); under the KNN-SV memory all three add +1.41 +- 2.64 (5 seeds), not a default, but
# the moving average alone adds +2.14 +- 2.10 (10 paired seeds, under 1% of a step's cost), and behind a stream at 2x
# / 4x ER's pace lean steps add +22.3 +- 5.2 / +22.6 +- 4.9 to it and +4.6 +- 6.2 / +4.9 +- 4.3 to the best
# configuration (3 paired seeds each).
OPTIONS_OFF = {"augment": False, "iterations": 1, "ema": 0.0, "lean_when_behind": False, "distill": 0.0}
# The class-balanced KNN-SV memory (cb-sv-duel) takes ER's options: with them it is +13.39 ± 1.92 A_T (10 paired
# seeds) over the previous default (sv-upd + ACE + EMA) at full length, level with the best (issue 36,
# docs/results/asers-memory.md); its lean form is CBRS's update, as cheap as the reservoir's.
ALL_OPTIONS = {**OPTIONS_OFF, "augment": True, "iterations": 2, "ema": 0.99, "lean_when_behind": True}
TUNED_DEFAULTS = {"er": ALL_OPTIONS, "cb-sv-duel": ALL_OPTIONS,
                  "sv-upd": {**OPTIONS_OFF, "ema": 0.99, "lean_when_behind": True}}
# On the pretrained backbone (docs/results/pretrained.md): the memory holds latents, so no
# pixel augmentation; one iteration, the moving average and lr 0.01 as measured; 160 px by the input-size rule;
# streaming LDA serves (80.0 A_T, 78.2 / 82.0 / 84.8 anytime, 5 seeds; the trained linear head 74.6), so the
# memory-fitted logit bias, which corrects the trained head, is off.
PRETRAINED_DEFAULTS = {"options": {**OPTIONS_OFF, "ema": 0.99, "lean_when_behind": True}, "image_size": 160,
                       "lr": 0.01, "head": "slda", "serving_bias": False, "cut": POOLED}
# With ASER_SLEEP (docs/results/sleep.md): the last two stages train in sleeps, where the measured gains are, and
# the held-back samples choose each class's head (streaming LDA until a sleep has taught the top the class)
SLEEP_DEFAULTS = {"cut": 11, "head": "chosen"}
SCRATCH_DEFAULTS = {"image_size": 32, "lr": 0.1, "head": "softmax", "serving_bias": True, "cut": POOLED}


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
        """What the combination allows (the method alone and the tokens are `check_learner`'s)."""
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
        from learner.methods.registry import REPLAY_METHODS
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
    if pretrained and name in SLEEP_DEFAULTS and sleep_asked(settings, resolved):
        return SLEEP_DEFAULTS[name]
    return (PRETRAINED_DEFAULTS if pretrained else SCRATCH_DEFAULTS)[name]


def sleep_asked(settings: Settings, resolved: dict) -> bool:
    """Whether the settings want a sleep, before the lineage is resolved: ASER_SLEEP, and where unset a replay method
    (the memory's) at cut 11 with no option of a top that trains awake (ASER_HEAD=chosen alone trains it awake, as
    before). docs/results/sleep.md: naps of 4 and a night of 4 met the accuracy goals on Split EuroSAT, Split
    CIFAR-10 and tf_flowers.

    >>> aser = {"method": "cb-sv-duel"}
    >>> sleep_asked(Settings(), aser), sleep_asked(Settings(idle_rehearsal=True), aser)
    (True, False)
    >>> sleep_asked(Settings(), {"method": "ewc"}), sleep_asked(Settings(sleep=False), aser)
    (False, False)
    """
    from learner.methods.registry import REPLAY_METHODS

    if settings.sleep is not None:
        return settings.sleep
    at_its_cut = resolved.get("cut", SLEEP_DEFAULTS["cut"]) == SLEEP_DEFAULTS["cut"]  # a directory made at another cut
    awake_top = settings.trained_head_from is not None or settings.idle_rehearsal  # options of a top that trains awake
    return not awake_top and settings.head is None and resolved["method"] in REPLAY_METHODS and at_its_cut


def sleep_on(settings: Settings, lineage: Lineage) -> bool:
    """Whether the learner sleeps: ASER_SLEEP as set (refused where the lineage cannot), else where the resolved
    lineage is a sleeping one (a directory trained without sleep goes on without it)."""
    can = lineage.backbone != "scratch" and lineage.head == "chosen" and settings.head_measure == "held-back"
    if settings.sleep and not can:
        raise ValueError("ASER_SLEEP trains a pretrained top that serves where samples held back from training show "
                         "it better: it needs ASER_BACKBONE=lite0, ASER_HEAD=chosen (its default with ASER_SLEEP) "
                         "and ASER_HEAD_MEASURE=held-back")
    if settings.sleep is not None:
        return settings.sleep
    wanted = sleep_asked(settings, {"method": lineage.method})  # as a new directory would
    sleeps = wanted and can and lineage.cut == SLEEP_DEFAULTS["cut"]
    if wanted and not sleeps and lineage.backbone != "scratch":
        log.info("no sleep: by default a learner sleeps at ASER_CUT=11 with ASER_HEAD=chosen measured on held-back "
                 "samples, and this one serves ASER_HEAD=%s (ASER_HEAD_MEASURE=%s) at ASER_CUT=%s (another cut needs "
                 "an empty data directory; ASER_SLEEP=false quiets this)", lineage.head, settings.head_measure,
                 lineage.cut)
    return sleeps


def replay_batch_on(settings: Settings, device: str) -> int:
    """The replay batch as set, else 20 on a GPU and 10 on a CPU. Issue 37: 20 lifts the default by
    +2.73 ± 1.32 A_T at M=1000 (10 paired seeds), +2.58 ± 3.36 at M=500, +0.84 ± 4.35 at M=200 (5 each);
    on an H100 its step takes 0.98x the default's, on one CPU thread 1.40x (over 3x ER's step there: rule 5,
    docs/results/past-one-pass.md).

    >>> replay_batch_on(Settings(), "cuda:0"), replay_batch_on(Settings(), "cpu")
    (20, 10)
    >>> replay_batch_on(Settings(replay_batch=5), "cuda")
    5
    """
    if settings.replay_batch is not None:
        return settings.replay_batch
    return 20 if device.startswith("cuda") else 10


def resolve_device(name: str) -> str:
    """ASER_DEVICE, with `auto` decided: a CUDA GPU where there is one."""
    if name != "auto":
        return name
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass(frozen=True)
class LearnerSpec:
    """Everything start-up decided about the learner: its lineage, the device, and the settings' other
    knobs it is built with. What runs after start-up receives this, never the settings and a question."""

    lineage: Lineage
    device: str
    mem_size: int
    k: int | None
    n_candidates: int | None
    per_class: bool
    replay_batch: int
    seed: int
    latent_bf16: bool
    serving_bn: str
    trained_head_from: int | None
    head_measure: str
    head_prior: str | None
    sleep: bool = False  # the top trains in sleeps (learner.methods.sleep) and not awake
    sleep_epochs: float = 4.0
    sleep_store_mb: float = 512.0
    sleep_min_new: int = 100
    sleep_schedule: str = "constant"
    sleep_draw: str = "balanced"
    sleep_fresh_epochs: float | None = None
    calibrate: bool = True  # a temperature and "none of these" fitted on held-back samples (learner.heads.calibration)
    unknown_false_alarm: float = 0.05

    @property
    def image_shape(self) -> tuple[int, int, int]:
        return (3, self.lineage.image_size, self.lineage.image_size)

    def build(self):
        """A new learner as this describes it (its state comes from a checkpoint, or nowhere). With a sleep, the
        worker gives it its latent store on disk (`service.storage.latent_store`) before the restore."""
        import torch

        from learner import make_learner
        from learner.networks.backbone import make_backbone

        lineage, size = self.lineage, self.lineage.image_size
        backbone = make_backbone(lineage.backbone, self.image_shape, size, lineage.cut, lineage.latent_bits)
        return make_learner(lineage.method, num_classes=1, mem_size=self.mem_size, k=self.k,
                            n_candidates=self.n_candidates, per_class=self.per_class, replay_batch=self.replay_batch,
                            lr=lineage.lr, **lineage.replay_objective(), **lineage.stronger_learner(),
                            device=self.device, seed=self.seed, image_shape=self.image_shape,
                            latent_dtype=torch.bfloat16 if self.latent_bf16 else None, serving_bn=self.serving_bn,
                            serving_bias=lineage.serving_bias, backbone=backbone,
                            serving_head="slda" if lineage.head in ("slda", "chosen") else None,
                            trained_head_from=self.trained_head_from,
                            choose_head=self.head_measure if lineage.head == "chosen" else False,
                            head_prior=self.head_prior, train_every=0 if self.sleep else 1,
                            sleep=self.sleep_config(), calibrate=self.calibrate,
                            false_alarm=self.unknown_false_alarm)

    def sleep_config(self):
        if not self.sleep:
            return None
        from learner.methods.sleep import SleepConfig

        # a store of 1: the worker gives the learner its store on disk instead
        return SleepConfig(epochs=self.sleep_epochs, schedule=self.sleep_schedule, draw=self.sleep_draw,
                           fresh_epochs=self.sleep_fresh_epochs, store_capacity=1)

    def config(self) -> dict:
        """The learner's configuration as `/status` shows it."""
        lineage = self.lineage
        return {"mem_size": self.mem_size, "k": self.k, "n_candidates": self.n_candidates,
                "per_class": self.per_class, "seed": self.seed, "backbone": lineage.backbone,
                "image_size": lineage.image_size, **lineage.backbone_settings(), "lr": lineage.lr,
                "replay_batch": self.replay_batch, **lineage.replay_objective(), **lineage.stronger_learner(),
                "head": lineage.head, **({"trained_head_from": n} if (n := self.trained_head_from) else {}),
                **({"head_measure": self.head_measure} if lineage.head == "chosen" else {}),
                **({"head_prior": self.head_prior} if self.head_prior else {}),
                "serving_bn": self.serving_bn, "serving_bias": lineage.serving_bias, "calibrate": self.calibrate,
                **({"unknown_false_alarm": self.unknown_false_alarm} if self.calibrate else {}),
                **({"sleep": True, "sleep_epochs": self.sleep_epochs, "sleep_store_mb": self.sleep_store_mb,
                    "sleep_min_new": self.sleep_min_new, "sleep_schedule": self.sleep_schedule,
                    "sleep_draw": self.sleep_draw,
                    **({"sleep_fresh_epochs": n} if (n := self.sleep_fresh_epochs) else {})}
                   if self.sleep else {})}


def describe_learner(settings: Settings, saved: dict[str, str] | None) -> LearnerSpec:
    """The learner a data directory holds, asked once at start-up: `settings`, going on as its lineage
    was trained (`saved`, the last checkpoint's identity) where they leave it open; a restore is then
    checked against it.

    >>> spec = describe_learner(Settings(backbone="scratch", device="cpu"), None)
    >>> spec.lineage.method, spec.device, spec.replay_batch, spec.image_shape
    ('cb-sv-duel', 'cpu', 10, (3, 32, 32))
    """
    lineage = Lineage.resolve(settings, saved)
    if lineage.taken:
        log.warning("the data directory's lineage was trained with %s, which this configuration does not set: "
                    "going on with them (set them to choose otherwise; another lineage needs an empty data "
                    "directory)", " ".join(f"ASER_{k.upper()}={getattr(lineage, k)}" for k in lineage.taken))
    if settings.trained_head_from is not None and lineage.head != "slda":
        raise ValueError(f"ASER_TRAINED_HEAD_FROM hands serving from streaming LDA to the trained head, but this "
                         f"lineage serves ASER_HEAD={lineage.head}: set ASER_HEAD=slda (lite0's default) or unset it")
    sleep = sleep_on(settings, lineage)
    device = resolve_device(settings.device)
    return LearnerSpec(lineage, device, settings.mem_size, settings.k, settings.n_candidates, settings.per_class,
                       replay_batch_on(settings, device), settings.seed, settings.latent_bf16, settings.serving_bn,
                       settings.trained_head_from, settings.head_measure, head_prior(settings, lineage.head),
                       sleep, settings.sleep_epochs, settings.sleep_store_mb, settings.sleep_min_new,
                       settings.sleep_schedule, settings.sleep_draw, settings.sleep_fresh_epochs,
                       lineage.backbone != "scratch" if settings.calibrate is None else settings.calibrate,
                       settings.unknown_false_alarm)


def head_prior(settings: Settings, head: str) -> str | None:
    """The held-back choice's prior: ASER_HEAD_PRIOR, the pool where unset (against the mean: ten images into each
    new class above it on Split EuroSAT, Split CIFAR-10 and tf_flowers, at the end above or level:
    docs/results/adapting.md)."""
    held_back = head == "chosen" and settings.head_measure == "held-back"
    if settings.head_prior not in (None, "none") and not held_back:
        raise ValueError("ASER_HEAD_PRIOR is the prior of the choice on held-back samples: set ASER_HEAD=chosen "
                         "(ASER_HEAD_MEASURE=held-back, its default), or unset it")
    if not held_back or settings.head_prior == "none":
        return None
    return settings.head_prior or "pool"


def check_learner(settings: Settings) -> None:
    """What a learner needs and a replica does not (a replica neither trains, imports torch, nor takes
    writes): a known method, a combination its lineage allows, and a token that may send samples if any
    is set.

    >>> check_learner(Settings(method="icarl"))
    Traceback (most recent call last):
    ValueError: unknown ASER_METHOD 'icarl'; choose one of ...
    >>> check_learner(Settings(method="ewc"))  # ASER_LOSS's default (ace) is the replay methods'
    >>> check_learner(Settings(method="ewc", loss="ce"))  # what EWC minimises anyway
    >>> check_learner(Settings(method="ewc", loss="ace"))
    Traceback (most recent call last):
    ValueError: ASER_STEP, ASER_LOSS, ASER_AUGMENT, ASER_ITERATIONS and ASER_DISTILL apply to the replay methods, not ewc
    >>> check_learner(Settings(method="ewc", augment=True))
    Traceback (most recent call last):
    ValueError: ASER_STEP, ASER_LOSS, ASER_AUGMENT, ASER_ITERATIONS and ASER_DISTILL apply to the replay methods, not ewc
    """
    from learner.methods.registry import METHODS, REPLAY_METHODS

    if settings.method not in METHODS:
        raise ValueError(f"unknown ASER_METHOD {settings.method!r}; choose one of {', '.join(METHODS)}")
    chosen = {f: getattr(settings, f) for f in ("step", "loss", "augment", "iterations", "distill")
              if f in settings.model_fields_set}
    neutral = {("step", "joint"), ("loss", "ce"), ("augment", False), ("iterations", 1), ("distill", 0.0)}
    if settings.method not in REPLAY_METHODS and chosen.items() - neutral:
        raise ValueError("ASER_STEP, ASER_LOSS, ASER_AUGMENT, ASER_ITERATIONS and ASER_DISTILL apply to the "
                         f"replay methods, not {settings.method}")
    describe_learner(settings, None)  # the combination as set (a data directory's lineage may fill in more)
    if settings.read_token is not None and settings.write_token is None and settings.admin_token is None:
        raise ValueError("ASER_READ_TOKEN alone would let nobody send samples: set ASER_WRITE_TOKEN or "
                         "ASER_ADMIN_TOKEN too")
