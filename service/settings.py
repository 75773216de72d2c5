"""All service settings in one place: environment variables prefixed ASER_, or a .env file. Plain validated
data: which learner they make with a data directory is answered once, at start-up, by `service.learning.lineage`.

>>> Settings(method="er").method
'er'
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from learner.catch_up import MEMORY_SHARE

POOLED_CUT = 17  # learner.networks.lite0.POOLED, written here: the replica reads these settings without torch


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
    # the lower-valued of two random members of the class leaves), random retrieval, the ACE loss and a moving
    # average, the paper's CIFAR-10 settings; from scratch also augmentation and 2 iterations (TUNED_DEFAULTS), on
    # the pretrained backbone streaming LDA serving (PRETRAINED_DEFAULTS, `service.learning.lineage`). The backbone is
    # EfficientNet-Lite0's ImageNet weights since 2026-11-28 (docs/results/pretrained.md, rule 4: +17.7 A_T and +26.9
    # at ten images of a new class over the from-scratch default, at its CPU cost). What a data directory's lineage was
    # trained with goes on where these leave it unset: a directory made from scratch goes on from scratch.
    method: str = "cb-sv-duel"
    backbone: Literal["scratch", "lite0"] = Field("lite0", description="lite0: EfficientNet-Lite0's ImageNet "
                                                  "weights frozen below ASER_CUT, the memory holding its latents "
                                                  "(latent replay), useful from the first images; scratch: the "
                                                  "paper's reduced ResNet18 from random weights on 32x32 pixels "
                                                  "(the research protocol)")
    image_size: int | None = Field(None, ge=8, le=512, description="the side every image is brought to (the one "
                                   "input rule; unset: 32 from scratch, 160 on lite0, by the rule in "
                                   "docs/results/pretrained.md)")
    cut: int | None = Field(None, ge=0, le=POOLED_CUT, description="lite0: the first trainable block (17: only the "
                            "linear head trains on the pooled features; 11: the last two stages too; unset: 17, or 11 "
                            "with ASER_SLEEP)")
    latent_bits: int = Field(16, description="lite0: the memory's latents in fp16 (16), or 8 bits (pooled only)")
    mem_size: int = Field(1000, ge=0)
    batch_size: int = Field(10, ge=1)
    replay_batch: int | None = Field(None, ge=0, description="memory samples replayed a step (unset: 20 on a GPU, "
                                     "where it costs no more than 10 and learns more, 10 on a CPU, where it costs "
                                     "1.4x the step: docs/results/past-one-pass.md)")
    k: int = Field(3, ge=1)
    n_candidates: int = Field(90, ge=1)
    per_class: int = Field(9, ge=1, description="S_sub and retrieval candidates per class (N_c / classes)")
    lr: float | None = Field(None, gt=0, description="SGD's learning rate (unset: 0.1 from scratch, 0.01 on lite0)")
    step: Literal["joint", "separate"] = Field("joint", description="replay step: one forward pass of incoming + "
                                               "replayed samples (joint) or two with summed losses (separate)")
    loss: Literal["ce", "ace", "ace-lone"] = Field("ace", description="replay loss: cross-entropy (ce), ER-ACE's "
                                                   "asymmetric cross-entropy (ace), or ace with a batch of one class "
                                                   "learned by cross-entropy (ace-lone)")
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
    # on by default (docs/results/past-one-pass.md): without it a young service never answers its
    # newest classes (0 of 5 seeds after its third task; 5 of 5 with it, +4.17 +- 3.10 points)
    serving_bias: bool | None = Field(None, description="serve with a logit bias per class fitted on the memory "
                                      "(unset: on from scratch; off on lite0, where streaming LDA serves)")
    serving_refresh_steps: int = Field(50, ge=1, description="with ASER_SERVING_BN=memory or ASER_SERVING_BIAS: "
                                       "correct a copy of the served weights on the memory every N steps (and when "
                                       "the memory's classes change); predictions are that many steps old at most")
    head: Literal["softmax", "ncm", "slda", "chosen"] | None = Field(
        None, description="what predictions and snapshots answer with: the trained softmax head, nearest class mean "
        "on the memory's features, (lite0) streaming LDA on the frozen features, which every sample reaches, or "
        "(lite0) chosen: each class by the head measured best on it (ASER_HEAD_MEASURE), streaming LDA, the trained "
        "top, their mean or their pool (learner.heads.head_choice) (unset: softmax from scratch, slda on lite0)")
    head_measure: Literal["stream", "held-back"] = Field(
        "held-back", description="with ASER_HEAD=chosen: choose each class's head on a few samples of every class "
        "held back from all training (held-back: learner.heads.held_back), which see an old class forgotten, or on "
        "the incoming samples, scored before each step (stream)")
    head_prior: Literal["slda", "top", "mix", "pool", "none"] | None = Field(
        None, description="with ASER_HEAD_MEASURE=held-back: this head takes each class measured on held-back "
        "samples unless they show it worse (mix: the mean of streaming LDA's and the top's probabilities; pool: "
        "their log-linear pool, weighted by likelihood on the held-back samples; none: a class moves only to a head "
        "measured better; unset: pool, the rule measured best at full length)")
    trained_head_from: int | None = Field(None, ge=1, description="with ASER_HEAD=slda: the trained head serves "
                                          "(and snapshots export it) once every class seen has this many samples, "
                                          "streaming LDA while any is younger (unset: streaming LDA always)")
    ncm_refresh_steps: int = Field(50, ge=1, description="with ASER_HEAD=ncm: recompute the class means every N "
                                   "steps (and when the memory's classes change)")
    device: str = "auto"
    latent_bf16: bool = Field(False, description="the memory policies' feature passes in bf16 (training and "
                              "predictions stay fp32); ~2x faster ASER steps on CPUs with AMX / AVX-512 BF16")
    seed: int = 0
    max_batch_wait_s: float = Field(2.0, ge=0, description="train a partial batch once its oldest sample waited this long")
    checkpoint_every_steps: int = Field(100, ge=1, description="checkpoint the lineage every N training steps, and "
                                        "at least every ASER_MAX_LAG_S / 2 seconds while it trains (what a kill "
                                        "adds to the lag)")
    snapshot_every_steps: int = Field(500, ge=0, description="export an ONNX snapshot every N steps and whenever "
                                      "the model has learned a new class (0: only on request)")
    predict_batch_wait_ms: float = Field(1.0, ge=0, le=1000, description="how long a prediction waits for "
                                         "others to share its forward pass (micro-batching)")
    predict_max_batch: int = Field(16, ge=1, description="images per shared forward pass at most; a larger "
                                   "request goes in slices of this many, taking turns with the others, so a "
                                   "one-photo request waits for one slice of each request ahead, not for them whole")
    online_window: int = Field(1000, ge=1, description="samples in the sliding window of online accuracy")
    online_score_top_every: int = Field(4, ge=1, description="once a sleep's top answers, the online score answers "
                                        "one incoming batch in this many (the top's pass over a batch costs a fifth "
                                        "of the ingest path); 1: every batch")
    history_every_steps: int = Field(10, ge=1, description="store a point of the history every N training steps")
    history_max_points: int = Field(20_000, ge=100, description="past this many points, every second point of the "
                                    "older half of the history is dropped (it stays bounded for months)")
    snapshot_timeout_s: float = Field(120.0, gt=0)
    snapshot_keep: int = Field(20, ge=1, description="keep the newest N snapshots; older files and rows are removed")
    snapshot_int8: bool = Field(False, description="also export each snapshot quantised to int8 (onnxruntime's "
                                "static quantisation, calibrated on recent images), kept where its top-1 agrees with "
                                "the fp32 graph on ASER_SNAPSHOT_INT8_MIN_AGREEMENT of other recent images")
    snapshot_int8_min_agreement: float = Field(0.98, ge=0, le=1)
    snapshot_int8_images: int = Field(64, ge=16, le=1024, description="recent images an int8 export calibrates on "
                                      "and checks against (half each; onnxruntime's calibration keeps every "
                                      "activation of its half in memory)")

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
    idle_rehearsal_per_step: int = Field(0, ge=0, description="the most replay-only steps idle rehearsal takes for "
                                         "each stream step trained, the budget growing with the stream (0: no "
                                         "bound but the share); a memory replayed without end fits itself")

    # probabilities that mean what they say, and "none of these" (learner.heads.calibration)
    calibrate: bool | None = Field(None, description="divide the served logits by a temperature fitted on samples "
                                   "held back from training (up to 20 a class, from its 20th on) and call an image "
                                   "far from every learned class \"none of these\" (unknown in /predict and the "
                                   "snapshot) (unset: on with lite0, off from scratch)")
    unknown_false_alarm: float = Field(0.05, gt=0, lt=0.5, description="with ASER_CALIBRATE: the share of known "
                                       "classes' photos that \"none of these\" flags (its threshold's quantile on "
                                       "the held-back samples)")

    # sleep (learner.methods.sleep): while the device is idle, the top above the cut trains i.i.d.-style over the
    # latents of every sample it was sent (docs/operations.md#sleep)
    sleep: bool | None = Field(None, description="train the top in sleeps: after ASER_SLEEP_IDLE_S without a sample "
                               "to train, and on POST /sleep; awake, the top does not step (streaming LDA and ASER's "
                               "memory learn each batch), and each class is served by the head its held-back samples "
                               "choose (unset ASER_CUT and ASER_HEAD become 11 and chosen) (unset: on for a replay "
                               "method on lite0 with ASER_HEAD, ASER_TRAINED_HEAD_FROM and ASER_IDLE_REHEARSAL "
                               "unset, unless the data directory's lineage was made at another cut; off from scratch)")
    sleep_idle_s: float = Field(30.0, ge=0, description="with ASER_SLEEP: seconds without a sample to train before "
                                "a sleep starts")
    sleep_min_new: int = Field(100, ge=1, description="with ASER_SLEEP: samples new since the last sleep that an idle "
                               "sleep waits for (POST /sleep does not)")
    sleep_fresh_idle_s: float = Field(3600.0, ge=0, description="with ASER_SLEEP: seconds without a sample to train "
                                      "after which the next sleep is fresh (the top trained again from ImageNet's "
                                      "weights over everything held, at offline training's CPU: a night's sleep), "
                                      "once enough has arrived since the last fresh one (ASER_SLEEP_FRESH_GROWTH); "
                                      "0: only on POST /sleep?fresh=true")
    sleep_fresh_growth: float = Field(1.0, ge=0, description="with ASER_SLEEP_FRESH_IDLE_S: a night's sleep waits "
                                      "until the samples arrived since the last fresh sleep are this share of those "
                                      "before it, and at least ASER_SLEEP_MIN_NEW (1: the nights' passes together at "
                                      "most twice the last's, however often the device idles)")
    sleep_epochs: float = Field(4.0, gt=0, le=100, description="with ASER_SLEEP: a sleep's budget, sample-updates "
                                "for each sample new since the last sleep")
    sleep_fresh_epochs: float | None = Field(None, gt=0, le=100, description="with ASER_SLEEP: a fresh sleep's passes "
                                             "over everything held (unset: ASER_SLEEP_EPOCHS)")
    sleep_schedule: Literal["constant", "cosine"] = Field("constant", description="with ASER_SLEEP: a sleep's SGD "
                                                          "rate, constant or annealed to zero over each sleep")
    sleep_draw: Literal["balanced", "shuffled"] = Field("balanced", description="with ASER_SLEEP: a sleep's "
                                                        "batches, class-balanced with replacement or shuffled "
                                                        "passes over everything held")
    sleep_store_mb: float = Field(512.0, gt=0, description="with ASER_SLEEP: the latent store's size on disk; when full, "
                                  "a new sample evicts a random one of the largest class")
    pixel_store_mb: float = Field(256.0, ge=0, description="with ASER_SLEEP: the night's pixel store, the photos sent "
                                  "as JPEG at the input size for a night to train the layers below the cut, whatever "
                                  "ASER_RETAIN_* drop; when full, a new photo evicts a random one of the largest class "
                                  "(0: none)")

    # retention (service.storage.retention): the ingest log's disk stays bounded for months
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
    # a camera photo's prediction costs about 7 ms of one core here (decoding 1.6, the frozen part 5.1:
    # results/speed/service-cost-after.json): 256 of them about 1.7 s, the most one request may ask
    max_predict_images: int = Field(256, ge=1, description="images a prediction request may hold at most")
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
    replica_int8: bool = Field(False, description="serve a snapshot's int8 variant where it has one (the learner's "
                               "ASER_SNAPSHOT_INT8), its fp32 file otherwise")

    # bearer tokens; when set, writes / reads / admin calls need them (admin works everywhere)
    write_token: SecretStr | None = None
    read_token: SecretStr | None = None
    admin_token: SecretStr | None = None

    @property
    def database_path(self) -> Path:
        return self.data_dir / "aser.db"

    @property
    def auth_enabled(self) -> bool:
        return any(t is not None for t in (self.write_token, self.read_token, self.admin_token))
