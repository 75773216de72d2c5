"""A young service's first tasks, in process (issue 39, item 1): three tasks of two CIFAR-10
classes (airplane ... dog), 150 training images a class, the classes of a task interleaved, in
batches of 10, through a learner at M=1000 with ACE, a moving average 0.99 and a head that grows with each new
class: by default the service's (cb-sv-duel, augmentation, 2 iterations); `--method sv-upd --augment off
--iterations 1` the service's default until 2026-11-26, which results/young/serving-corrections.json measured.
After each task, the served model under each correction on the memory (`ContinualLearner.serving_from`):
none (the average as it is), recomputed BatchNorm statistics, the fitted logit bias, both. The corrections
never touch training, so one stream per seed measures them all, paired. Per task and correction: accuracy
on 40 test images a seen class, and how many seen classes it answers at all.

    python -m clients.bench.benchmark young --seeds 0-4 --out results/young/serving-corrections-cb-sv-duel.json
"""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path

import torch

from clients.bench.results import paired_difference
from clients.bench.stream.sweep import seeds as parse_seeds
from learner import make_learner
from learner.data import load_dataset

CORRECTIONS = {"none": {}, "bn": {"bn": "memory"}, "bias": {"bias": True}, "bn+bias": {"bn": "memory", "bias": True}}
TASKS = [[0, 1], [2, 3], [4, 5]]


def interleaved(data, classes: list[int], per_class: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first `per_class` training images of each class, alternating between the classes."""
    picks = [torch.nonzero(data.train_y == c).flatten()[:per_class] for c in classes]
    order = torch.stack(picks, 1).flatten()
    return data.train_x[order], data.train_y[order]


def run_seed(data, seed: int, per_class: int, method: str, options: dict) -> list[dict]:
    """One stream; after each task, each correction's accuracy and answered classes."""
    learner = make_learner(method, num_classes=1, mem_size=1000, loss="ace", seed=seed, **options)
    rows = []
    for task, classes in enumerate(TASKS):
        x, y = interleaved(data, classes, per_class)
        for i in range(0, len(y), 10):
            learner.observe(x[i:i + 10], y[i:i + 10])
        seen = [c for t in TASKS[:task + 1] for c in t]
        test = torch.isin(data.test_y, torch.tensor(seen))
        tx, ty = data.test_x[test], data.test_y[test]
        for name, change in CORRECTIONS.items():
            with learner.serving_from(**change):
                predicted = learner.predict(tx)
            answers = Counter(predicted.tolist())
            rows.append({"seed": seed, "task": task + 1, "correction": name,
                         "accuracy": round(100 * float((predicted == ty).float().mean()), 2),
                         "answered": sum(answers[c] > 0 for c in seen), "seen": len(seen),
                         "answers": {data.class_names[c]: answers[c] for c in seen}})
    return rows


def summarise(rows: list[dict]) -> list[dict]:
    """Per task and correction: mean accuracy, the paired difference to none, seeds answering every class."""
    out = []
    for task in sorted({r["task"] for r in rows}):
        base = {r["seed"]: r["accuracy"] for r in rows if r["task"] == task and r["correction"] == "none"}
        for name in CORRECTIONS:
            mine = [r for r in rows if r["task"] == task and r["correction"] == name]
            diff = paired_difference(base, {r["seed"]: r["accuracy"] for r in mine})
            out.append({"task": task, "correction": name, "seeds": len(mine),
                        "accuracy": round(sum(r["accuracy"] for r in mine) / len(mine), 2),
                        "minus_none": round(diff["mean"], 2), "minus_none_ci95": round(diff["ci95"], 2),
                        "every_class_answered": sum(r["answered"] == r["seen"] for r in mine)})
    return out


def cmd_young(args) -> int:
    torch.set_num_threads(args.threads)
    data = load_dataset("cifar10", args.data, args.train_per_class, 40, args.cache_dir)
    started = time.time()
    augment = {"off": False, "on": True}.get(args.augment, args.augment)
    options = {"ema_decay": args.ema, "augment": augment, "iterations": args.iterations}
    rows = [row for seed in parse_seeds(args.seeds) for row in run_seed(data, seed, args.train_per_class,
                                                                         args.method, options)]
    summary = summarise(rows)
    for s in summary:
        print(f"task {s['task']} {s['correction']:<8} {s['accuracy']:5.1f}%  {s['minus_none']:+6.2f} ± "
              f"{s['minus_none_ci95']:.2f}  every class answered: {s['every_class_answered']}/{s['seeds']}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "command": f"python -m clients.bench.benchmark young --seeds {args.seeds} --method {args.method} "
                   f"--augment {args.augment} --iterations {args.iterations} --ema {args.ema} "
                   f"--train-per-class {args.train_per_class} --threads {args.threads} "
                   f"--out {args.out}",
        "seconds": round(time.time() - started, 1), "torch": torch.__version__,
        "measured": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "summary": summary, "runs": rows},
        indent=1) + "\n")
    print(f"wrote {out}")
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("young", help="a young service's first three tasks: the served model under each correction")
    p.add_argument("--data", default="../shared/datasets/cifar10-jpeg.zip")
    p.add_argument("--seeds", default="0-4", help="a range (0-4) or one seed")
    p.add_argument("--method", default="cb-sv-duel", help="the learner (default: the service's since 2026-11-26; "
                   "clients do not import service/, so a change of the service's default is made here too)")
    p.add_argument("--augment", choices=["off", "on", "strong"], default="on", help="the replay methods' augmentation")
    p.add_argument("--iterations", type=int, default=2, help="the replay methods' SGD steps per batch")
    p.add_argument("--ema", type=float, default=0.99)
    p.add_argument("--train-per-class", type=int, default=150)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--cache-dir")
    p.add_argument("--out", default=".cache/bench/young.json")
    p.set_defaults(func=cmd_young)
