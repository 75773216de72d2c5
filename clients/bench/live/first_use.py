"""What a fresh service answers after its first photos (the README's first use): a service started on
its defaults (or with `--env` settings) in an empty data directory receives `--per-class` CIFAR-10
training JPEGs of each of the ten classes through `POST /samples`, trains on them, and answers 100
held-out test JPEGs a class through `POST /predict`. One run a seed (ASER_SEED); the result file holds
each run's top-1 accuracy, overall and by class, the settings and the command.

    python -m clients.bench.live.first_use --data ../shared/datasets/cifar10-jpeg.zip --seeds 0-4 \\
        --out results/first-use/default.json
    python -m clients.bench.live.first_use --env ASER_BACKBONE=scratch --seeds 0-4 --out results/first-use/scratch.json
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path

import torch

from clients.api import ServiceClient
from clients.bench.live.local_service import LocalService, real_jpegs
from clients.bench.machine import machine_description
from clients.bench.results import write_result
from clients.bench.stream.sweep import seeds as parse_seeds

CLASSES = 10
TEST_PER_CLASS = 100


def run_seed(train: list[tuple[str, bytes]], test: list[tuple[str, bytes]], env: dict, seed: int) -> dict:
    """One fresh service: learn `train`, answer `test`."""
    with tempfile.TemporaryDirectory() as tmp:
        service = LocalService(Path(tmp) / "data", {**env, "ASER_SEED": str(seed)}).start()
        try:
            with ServiceClient(service.url, timeout=300) as client:
                started = time.monotonic()
                client.add_files([label for label, _ in train], [img for _, img in train], "image/jpeg")
                status = client.drain()
                trained_s = time.monotonic() - started
                answers = [top["label"] for chunk in range(0, len(test), 50)
                           for top in (r[0] for r in client.predict([img for _, img in test[chunk:chunk + 50]],
                                                                    k=1)["results"])]
        finally:
            service.stop()
    right: dict[str, list[bool]] = {}
    for (label, _), answer in zip(test, answers):
        right.setdefault(label, []).append(answer == label)
    return {"seed": seed, "accuracy": 100 * sum(map(sum, right.values())) / len(test),
            "by_class": {c: 100 * sum(v) / len(v) for c, v in sorted(right.items())},
            "samples_trained": status["samples_trained"], "steps": status["steps"],
            "seconds_to_trained": round(trained_s, 1), "config": status["config"]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default="../shared/datasets/cifar10-jpeg.zip")
    parser.add_argument("--per-class", type=int, default=10, help="training photos a class")
    parser.add_argument("--seeds", default="0", help="ASER_SEED of each run: 0 or 0-4")
    parser.add_argument("--env", action="append", default=[], metavar="ASER_X=V", help="a setting of the service")
    parser.add_argument("--out", help="write the result here (JSON)")
    args = parser.parse_args(argv)
    env = dict(item.split("=", 1) for item in args.env)
    train = real_jpegs(Path(args.data), args.per_class * CLASSES)
    test = real_jpegs(Path(args.data), TEST_PER_CLASS * CLASSES, split="test")
    runs = []
    for seed in parse_seeds(args.seeds):
        runs.append(run_seed(train, test, env, seed))
        print(f"seed {seed}: {runs[-1]['accuracy']:.1f}% of {len(test)} held-out photos right "
              f"after {args.per_class} a class ({runs[-1]['seconds_to_trained']} s to train)")
    accuracies = [r["accuracy"] for r in runs]
    result = {"per_class": args.per_class, "classes": CLASSES, "test_per_class": TEST_PER_CLASS, "env": env,
              "accuracy_mean": sum(accuracies) / len(accuracies), "runs": runs, "machine": f"{machine_description(torch.device('cpu')).split(',')[0]}, {os.cpu_count()} cores",
              "command": "python -m clients.bench.live.first_use " + shlex.join(sys.argv[1:] if argv is None else argv),
              "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if args.out:
        write_result(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
