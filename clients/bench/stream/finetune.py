"""Offline reference (c): the whole EfficientNet-Lite0 fine-tuned i.i.d. with light augmentation, on exactly the
stream's training photos at the service's input size. (a) is a linear head on ImageNet's frozen features
(`clients.bench.stream.reference`), (b) the trainable top above the cut trained i.i.d. (`--method iid-offline`);
(c) trains every layer, what a night on the device's own photos could reach at most by the usual offline recipe.

The recipe: ImageNet's weights with a new linear head; random resized crops (area 0.25-1, aspect 3/4-4/3) and
horizontal flips at each image's own size, then the service's input rule (bilinear to `--input-size`); SGD with
Nesterov momentum 0.9 and weight decay 5e-5, the pretrained layers at a tenth of the head's rate, a cosine schedule
over every step, label smoothing 0.1; BatchNorm in training mode (its statistics learn the new world; `--batchnorm
frozen` keeps ImageNet's, as the service's top does). The test set
is measured after every epoch (never used to choose anything): the served answer is the last epoch's.

    python -m clients.bench.stream.finetune --dataset eurosat --data ../shared/datasets/eurosat-rgb.zip \\
        --train-per-class 500 --out results/pretrained/eurosat/reference-finetune-lite0-160px-500a-class-seed0.json

`--train-from K` trains the blocks from K on alone (11: the service's cut, the top a sleep trains, now from pixels with
augmentation), the layers below frozen with ImageNet's statistics: which layers pay, per CPU second.

`--state FILE` keeps the run's state after each epoch (weights, optimiser, draws, CPU so far): a killed run started
again with the same command goes on from its last whole epoch.
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from clients.bench.machine import machine_description
from clients.bench.results import write_result
from learner.data import CLASSES, PHOTOS, load_dataset
from learner.methods.augment import StrongAugment
from learner.networks.lite0 import FEATURE_DIM, POOLED, load_lite0


class FineTuned(nn.Module):
    """Lite0 from its ImageNet weights and a new linear head; the blocks from `train_from` on trainable (0: every
    layer, the stem too), those below it frozen in eval mode (a cut, as the service's)."""

    def __init__(self, input_size: int, classes: int, train_from: int = 0, batchnorm: str = "train"):
        super().__init__()
        self.batchnorm = batchnorm
        self.lite0 = load_lite0(input_size)
        del self.lite0.classifier  # ImageNet's 1000 classes: not ours
        self.train_from = train_from
        self.trained = [self.lite0.blocks[train_from:], self.lite0.head]
        if train_from == 0:
            self.trained.insert(0, self.lite0.stem)
        for part in self.trained:
            part.requires_grad_(True)
        self.head = nn.Linear(FEATURE_DIM, classes)

    def train(self, mode: bool = True):
        super().train(False)  # the frozen part keeps ImageNet's statistics
        for part in [*self.trained, self.head]:
            part.train(mode)
        if self.batchnorm == "frozen":  # the trained part's too (its scale and shift still train)
            for m in self.modules():
                if isinstance(m, nn.BatchNorm2d):
                    m.eval()
        return self

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        if self.train_from == 0:
            return self.head(self.lite0.lower(images, POOLED))
        with torch.no_grad():
            latent = self.lite0.lower(images, self.train_from)
        return self.head(self.lite0.upper(latent, self.train_from))

    def parameter_groups(self, lr: float, lower_scale: float) -> list[dict]:
        pretrained = [p for part in self.trained for p in part.parameters()]
        return [{"params": pretrained, "lr": lr * lower_scale}, {"params": list(self.head.parameters()), "lr": lr}]


def accuracy_by_task(model: FineTuned, x: torch.Tensor, y: torch.Tensor, tasks: list[list[int]],
                     batch: int = 100) -> tuple[list[float], float]:
    """Each task's test accuracy (%) and the whole test set's, the model in eval mode."""
    model.eval()
    with torch.no_grad():
        predicted = torch.cat([model(x[i:i + batch]).argmax(1) for i in range(0, len(y), batch)])
    right = predicted == y
    by_task = [round(100.0 * float(right[torch.isin(y, torch.tensor(t))].double().mean()), 2) for t in tasks]
    return by_task, round(100.0 * float(right.double().mean()), 2)


def train_epoch(model: FineTuned, optimiser, schedule, augment: StrongAugment, x: torch.Tensor, y: torch.Tensor,
                batch: int, generator: torch.Generator) -> float:
    """One shuffled pass over (x, y); the mean training loss."""
    model.train()
    order, losses = torch.randperm(len(y), generator=generator), []
    for i in range(0, len(y) - batch + 1, batch):  # whole batches: BatchNorm in training mode needs more than one
        idx = order[i:i + batch]
        loss = F.cross_entropy(model(augment(x[idx])), y[idx], label_smoothing=0.1)
        optimiser.zero_grad(set_to_none=True)
        loss.backward()
        optimiser.step()
        schedule.step()
        losses.append(loss.item())
    return sum(losses) / max(len(losses), 1)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", required=True, choices=[*sorted(CLASSES), PHOTOS])
    p.add_argument("--data", required=True)
    p.add_argument("--train-per-class", type=int, help="the stream's photos: the first N of each class")
    p.add_argument("--test-per-class", type=int, help="measure on the first N test photos of each class")
    p.add_argument("--input-size", type=int, default=160, help="the service's input size on lite0")
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.05, help="the new head's rate")
    p.add_argument("--train-from", type=int, default=0,
                   help="the first trained block (0: the whole network; 11: the service's cut, the top alone)")
    p.add_argument("--batchnorm", choices=["train", "frozen"], default="train",
                   help="the trained part's BatchNorm: batch statistics (train), or ImageNet's kept (frozen)")
    p.add_argument("--lower-lr-scale", type=float, default=0.1, help="the pretrained layers' rate, over the head's")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--cache-dir")
    p.add_argument("--state", help="a file that keeps the run's state after each epoch (resumes from it)")
    p.add_argument("--out", required=True)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    data = load_dataset(args.dataset, args.data, train_per_class=args.train_per_class,
                        test_per_class=args.test_per_class, cache_dir=args.cache_dir,
                        input_size=args.input_size if args.dataset == PHOTOS else None)
    model = FineTuned(args.input_size, data.num_classes, args.train_from, args.batchnorm)
    optimiser = torch.optim.SGD(model.parameter_groups(args.lr, args.lower_lr_scale), momentum=0.9, nesterov=True,
                                weight_decay=5e-5)
    steps = args.epochs * (len(data.train_y) // args.batch_size)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimiser, lambda s: 0.5 * (1 + math.cos(math.pi * s / steps)))
    augment = StrongAugment(scale=(0.25, 1.0), jitter_p=0.0, gray_p=0.0, seed=args.seed)
    generator = torch.Generator().manual_seed(args.seed)
    epochs, train_cpu, eval_cpu = [], 0.0, 0.0
    state = Path(args.state) if args.state else None
    if state and state.exists():
        saved = torch.load(state, weights_only=False)
        model.load_state_dict(saved["model"])
        optimiser.load_state_dict(saved["optimiser"])
        schedule.load_state_dict(saved["schedule"])
        augment.load_state_dict(saved["augment"])
        generator.set_state(saved["generator"])
        epochs, train_cpu, eval_cpu = saved["epochs"], saved["train_cpu"], saved["eval_cpu"]
    tasks = data.tasks()
    while len(epochs) < args.epochs:
        cpu = time.process_time()
        loss = train_epoch(model, optimiser, schedule, augment, data.train_x, data.train_y, args.batch_size, generator)
        train_cpu += time.process_time() - cpu
        cpu = time.process_time()
        by_task, overall = accuracy_by_task(model, data.test_x, data.test_y, tasks)
        eval_cpu += time.process_time() - cpu
        epochs.append({"epoch": len(epochs) + 1, "train_loss": round(loss, 4), "accuracy_by_task": by_task,
                       "average_accuracy": round(sum(by_task) / len(by_task), 2), "accuracy": overall,
                       "train_cpu_seconds": round(train_cpu, 1)})
        print(json.dumps(epochs[-1]), flush=True)
        if state:
            state.parent.mkdir(parents=True, exist_ok=True)
            torch.save({"model": model.state_dict(), "optimiser": optimiser.state_dict(),
                        "schedule": schedule.state_dict(), "augment": augment.state_dict(),
                        "generator": generator.get_state(), "epochs": epochs, "train_cpu": train_cpu,
                        "eval_cpu": eval_cpu}, state.with_suffix(".tmp"))
            state.with_suffix(".tmp").replace(state)
    last = epochs[-1]
    name = ("finetune-whole" if args.train_from == 0 else f"finetune-from-{args.train_from}") + \
        ("-frozen-bn" if args.batchnorm == "frozen" else "")
    result = {"reference": name, "dataset": args.dataset, "data": Path(args.data).name,
              "backbone": {"backbone": "lite0", "input_size": args.input_size, "cut": args.train_from},
              "recipe": {"epochs": args.epochs, "batch_size": args.batch_size, "lr": args.lr,
                         "lower_lr_scale": args.lower_lr_scale, "optimiser": "sgd nesterov 0.9, wd 5e-5",
                         "schedule": "cosine by step", "label_smoothing": 0.1,
                         "augment": "random resized crop 0.25-1 and flip", "batchnorm": args.batchnorm},
              "seed": args.seed, "average_accuracy": last["average_accuracy"], "accuracy": last["accuracy"],
              "accuracy_by_task": last["accuracy_by_task"], "epochs": epochs,
              "train_cpu_seconds": round(train_cpu, 1), "eval_cpu_seconds": round(eval_cpu, 1),
              "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
              "train_samples": len(data.train_y), "test_samples": len(data.test_y), "threads": args.threads,
              "machine": machine_description(torch.device("cpu")),
              "command": "python -m clients.bench.stream.finetune " + " ".join(sys.argv[1:] if argv is None else argv),
              "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    write_result(args.out, result)
    print(json.dumps({k: result[k] for k in ("average_accuracy", "accuracy", "train_cpu_seconds", "peak_rss_mb")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
