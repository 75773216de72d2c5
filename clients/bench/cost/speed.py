"""Speed benchmark of the learner's hot paths, on random-but-fixed data, in one run.

Cases, each timed step by step, interleaved round by round so that a slow moment of a noisy
machine hits every case alike (ratios are what count):
- default-step: the bare model's forward+backward+SGD on 20 images with plain PyTorch
  defaults (NCHW, float32, autograd as is);
- bare-step: the same step as the learner runs it (its memory format; bf16 with --bf16,
  torch.compile with --compile);
  (--bf16-latent runs only the memory policies' feature passes in bf16, training stays fp32)
- er, aser, aser-mu, mir: one full `observe` of 10 new images with a full memory (M=1000,
  10 classes, K=3, N_c=90: the paper's CIFAR-10 settings), replay batch 10;
- er-ace, sv-upd-ace, er-ace-aug-it2-ema (the stronger learner's options: crop + flip, 2 steps
  per batch, a moving-average serving head), er-ace-aug-ema and sv-upd-ace-ema (one step per
  batch, with the average; the service's default): the same `observe`;
- the class-balanced memories (cbrs, cb-sv-duel, and ASER's retrieval on the duel memory:
  cb-aser, cb-aser-mu) and issue 37's options (strong augmentation, distillation, a third
  iteration, a replay batch of 20) under the stronger options;
- inference-100: logits of 100 images; serving-bn-refresh and serving-bias-refresh: the served
  average corrected on a full memory, its BatchNorm statistics or its logit bias (samples/s:
  memory images a second).

`--dataset mini-imagenet` prices the same cases on that stream's shapes (84x84 images, 100
classes, the paper's K and N_c for it): what a run there costs before it is started.

    python -m clients.bench.benchmark speed --out results/speed/speed-cpu.json
    python -m clients.bench.benchmark speed --threads 1 --rounds 100 --cases er,cb-sv-duel-ace-aug-it2-ema
    python -m clients.bench.benchmark speed --dataset mini-imagenet --threads 1 --rounds 20 --cases er,er-ace
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch
from torch.nn import functional as F

from clients.bench.results import write_result
from learner import make_learner
from learner.data import CLASSES
from learner.methods.base import training_channels_last
from learner.networks.reduced_resnet import ReducedResNet18


def _bare_step(channels_last: bool, autocast_dtype, device, x, y, compile: bool = False, num_classes: int = 10):
    model = ReducedResNet18(num_classes, input_size=x.shape[-1]).to(device)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
        x = x.contiguous(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    forward = torch.compile(model) if compile else model

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=autocast_dtype or torch.float32, enabled=autocast_dtype is not None):
            logits = forward(x)
        F.cross_entropy(logits.float(), y).backward()
        opt.step()

    return step


# environment variables that change the C heap (glibc's tunables, a preloaded allocator): recorded
ALLOCATOR_ENV = ("LD_PRELOAD", "MALLOC_MMAP_THRESHOLD_", "MALLOC_ARENA_MAX", "MALLOC_TRIM_THRESHOLD_")

# the configurations timed beside the paper's methods: name -> (method, options)
OPTION_CASES = {
    "er-ace": ("er", {"loss": "ace"}),
    "sv-upd-ace": ("sv-upd", {"loss": "ace"}),
    "er-ace-aug-it2-ema": ("er", {"loss": "ace", "augment": True, "iterations": 2, "ema_decay": 0.99}),
    "er-ace-aug-ema": ("er", {"loss": "ace", "augment": True, "ema_decay": 0.99}),
    "sv-upd-ace-ema": ("sv-upd", {"loss": "ace", "ema_decay": 0.99}),
    # the class-balanced memories under the stronger options (issue 36: at most 1.25x the reservoir's step)
    "cbrs-ace-aug-it2-ema": ("cbrs", {"loss": "ace", "augment": True, "iterations": 2, "ema_decay": 0.99}),
    "cb-sv-duel-ace-aug-it2-ema": ("cb-sv-duel", {"loss": "ace", "augment": True, "iterations": 2,
                                                  "ema_decay": 0.99}),
    # ASER's retrieval (ASV, ASV_mu) on the duel memory: at most 1.25x the duel's random retrieval (rule 2)
    **{f"{m}-ace-aug-it2-ema": (m, {"loss": "ace", "augment": True, "iterations": 2, "ema_decay": 0.99})
       for m in ("cb-aser", "cb-aser-mu")},
    # issue 37's options on the best configuration
    "er-ace-augstrong-it2-ema": ("er", {"loss": "ace", "augment": "strong", "iterations": 2, "ema_decay": 0.99}),
    "er-ace-aug-it2-ema-kd1": ("er", {"loss": "ace", "augment": True, "iterations": 2, "ema_decay": 0.99,
                                      "distill": 1.0}),
    "er-ace-aug-it3-ema": ("er", {"loss": "ace", "augment": True, "iterations": 3, "ema_decay": 0.99}),
    **{f"{m}-ace-aug-it2-ema-rb20": (m, {"loss": "ace", "augment": True, "iterations": 2, "ema_decay": 0.99,
                                          "replay_batch": 20}) for m in ("er", "cb-sv-duel")},
}


BEST = "er-ace-aug-it2-ema"  # today's best configuration, what the options are priced against
DUEL = "cb-sv-duel-ace-aug-it2-ema"  # the balanced ASER memory with random retrieval, what ASV is priced against


# the streams a step can be priced on: dataset -> its images' side (its classes: `learner.data.CLASSES`)
IMAGE_SIDES = {"cifar10": 32, "mini-imagenet": 84}


def _learner_step(method: str, *, device, images, labels, autocast_dtype, mem_size: int, compile: bool = False,
                  latent_dtype=None, dataset: str = "cifar10", **options):
    learner = make_learner(method, num_classes=CLASSES[dataset], mem_size=mem_size, dataset=dataset, device=device,
                           seed=0, image_shape=tuple(images.shape[1:]), autocast_dtype=autocast_dtype,
                           latent_dtype=latent_dtype, compile=compile, **options)
    learner.buffer.append(images[:mem_size], labels[:mem_size])
    learner.buffer.n_seen = 10 * mem_size  # a stream well past the memory size
    if (seen := getattr(learner.update_policy, "seen", None)) is not None:  # the class-balanced memories' n_c
        seen.update({c: 10 * n for c, n in learner.buffer.class_counts().items()})
    state = {"i": mem_size}

    def step():
        i = state["i"] % (images.shape[0] - 10)
        learner.observe(images[i:i + 10], labels[i:i + 10])
        state["i"] = i + 10

    step.learner = learner  # what it times, for whoever checks what was built
    return step


def _serving_refresh(device, images, labels, mem_size: int, num_classes: int = 10, **correction):
    """Correcting the served average on a full memory (`ContinualLearner.refresh_serving`)."""
    learner = make_learner("er", num_classes=num_classes, mem_size=mem_size, device=device, seed=0, ema_decay=0.99,
                           image_shape=tuple(images.shape[1:]), **correction)
    learner.buffer.append(images[:mem_size], labels[:mem_size])
    return learner.refresh_serving


def measure(device: torch.device, rounds: int, warmup: int, bf16: bool, compile: bool = False,
            mem_size: int = 1000, bf16_latent: bool = False, only: list[str] | None = None,
            dataset: str = "cifar10") -> dict:
    """Median and mean ms of each case (all, or those named in `only`), timed round by round."""
    g = torch.Generator().manual_seed(0)
    shape, num_classes = (3, IMAGE_SIDES[dataset], IMAGE_SIDES[dataset]), CLASSES[dataset]
    images = torch.randint(0, 256, (mem_size + 2000, *shape), dtype=torch.uint8, generator=g)
    labels = torch.randint(0, num_classes, (mem_size + 2000,), generator=g)
    x20 = (images[:20].float() / 255).to(device)
    y20 = labels[:20].to(device)
    dtype = torch.bfloat16 if bf16 else None
    latent = torch.bfloat16 if bf16_latent else None
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    step = partial(_learner_step, device=device, images=images, labels=labels, autocast_dtype=dtype,
                   mem_size=mem_size, compile=compile, latent_dtype=latent, dataset=dataset)
    refresh = partial(_serving_refresh, device, images, labels, mem_size, num_classes)
    bare = partial(_bare_step, device=device, x=x20, y=y20, num_classes=num_classes)
    # name -> (what builds the timed callable, samples it handles): only the cases asked for are built
    builders = {
        "default-step": (lambda: bare(False, None), 20),
        "bare-step": (lambda: bare(training_channels_last(device, dtype), dtype, compile=compile), 20),
        **{name: (partial(step, name), 10) for name in ("er", "aser", "aser-mu", "mir")},
        **{name: (partial(step, method, **options), 10) for name, (method, options) in OPTION_CASES.items()},
        "inference-100": (lambda: partial(make_learner("er", num_classes=num_classes, mem_size=0, device=device,
                                                       image_shape=shape, autocast_dtype=dtype).logits,
                                          images[:100]), 100),
        "serving-bn-refresh": (partial(refresh, serving_bn="memory"), mem_size),
        "serving-bias-refresh": (partial(refresh, serving_bias=True), mem_size),
    }
    unknown = sorted(set(only or ()) - set(builders))
    if unknown:
        raise ValueError(f"unknown cases {', '.join(unknown)}; choose from {', '.join(builders)}")
    cases = {name: (build(), n) for name, (build, n) in builders.items() if not only or name in only}
    times = {name: [] for name in cases}
    for r in range(warmup + rounds):
        for name, (fn, _) in cases.items():
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            if r >= warmup:
                times[name].append(time.perf_counter() - t0)
    out = {}
    for name, (_, n) in cases.items():
        med = statistics.median(times[name])
        # the mean carries what comes every few steps (the balanced memories' feature cache, refreshed
        # every 100 optimizer steps): with rounds >= 100 it is the amortised cost
        out[name] = {"median_ms": round(1000 * med, 2), "mean_ms": round(1000 * statistics.fmean(times[name]), 2),
                     "samples_per_s": round(n / med, 1),
                     "p10_ms": round(1000 * sorted(times[name])[len(times[name]) // 10], 2)}
    return out


def ratios(cases: dict) -> dict:
    """Each ratio whose two cases were timed: medians, and means for what refreshes every few steps."""
    pairs = [("er", "bare-step"), ("aser-mu", "er"), ("aser", "er"), *((name, "er") for name in OPTION_CASES)]
    out = {f"{a} / {b}": round(cases[a]["median_ms"] / cases[b]["median_ms"], 3)
           for a, b in pairs if a in cases and b in cases}
    for name in OPTION_CASES:
        if name.startswith(("cb", "er-ace-aug")) and name != BEST and name in cases and BEST in cases:
            out[f"{name} / {BEST} (means)"] = round(cases[name]["mean_ms"] / cases[BEST]["mean_ms"], 3)
        if name.startswith("cb-aser") and name in cases and DUEL in cases:
            out[f"{name} / {DUEL} (means)"] = round(cases[name]["mean_ms"] / cases[DUEL]["mean_ms"], 3)
    if "default-step" in cases and "bare-step" in cases:
        out["default-step / bare-step"] = round(cases["default-step"]["median_ms"] / cases["bare-step"]["median_ms"], 3)
    return out


def cmd_speed(args) -> int:
    from clients.bench.machine import machine_description, resolve_device

    device = resolve_device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    only = args.cases.split(",") if args.cases else None
    try:
        cases = measure(device, args.rounds, args.warmup, args.bf16, args.compile, bf16_latent=args.bf16_latent,
                        only=only, dataset=args.dataset)
    except ValueError as exc:  # an unknown case name
        print(f"error: {exc}", file=sys.stderr)
        return 2
    result = {
        "device": str(device),
        "dataset": args.dataset,
        "machine": machine_description(device),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "bf16": args.bf16,
        "bf16_latent": args.bf16_latent,
        "compile": args.compile,
        "rounds": args.rounds,
        "cases": cases,
        "ratios": ratios(cases),
        "allocator": {k: v for k, v in os.environ.items() if k in ALLOCATOR_ENV},  # the C heap's settings
        "command": f"python -m clients.bench.benchmark speed --device {args.device} --rounds {args.rounds}"
                   f"{f' --dataset {args.dataset}' if args.dataset != 'cifar10' else ''}"
                   f"{' --bf16' if args.bf16 else ''}{' --bf16-latent' if args.bf16_latent else ''}"
                   f"{' --compile' if args.compile else ''}"
                   f"{f' --threads {args.threads}' if args.threads else ''}"
                   f"{f' --cases {args.cases}' if args.cases else ''}",
        "measured": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    width = max(map(len, cases))
    for name, c in cases.items():
        print(f"{name:<{width}}  {c['median_ms']:8.2f} ms  {c['samples_per_s']:9.1f} samples/s")
    for name, value in result["ratios"].items():
        print(f"{name}: {value}")
    suffix = (f"-{args.dataset}" if args.dataset != "cifar10" else "") + ("-bf16" if args.bf16 else "") + ("-bf16-latent" if args.bf16_latent else "") + \
        ("-compile" if args.compile else "")
    out = Path(args.out or f".cache/bench/speed-{device.type}{suffix}.json")  # results/ only when named
    write_result(out, result)
    print(f"wrote {out}")
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("speed", help="median ms per step of the hot paths, written to --out (default .cache/bench/speed-<device>.json)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dataset", choices=sorted(IMAGE_SIDES), default="cifar10",
                   help="the stream whose shapes the steps run on (images, classes, the paper's K and N_c)")
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--bf16", action="store_true", help="bf16 autocast for the learner's steps")
    p.add_argument("--bf16-latent", action="store_true",
                   help="bf16 for the memory policies' feature passes only (training stays as --bf16 says)")
    p.add_argument("--compile", action="store_true", help="torch.compile the training forward (~30 s per model)")
    p.add_argument("--threads", type=int)
    p.add_argument("--cases", help="comma-separated case names to time (default: all), e.g. "
                                   "er,cbrs-ace-aug-it2-ema,cb-sv-duel-ace-aug-it2-ema")
    p.add_argument("--out")
    p.set_defaults(func=cmd_speed)
