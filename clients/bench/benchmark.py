"""Offline benchmark client: replay Split CIFAR-10/100 or Mini-ImageNet through any method of
the paper and report its metrics.

    python -m clients.bench.benchmark run --dataset cifar10 --data ../shared/datasets/cifar10-jpeg.zip \
        --method aser-mu --mem-size 1000 --seed 0 1 2 --out results/cifar10/aser-mu-m1000.json
    python -m clients.bench.benchmark table results/cifar10 --out results/cifar10/table.md --compare er aser-mu
    python -m clients.bench.benchmark sweep results/grid-memory.toml --jobs 1 --threads 1 --out results
    python -m clients.bench.benchmark speed          # writes .cache/bench/speed-cpu.json unless --out
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from clients.bench.machine import resolve_device
from clients.bench.results import comparisons, group, load_results, write_result
from clients.bench.stream.latents import encoded_dataset, frozen_forward_cpu_ms
from clients.bench.stream.plots import plot_accuracy, plot_seeds
from clients.bench.stream.protocol import augment_policy, format_matrix, run_once, stream_costs
from clients.bench.stream.realtime import DEFAULT_COST_MODEL
from clients.bench.stream.resume import CheckpointMismatch
from clients.bench.stream.tables import (
    anytime_comparison_table,
    candidates_table,
    comparison_table,
    corrections_table,
    load_paper,
    noise_table,
    seeds_table,
    summary_table,
)
from learner import METHODS
from learner.catch_up import MEMORY_SHARE
from learner.data import CLASSES, PHOTOS, ImageDataset, load_dataset
from learner.heads.head_choice import CANDIDATES
from learner.heads.streaming_lda import HEADS
from learner.methods.base import OPTIMIZERS, SERVING_BN
from learner.methods.objective import LOSSES, STEPS
from learner.methods.registry import IID_EPOCHS
from learner.methods.sleep import DRAWS as SLEEP_DRAWS
from learner.methods.sleep import SCHEDULES as SLEEP_SCHEDULES
from learner.methods.sleep import SOURCES as SLEEP_SOURCES
from learner.networks.backbone import BACKBONES, make_backbone
from learner.networks.lite0 import POOLED


def output_path(out: str, seed: int, several: bool) -> Path:
    if "{seed}" in out:
        return Path(out.format(seed=seed))
    p = Path(out)
    return p.with_name(f"{p.stem}-seed{seed}{p.suffix or '.json'}") if several else p


def cmd_run(args) -> int:
    try:
        data = load_dataset(args.dataset, args.data, args.train_per_class, args.test_per_class, args.cache_dir,
                            input_size=args.input_size if args.dataset == PHOTOS else None)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.checkpoint and args.via:
        print("error: --checkpoint is for in-process runs (a service keeps its own checkpoints)", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.backbone != "scratch":
        if args.via or args.stream_rate:
            print("error: --backbone is for in-process runs on the ordinary protocol", file=sys.stderr)
            return 2
        data = with_backbone(args, data)
    if args.rehearsals and (args.stream_rate or args.via or args.method in IID_EPOCHS or args.rehearsals < 0):
        print("error: --rehearsals is for in-process streams on the ordinary protocol (the real-time one has "
              "--idle-rehearsal)", file=sys.stderr)
        return 2
    if args.sleep_every and (args.stream_rate or args.via or args.method in IID_EPOCHS or args.sleep_every < 0):
        print("error: --sleep-every is for in-process streams on the ordinary protocol", file=sys.stderr)
        return 2
    if args.fresh_sleep_at_end and not args.sleep_every:
        print("error: --fresh-sleep-at-end needs a sleep schedule (--sleep-every)", file=sys.stderr)
        return 2
    if args.fresh_sleep_epochs is not None and (not args.fresh_sleep_at_end or args.fresh_sleep_epochs <= 0):
        print("error: --fresh-sleep-epochs is a positive count for --fresh-sleep-at-end", file=sys.stderr)
        return 2
    if args.calibrate_only:
        args.stream_rate = args.stream_rate or "1x"
        costs, rate = stream_costs(args, data, resolve_device(args.device))
        print(json.dumps({**costs, "stream_rate": rate}, indent=2))
        return 0
    for seed in args.seed:
        checkpoint = output_path(args.checkpoint, seed, len(args.seed) > 1) if args.checkpoint else None
        try:
            result = run_once(args, data, seed, progress=not args.quiet, checkpoint=checkpoint)
        except CheckpointMismatch as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        fgt = result["average_forgetting"]
        print(f"\n{args.method} on {args.dataset}, M={args.mem_size}, seed {seed}: "
              f"A_T = {result['average_accuracy']:.2f}%, F_T = {'n/a' if fgt is None else f'{fgt:.2f}%'}, "
              f"{result['train_seconds']:.0f}s training, {result['steps']} steps")
        print(format_matrix(result["accuracy_matrix"]))
        if args.out:
            path = output_path(args.out, seed, len(args.seed) > 1)
            write_result(path, result)
            print(f"wrote {path}")
        if checkpoint:
            checkpoint.unlink(missing_ok=True)  # the run is complete: nothing to resume
    return 0


def with_backbone(args, data: ImageDataset) -> ImageDataset:
    """Build the run's pretrained backbone, time its frozen forward on this thread, and give the
    dataset as its cached latents (`clients.bench.stream.latents`)."""
    args.backbone_object = make_backbone(args.backbone, data.image_shape, args.input_size, args.cut,
                                         args.latent_bits, standardize=args.standardize_features)
    args.frozen_forward_cpu_ms = frozen_forward_cpu_ms(args.backbone_object, data.train_x)
    return encoded_dataset(data, args.backbone_object, args.cache_dir)


def cmd_table(args) -> int:
    results = load_results(Path(args.folder))
    if not results:
        print(f"error: no result files in {args.folder}", file=sys.stderr)
        return 2
    groups = group(results)
    text = summary_table(groups, load_paper(Path(args.paper)) if args.paper else None)
    if args.compare:
        rows = comparisons(groups, [tuple(p) for p in args.compare])
        text += "\n" + comparison_table(rows)
        if anytime := anytime_comparison_table(rows):
            text += "\n" + anytime

    if candidates := candidates_table(groups):
        text += "\n" + candidates
    if corrections := corrections_table(results):
        text += "\n" + corrections
    if noise := noise_table(groups):
        text += "\n" + noise
    text += "\n## A_T by seed\n\n" + seeds_table(groups)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    if args.plot:
        plot_accuracy(groups, Path(args.plot))
    for spec in args.seeds_plot or []:
        dataset, mem, path = spec.split(":", 2)
        labels = list(dict.fromkeys(label for pair in args.compare or [] for label in pair))
        plot_seeds(groups, labels, Path(path), dataset, int(mem))
    return 0


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Examples kept as written, and every option's default shown."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m clients.bench.benchmark", description=__doc__,
                                     formatter_class=HelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="replay a class-incremental stream through one method", formatter_class=HelpFormatter)
    run.add_argument("--dataset", required=True, choices=[*sorted(CLASSES), PHOTOS],
                     help=f"{PHOTOS}: a folder or zip of train/<class>/ and test/<class>/ photos of any size, each "
                          "brought to --input-size by the service's input rule; two classes a task")
    run.add_argument("--data", required=True, help="dataset path: pickle folder, image folder or .zip")
    run.add_argument("--method", required=True, choices=METHODS)
    run.add_argument("--mem-size", type=int, default=1000, help="replay memory size M")
    run.add_argument("--seed", type=int, nargs="+", default=[0], help="one or several seeds")
    run.add_argument("--out", help="result JSON path ({seed} is replaced; several seeds add -seedN)")
    run.add_argument("--train-per-class", type=int, help="use only the first N training images of each class")
    run.add_argument("--test-per-class", type=int, help="use only the first N test images of each class")
    run.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, ...")
    run.add_argument("--k", type=int, help="K of KNN-SV (default: the paper's for the dataset)")
    run.add_argument("--n-candidates", type=int, help="N_c (default: the paper's for the dataset)")
    run.add_argument("--lr", type=float, default=0.1, help="the optimizer's learning rate")
    run.add_argument("--optimizer", choices=OPTIMIZERS, default="sgd",
                     help="the step's form: plain SGD (the paper's) or Adam (each parameter's step scaled by its "
                          "gradient's running RMS)")
    run.add_argument("--head-lr", type=float, metavar="LR",
                     help="the linear head's own learning rate (default: --lr)")
    run.add_argument("--batch-size", type=int, default=10, help="incoming mini-batch size b")
    run.add_argument("--replay-batch", type=int, default=10, help="replay batch size b_M")
    run.add_argument("--tasks", type=int, help="number of tasks (default: 5 for CIFAR-10, 10 otherwise)")
    run.add_argument("--epochs", type=int, help="epochs of iid-online/iid-offline (default 1 / 5)")
    run.add_argument("--step", choices=STEPS, default="joint",
                     help="replay methods: one forward pass of B_n u B_M (joint, the paper's Algorithm 1) or two, "
                          "summing the two mean losses (separate, the authors' ER code)")
    run.add_argument("--loss", choices=LOSSES, default="ce",
                     help="replay methods: cross-entropy (ce), ER-ACE's asymmetric cross-entropy (ace), or ace with a "
                          "batch of one class learned by cross-entropy (ace-lone)")
    run.add_argument("--augment", nargs="?", const=True, default=False, type=augment_policy, metavar="strong",
                     help="replay methods: random crop (padding 4) + horizontal flip of every training batch; "
                          "--augment strong: random resized crop (area 0.2-1) + flip + colour jitter + grayscale")
    run.add_argument("--distill", type=float, default=0.0, metavar="LAMBDA",
                     help="replay methods, with --ema: the moving average teaches, KL at T=4 weighted LAMBDA")
    run.add_argument("--serving-bn", choices=SERVING_BN, default="average",
                     help="the served BatchNorm statistics: the moving average's, or recomputed on the memory at "
                          "each evaluation (every run evaluates the other too)")
    run.add_argument("--serving-bias", action="store_true",
                     help="serve with a logit bias fitted on the memory at each evaluation (every run evaluates "
                          "with and without)")
    run.add_argument("--iterations", type=int, default=1,
                     help="replay methods: SGD steps per incoming batch, each with a fresh replay draw")
    run.add_argument("--ema", type=float, metavar="DECAY",
                     help="predict and evaluate with an exponential moving average of the weights (e.g. 0.99)")
    run.add_argument("--feature-max-age", type=int, default=100, metavar="S",
                     help="class-balanced memories (cb-*): their KNN-SV rules and ASV retrieval value the memory on "
                          "cached features at most S optimizer steps old (0: fresh features for every valuation)")
    run.add_argument("--stream-rate", metavar="R",
                     help="the real-time protocol: the stream arrives at R samples/s (or Nx: N times plain ER's "
                          "throughput by the cost model) against a clock the learner's work advances")
    run.add_argument("--max-lag", type=float, default=0.0, metavar="S",
                     help="with --stream-rate: beyond S seconds of lag, samples older than S/2 are skipped (0: none)")
    run.add_argument("--catch-up-memory-share", type=float, default=MEMORY_SHARE, metavar="F",
                     help="with --max-lag: the most of the learner's time that skipped samples' memory updates "
                          "may take; beyond it skipped samples are thinned (learner.catch_up)")
    run.add_argument("--lean-when-behind", action="store_true",
                     help="with --max-lag: while the oldest waiting sample is older than S/2, take the method's "
                          "cheapest step (one iteration, no augmentation, ASER's memory policies' lean forms: "
                          "learner.methods.registry.lean_method; priced as that configuration)")
    run.add_argument("--idle-rehearsal", action="store_true", help="with --stream-rate: replay-only steps when idle")
    run.add_argument("--rehearsals", type=int, default=0, metavar="N",
                     help="replay methods on the ordinary protocol: N replay-only steps from the memory after each "
                          "incoming batch, the idle time of a stream slower than the learner (the service's "
                          "ASER_IDLE_REHEARSAL); counted in the training time")
    run.add_argument("--rehearsal-share", type=float, default=0.5, help="with --idle-rehearsal: its share of time")
    run.add_argument("--cost-model", default=DEFAULT_COST_MODEL,
                     help="with --stream-rate: seconds per step, skip and rehearsal per configuration (calibrated "
                          "once on this machine and kept here; the default starts from results/realtime/cost-model.json, "
                          "which changes only when named)")
    run.add_argument("--calibrate-only", action="store_true",
                     help="with --stream-rate: calibrate the cost model (this configuration's and plain ER's) and stop")
    run.add_argument("--exclude-current-task", action="store_true",
                     help="the appendix's retrieval trick: never replay samples of the current task")
    run.add_argument("--one-class-batches", action="store_true",
                     help="each incoming batch holds one class, the task's classes taking turns (a device that "
                          "sees one class at a time); by default a task's samples are shuffled")
    run.add_argument("--bf16", action="store_true", help="bf16 autocast (off by default)")
    run.add_argument("--bf16-latent", action="store_true",
                     help="bf16 for the memory policies' feature passes only; training stays fp32")
    run.add_argument("--compile", action="store_true", help="torch.compile the training forward")
    run.add_argument("--threads", type=int, help="torch intra-op threads")
    run.add_argument("--checkpoint", metavar="PATH",
                     help="save the run's state here after each task and, if PATH holds one of this run, go on "
                          "from it ({seed} is replaced; several seeds add -seedN); deleted once the run is done")
    run.add_argument("--cache-dir", help="where decoded image folders (and a backbone's latents) are cached")
    run.add_argument("--backbone", choices=BACKBONES, default="scratch",
                     help="scratch: the paper's reduced ResNet18 from random weights; lite0: EfficientNet-Lite0's "
                          "ImageNet weights frozen below --cut, the memory holding latents (learner.networks.backbone)")
    run.add_argument("--input-size", type=int, default=128, help="with --backbone lite0: pixels a side it sees")
    run.add_argument("--cut", type=int, default=POOLED,
                     help=f"with --backbone lite0: blocks below this index are frozen ({POOLED}: the pooled "
                          "features, only the linear head trains)")
    run.add_argument("--serving-head", choices=HEADS,
                     help="with --backbone lite0: serve a streaming head on the frozen features (ncm: the nearest "
                          "class mean, slda: streaming LDA) instead of the trained one; the memory still trains "
                          "the top")
    run.add_argument("--trained-head-from", type=int, metavar="N",
                     help="with --serving-head: the streaming head serves while a class seen has fewer than N "
                          "samples, the trained head once every class has N")
    run.add_argument("--choose-head", nargs="?", const=True, default=False, choices=(True, "held-back"), metavar="held-back",
                     help="with --serving-head: the stream measures which head answers each class (streaming LDA, "
                          "the trained top or their mean: learner.heads.head_choice), on the incoming samples, or "
                          "--choose-head held-back: on samples of every class held back from training "
                          "(learner.heads.held_back); every evaluation scores each too")
    run.add_argument("--label-noise", type=float, default=0.0, metavar="P",
                     help="a share P of the stream's labels flipped to another class seen so far (the test set stays "
                          "clean); the result scores the memory's suspects against the flips (stream/noise.py)")
    run.add_argument("--label-noise-mode", choices=("symmetric", "pair"), default="symmetric",
                     help="with --label-noise: flips to any other class seen (symmetric), or each class always to the "
                          "seen class nearest it in the frozen network's features (pair: a person's confusion)")
    run.add_argument("--suspect-rule", action="store_true",
                     help="keep an incoming sample whose ASER value to the memory is below zero out of the streaming "
                          "head (learner.methods.corrections)")
    run.add_argument("--calibrate", action="store_true",
                     help="divide the served logits by a temperature fitted on held-back samples and score \"none of "
                          "these\" (learner.heads.calibration; the service's default)")
    run.add_argument("--head-prior", choices=CANDIDATES,
                     help="with --choose-head held-back: this head takes each measured class unless its held-back "
                          "samples show it worse (mix: the mean of streaming LDA's and the top's probabilities; "
                          "pool: their log-linear pool, fitted on the held-back samples)")
    run.add_argument("--train-every", type=int, default=1, metavar="K",
                     help="a gradient step on one incoming batch in K; the others reach the memory and a streaming "
                          "head only (a step that costs more than the device can pay on every batch)")
    run.add_argument("--sleep-every", type=int, default=0, metavar="N",
                     help="a sleep (learner.methods.sleep) once N samples have arrived since the last, and one when "
                          "the stream ends (the device idle): task-free, as a service can follow it; 0: no sleep")
    run.add_argument("--sleep-epochs", type=float, default=8.0, metavar="E",
                     help="with --sleep-every: a sleep's sample-updates, E times the samples new since the last")
    run.add_argument("--sleep-batch", type=int, default=32, help="with --sleep-every: a sleep step's batch")
    run.add_argument("--sleep-lr", type=float, default=0.01, help="with --sleep-every: a sleep's SGD rate")
    run.add_argument("--sleep-schedule", choices=SLEEP_SCHEDULES, default="constant",
                     help="with --sleep-every: the rate constant, or annealed from --sleep-lr to zero over each sleep")
    run.add_argument("--sleep-source", choices=SLEEP_SOURCES, default="store",
                     help="with --sleep-every: what a sleep rehearses (the latent store of every sample, ASER's "
                          "memory, or half of each)")
    run.add_argument("--sleep-draw", choices=SLEEP_DRAWS, default="balanced",
                     help="with --sleep-every: every store batch class-balanced (balanced), half of each from what "
                          "is new since the last sleep (new-half), or shuffled passes over the store (shuffled)")
    run.add_argument("--sleep-store", type=int, default=100_000, metavar="N",
                     help="with --sleep-every: the latent store's capacity in samples (class-balanced eviction)")
    run.add_argument("--fresh-sleep-at-end", action="store_true",
                     help="with --sleep-every: after the stream's last sleep, one fresh sleep (the top started again "
                          "from ImageNet's weights, passes over everything held), as a user asks for it or a night "
                          "brings it")
    run.add_argument("--fresh-sleep-epochs", type=float, metavar="N",
                     help="with --fresh-sleep-at-end: its passes over everything held (default: --sleep-epochs)")
    run.add_argument("--standardize-features", action="store_true",
                     help="with --backbone lite0 and a cut below the pooled one: the top's head reads its pooled "
                          "features standardised by running statistics (learner.networks.backbone.RunningStandardize)")
    run.add_argument("--latent-bits", type=int, choices=(8, 16), default=16,
                     help="with --backbone lite0: bits a stored latent value (8: the pooled cut only)")
    run.add_argument("--quiet", action="store_true", help="no progress bar")
    run.add_argument("--via", metavar="URL", help="stream through the running service at URL instead of in-process "
                     "(its ASER_* settings decide the learner; it must be fresh)")
    run.add_argument("--token", help="with --via: an admin token (it writes and reads)")
    run.set_defaults(func=cmd_run)
    table = sub.add_parser("table", help="markdown table (mean ± 95%% CI), paired comparisons and plots")
    table.add_argument("folder", help="a folder of result files (e.g. results/cifar10)")
    table.add_argument("--out", help="write the markdown tables here")
    table.add_argument("--plot", help="write the accuracy-over-tasks plot (PNG) here")
    table.add_argument("--compare", nargs=2, action="append", metavar=("A", "B"),
                       help="paired comparison of two configurations (labels as in the table, e.g. 'er' "
                            "'aser-mu (ace)') over the seeds both ran, in every dataset and M; repeatable")
    table.add_argument("--paper", metavar="TOML",
                       help="a published table to show beside ours (results/paper-table1.toml: the paper's Table 1)")
    table.add_argument("--seeds-plot", action="append", metavar="DATASET:M:PNG",
                       help="plot A_T per seed of the compared configurations for one dataset and M")
    table.set_defaults(func=cmd_table)
    from clients.bench.cost.speed import add_parser as add_speed_parser
    from clients.bench.stream.sweep import add_parser as add_sweep_parser
    from clients.bench.stream.young import add_parser as add_young_parser

    add_speed_parser(sub)
    add_sweep_parser(sub)
    add_young_parser(sub)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
