"""All service settings in one place: environment variables prefixed ASER_, or a .env file.

>>> Settings(method="er").method
'er'
>>> Settings(method="icarl").check_learner()
Traceback (most recent call last):
ValueError: unknown ASER_METHOD 'icarl'; choose one of ...
>>> Settings(method="ewc").replay_objective()  # ASER_LOSS's default (ace) is the replay methods'
{}
>>> Settings(method="ewc", loss="ce").check_learner()  # what EWC minimises anyway
>>> Settings(method="ewc", loss="ace").check_learner()
Traceback (most recent call last):
ValueError: ASER_STEP, ASER_LOSS, ASER_AUGMENT, ASER_ITERATIONS and ASER_DISTILL apply to the replay methods, not ewc
>>> Settings(method="ewc", augment=True).check_learner()
Traceback (most recent call last):
ValueError: ASER_STEP, ASER_LOSS, ASER_AUGMENT, ASER_ITERATIONS and ASER_DISTILL apply to the replay methods, not ewc
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, TypeAdapter
from pydantic_settings import BaseSettings, SettingsConfigDict

from learner.catch_up import MEMORY_SHARE

# the settings that decide how a lineage trains (its checkpoints' identity)
LINEAGE_SETTINGS = ("method", "step", "loss", "augment", "iterations", "distill")
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


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="ASER_", env_file=".env", extra="ignore")

    # where the SQLite database (ingest log) lives
    data_dir: Path = Path("data")
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    allowed_hosts: list[str] | None = Field(None, description="host names the service answers to (JSON list; "
                                            "[\"*\"]: any); unset: the loopback names on a loopback bind, any otherwise "
                                            "(a web page that rebinds its name to this service gets 400 invalid_host)")

    # the learner: ASER's KNN-SV values choosing within a class-balanced memory (cb-sv-duel: CBRS's admission,
    # the lower-valued of two random members of the class leaves), random retrieval, the ACE loss, augmentation,
    # 2 iterations and a moving-average serving head (TUNED_DEFAULTS), the paper's CIFAR-10 settings. A data
    # directory made under the previous default (sv-upd) goes on as sv-upd where ASER_METHOD is unset.
    method: str = "cb-sv-duel"
    image_size: int = Field(32, ge=8, le=512)
    mem_size: int = Field(1000, ge=0)
    batch_size: int = Field(10, ge=1)
    replay_batch: int | None = Field(None, ge=0, description="memory samples replayed a step (unset: 20 on a GPU, "
                                     "where it costs no more than 10 and learns more, 10 on a CPU, where it costs "
                                     "1.4x the step: docs/results.md, issue 37)")
    k: int = Field(3, ge=1)
    n_candidates: int = Field(90, ge=1)
    per_class: int = Field(9, ge=1, description="S_sub and retrieval candidates per class (N_c / classes)")
    lr: float = Field(0.1, gt=0)
    step: Literal["joint", "separate"] = Field("joint", description="replay step: one forward pass of incoming + "
                                               "replayed samples (joint) or two with summed losses (separate)")
    loss: Literal["ce", "ace"] = Field("ace", description="replay loss: cross-entropy (ce) or ER-ACE's asymmetric "
                                       "cross-entropy (ace)")
    # the stronger learner's options; unset, each takes its method's default (TUNED_DEFAULTS)
    augment: bool | Literal["strong"] | None = Field(None, description="replay methods: random crop + flip of "
                                                     "every training batch (true); strong: random resized crop, "
                                                     "flip, colour jitter and grayscale (unset: true for "
                                                     "cb-sv-duel and er, off for the others)")
    iterations: int | None = Field(None, ge=1, le=16, description="replay methods: SGD steps per incoming batch, "
                                   "each with a fresh replay draw (unset: 2 for cb-sv-duel and er, 1 for the others)")
    ema: float | None = Field(None, ge=0, lt=1, description="predictions and snapshots from a moving average of "
                              "the weights with this decay (0: the trained weights; unset: 0.99 for cb-sv-duel, er and "
                              "sv-upd, 0 for the others)")
    distill: float | None = Field(None, ge=0, description="replay methods, with ASER_EMA: the moving average "
                                  "teaches, a distillation term of this weight (unset: 0, off)")
    serving_bn: Literal["average", "memory"] = Field("average", description="the served BatchNorm statistics: the "
                                                     "moving average's, or recomputed on the memory")
    # on by default (docs/results.md, "A young service"): without it a young service never answers its
    # newest classes (0 of 5 seeds after its third task; 5 of 5 with it, +4.17 +- 3.10 points)
    serving_bias: bool = Field(True, description="serve with a logit bias per class fitted on the memory")
    serving_refresh_steps: int = Field(50, ge=1, description="with ASER_SERVING_BN=memory or ASER_SERVING_BIAS: "
                                       "correct a copy of the served weights on the memory every N steps (and when "
                                       "the memory's classes change); predictions are that many steps old at most")
    head: Literal["softmax", "ncm"] = Field("softmax", description="what predictions and snapshots answer with: "
                                            "the softmax head, or nearest class mean on the memory's features")
    ncm_refresh_steps: int = Field(50, ge=1, description="with ASER_HEAD=ncm: recompute the class means every N "
                                   "steps (and when the memory's classes change)")
    device: str = "auto"
    latent_bf16: bool = Field(False, description="the memory policies' feature passes in bf16 (training and "
                              "predictions stay fp32); ~2x faster ASER steps on CPUs with AMX / AVX-512 BF16")
    seed: int = 0
    max_batch_wait_s: float = Field(2.0, ge=0, description="train a partial batch once its oldest sample waited this long")
    checkpoint_every_steps: int = Field(100, ge=1, description="checkpoint the lineage every N training steps")
    snapshot_every_steps: int = Field(500, ge=0, description="export an ONNX snapshot every N steps and whenever "
                                      "the model has learned a new class (0: only on request)")
    predict_batch_wait_ms: float = Field(1.0, ge=0, le=1000, description="how long a prediction waits for "
                                         "others to share its forward pass (micro-batching)")
    predict_max_batch: int = Field(256, ge=1, description="images per shared forward pass at most")
    online_window: int = Field(1000, ge=1, description="samples in the sliding window of online accuracy")
    history_every_steps: int = Field(10, ge=1, description="store a point of the history every N training steps")
    history_max_points: int = Field(20_000, ge=100, description="past this many points, every second point of the "
                                    "older half of the history is dropped (it stays bounded for months)")
    snapshot_timeout_s: float = Field(120.0, gt=0)
    snapshot_keep: int = Field(20, ge=1, description="keep the newest N snapshots; older files and rows are removed")

    # real time: a stream faster than the learner, or idle
    max_lag_s: float = Field(900.0, ge=0, description="when the oldest untrained sample is older than this, samples "
                             "older than half of it pass through the memory without a gradient step (skipped), "
                             "so predictions are never further behind the stream (0: no bound, a queue)")
    catch_up_memory_share: float = Field(MEMORY_SHARE, gt=0, le=1, description="over the lag bound, the most of the "
                                         "worker's time the skipped samples' memory updates may take; beyond it a "
                                         "random part of them skip the memory too (thinned; learner.catch_up)")
    lean_when_behind: bool | None = Field(None, description="while the oldest untrained sample is older than half "
                                          "of ASER_MAX_LAG_S, train with the method's cheapest step (one iteration, "
                                          "no augmentation; ASER's memory policies give way to the reservoir and "
                                          "random draws), so a costly learner trains on more of the stream than it "
                                          "skips (unset: on for sv-upd and er, where measured, and cb-sv-duel, whose "
                                          "lean form is CBRS's update; off for the others)")
    idle_rehearsal: bool = Field(False, description="replay-only steps from the memory while no batch is due")
    idle_rehearsal_share: float = Field(0.5, gt=0, le=1, description="the most of the worker's time idle rehearsal "
                                        "may take (it pauses between its steps to stay under it)")

    # retention (service.retention): the ingest log's disk stays bounded for months
    retain_pixels_s: float = Field(86400.0, ge=0, description="drop the pixels of samples a checkpoint has trained "
                                   "on once they are this old (the memory keeps its own copies)")
    retain_max_mb: float = Field(1024.0, ge=0, description="and, oldest first, while the database is larger than "
                                 "this (0: no cap)")
    retain_ids_s: float = Field(30 * 86400.0, ge=0, description="keep the rows of dropped pixels (sequence number, "
                                "class, sample id) this long: the horizon of exactly-once ingest across retries")
    retain_every_s: float = Field(60.0, gt=0, description="how often retention runs (0 pixels, 0 ids: each run)")

    # input limits
    max_body_bytes: int = Field(16 * 1024 * 1024, ge=1024)
    max_image_bytes: int = Field(1024 * 1024, ge=64)
    strict_image_size: bool = Field(False, description="refuse images that are not exactly ASER_IMAGE_SIZE square "
                                    "(wrong_shape) instead of resizing them (shorter side, then centre crop)")
    max_samples_per_request: int = Field(1024, ge=1)
    max_label_length: int = Field(100, ge=1)
    max_classes: int = Field(1000, ge=1)
    max_top_k: int = Field(20, ge=1)

    # slow or stalled clients (a device on a bad link, or an attacker holding sockets open)
    header_timeout_s: float = Field(10.0, gt=0, description="close a connection whose request headers are not "
                                    "complete this long after its first byte (or its previous answer)")
    body_timeout_s: float = Field(30.0, gt=0, description="answer 408 when a request body stalls this long "
                                  "between two chunks (not the NDJSON stream, idle between samples)")
    body_deadline_s: float = Field(120.0, gt=0, description="answer 408 when a request body is not whole this long "
                                   "after it began, however it trickles (not the NDJSON stream)")
    max_connections: int = Field(512, ge=1, description="concurrent connections and requests; beyond, 503")
    # the inference replica (python -m service.replica): the learner it follows, and how often it looks
    replica_source: str = "http://127.0.0.1:8000"
    replica_source_token: SecretStr | None = None
    replica_poll_s: float = Field(10.0, gt=0)
    replica_threads: int = Field(0, ge=0, description="onnxruntime intra-op threads (0: its default)")

    # bearer tokens; when set, writes / reads / admin calls need them (admin works everywhere)
    write_token: SecretStr | None = None
    read_token: SecretStr | None = None
    admin_token: SecretStr | None = None

    def check_learner(self) -> None:
        """What a learner needs and a replica does not (a replica neither trains, imports torch,
        nor takes writes): a known method, and a token that may send samples if any is set."""
        from learner.methods import METHODS, REPLAY_METHODS

        if self.method not in METHODS:
            raise ValueError(f"unknown ASER_METHOD {self.method!r}; choose one of {', '.join(METHODS)}")
        chosen = {f: getattr(self, f) for f in ("step", "loss", "augment", "iterations", "distill")
                  if f in self.model_fields_set}
        neutral = {("step", "joint"), ("loss", "ce"), *OPTIONS_OFF.items()}
        if self.method not in REPLAY_METHODS and chosen.items() - neutral:
            raise ValueError("ASER_STEP, ASER_LOSS, ASER_AUGMENT, ASER_ITERATIONS and ASER_DISTILL apply to the "
                             f"replay methods, not {self.method}")
        if self.option("distill") and not self.option("ema"):
            raise ValueError("ASER_DISTILL needs a moving average to teach: set ASER_EMA")
        if self.read_token is not None and self.write_token is None and self.admin_token is None:
            raise ValueError("ASER_READ_TOKEN alone would let nobody send samples: set ASER_WRITE_TOKEN or "
                             "ASER_ADMIN_TOKEN too")

    def replay_objective(self) -> dict:
        """`step` and `loss` for the learner: their defaults are the replay methods'; the other
        methods (EWC, A-GEM, fine-tune) have a loss of their own and take neither."""
        from learner.methods import REPLAY_METHODS

        return {"step": self.step, "loss": self.loss} if self.method in REPLAY_METHODS else {}

    def stronger_learner(self) -> dict:
        """ASER_AUGMENT, ASER_ITERATIONS, ASER_DISTILL and ASER_EMA for the learner, where they are on
        (the first three for the replay methods; the average serves any method).

        >>> Settings(method="sv-upd", augment=True, ema=0.99).stronger_learner()
        {'augment': True, 'ema_decay': 0.99}
        >>> Settings(method="er").stronger_learner() == Settings().stronger_learner()
        True
        >>> Settings().stronger_learner(), Settings(method="aser-mu").stronger_learner()
        ({'augment': True, 'iterations': 2, 'ema_decay': 0.99}, {})
        >>> Settings(method="ewc", ema=0.99).stronger_learner()
        {'ema_decay': 0.99}
        """
        from learner.methods import REPLAY_METHODS

        replay = self.method in REPLAY_METHODS
        augment, iterations, ema = self.option("augment"), self.option("iterations"), self.option("ema")
        chosen = {"augment": (replay and augment) or None,
                  "iterations": iterations if replay and iterations != 1 else None,
                  "distill": (replay and self.option("distill")) or None,
                  "ema_decay": ema or None}
        return {k: v for k, v in chosen.items() if v is not None}

    def replay_batch_on(self, device: str) -> int:
        """The replay batch as set, else 20 on a GPU and 10 on a CPU. Issue 37: 20 lifts the default by
        +2.73 ± 1.32 A_T at M=1000 (10 paired seeds), +2.58 ± 3.36 at M=500, +0.84 ± 4.35 at M=200 (5 each);
        on an H100 its step takes 0.98x the default's, on one CPU thread 1.40x (over 3x ER's step there: rule 5,
        docs/results.md).

        >>> Settings().replay_batch_on("cuda:0"), Settings().replay_batch_on("cpu")
        (20, 10)
        >>> Settings(replay_batch=5).replay_batch_on("cuda")
        5
        """
        if self.replay_batch is not None:
            return self.replay_batch
        return 20 if device.startswith("cuda") else 10

    def option(self, name: str) -> bool | int | float:
        """A learner option (OPTIONS_OFF's) as set, else its method's default (TUNED_DEFAULTS).

        >>> Settings(method="er").option("iterations"), Settings(method="sv-upd").option("iterations")
        (2, 1)
        >>> Settings().method, Settings().option("augment"), Settings().option("iterations")
        ('cb-sv-duel', True, 2)
        >>> Settings(method="er", ema=0).option("ema")
        0.0
        >>> Settings().option("lean_when_behind"), Settings(method="aser-mu").option("lean_when_behind")
        (True, False)
        """
        value = getattr(self, name)
        return value if value is not None else TUNED_DEFAULTS.get(self.method, OPTIONS_OFF)[name]

    def learner_identity(self) -> dict[str, str]:
        """The settings that decide how the learner trains, as environment variables: a checkpoint
        made under some does not go on under others (the stronger learner's only where on, so a data
        directory made before they existed goes on).

        >>> Settings(method="er", iterations=1, ema=0.99).learner_identity()
        {'ASER_METHOD': 'er', 'ASER_STEP': 'joint', 'ASER_LOSS': 'ace', 'ASER_AUGMENT': 'True'}
        """
        # the moving average only serves: a lineage may take it up or drop it
        training = {k: v for k, v in self.stronger_learner().items() if k != "ema_decay"}
        chosen = {"method": self.method, **self.replay_objective(), **training}
        return {f"ASER_{k.removesuffix('_decay').upper()}": str(v) if not isinstance(v, str) else v
                for k, v in chosen.items()}

    def follow_lineage(self, identity: dict[str, str] | None) -> dict[str, object]:
        """Take the training settings of the lineage already in the data directory (its checkpoint's
        `learner_identity`) wherever this configuration leaves them unset: a data directory made
        under an older release's defaults goes on as it was trained. Set ones stay, and a restore
        under them is refused as before. Returns the settings taken.

        >>> s = Settings(loss="ace")
        >>> s.follow_lineage({"ASER_METHOD": "er", "ASER_STEP": "joint", "ASER_LOSS": "ce"})
        {'method': 'er', 'augment': False, 'iterations': 1}
        >>> s.method, s.loss, s.learner_identity()
        ('er', 'ace', {'ASER_METHOD': 'er', 'ASER_STEP': 'joint', 'ASER_LOSS': 'ace'})
        """
        if not identity:  # no checkpoint yet, or one from before identities were saved
            return {}
        # the identity names the stronger learner's options only where they were on
        saved = {**{k: str(v) for k, v in OPTIONS_OFF.items()},
                 **{k.removeprefix("ASER_").lower(): v for k, v in identity.items()}}
        taken = {}
        for name in LINEAGE_SETTINGS:
            if name in self.model_fields_set or name not in saved:
                continue
            value = TypeAdapter(type(self).model_fields[name].annotation).validate_python(saved[name])
            if value != (self.option(name) if name in OPTIONS_OFF else getattr(self, name)):
                taken[name] = value
                setattr(self, name, value)
        return taken

    @property
    def database_path(self) -> Path:
        return self.data_dir / "aser.db"

    @property
    def auth_enabled(self) -> bool:
        return any(t is not None for t in (self.write_token, self.read_token, self.admin_token))
