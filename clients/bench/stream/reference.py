"""Offline reference (a): the frozen features with a logistic-regression head trained i.i.d. to
convergence (TensorFlow Lite Model Maker's head-only transfer), on the same split and backbone as the
online runs. The online learner sees each sample once, in tasks; this one sees the whole training set
at once, as often as it needs: what a linear head on ImageNet's frozen features can reach.

The pooled features at the input size (the benchmark's latent cache, `clients.bench.stream.latents`),
standardised on the training set; multinomial logistic regression solved by L-BFGS (full batch,
strong Wolfe line search) with an L2 penalty chosen on a held-out tenth of the training set among
L2_GRID, then solved again on all of it. A_T is the benchmark's: the mean over tasks of the accuracy on
each task's test set. Reference (b), the trainable top trained i.i.d. for several epochs, is the
benchmark's own `--method iid-offline` on the same backbone (results/grid-adaptive.toml).

    python -m clients.bench.stream.reference --dataset eurosat --data ../shared/datasets/eurosat-rgb.zip \\
        --input-size 160 --out results/pretrained/eurosat/reference-head-only-lite0-160px.json

`--dataset photos` reads a folder or zip of photos of any size (`train/<class>/*` and `test/<class>/*`), each
brought to the input size by the service's own input rule (`learner.data`'s photo sets), so the reference sees what
`clients.bench.live.client_stream` sends the service; its tasks are two classes each, as there.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch.nn import functional as F

from clients.bench.machine import machine_description
from clients.bench.results import write_result
from clients.bench.stream.latents import encoded_dataset
from learner.data import CLASSES, PHOTOS, load_dataset
from learner.networks.backbone import PretrainedBackbone

L2_GRID = (1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0)
MAX_ITERATIONS = 1000


def fit(x: torch.Tensor, y: torch.Tensor, classes: int, l2: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The L2-penalised multinomial logistic regression on (x, y), solved to L-BFGS's tolerances."""
    weight = torch.zeros(classes, x.shape[1], dtype=torch.float64, requires_grad=True)
    bias = torch.zeros(classes, dtype=torch.float64, requires_grad=True)
    solver = torch.optim.LBFGS([weight, bias], lr=1.0, max_iter=MAX_ITERATIONS, history_size=20,
                               tolerance_grad=1e-7, tolerance_change=1e-12, line_search_fn="strong_wolfe")

    def loss():
        solver.zero_grad()
        value = F.cross_entropy(x @ weight.T + bias, y) + l2 * (weight * weight).sum()
        value.backward()
        return value

    solver.step(loss)
    return weight.detach(), bias.detach()


def accuracy(head: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> float:
    return 100.0 * float(((x @ head[0].T + head[1]).argmax(1) == y).double().mean())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", required=True, choices=[*sorted(CLASSES), PHOTOS])
    p.add_argument("--data", required=True)
    p.add_argument("--train-per-class", type=int, help="the stream's photos: the first N of each class")
    p.add_argument("--input-size", type=int, default=160)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--cache-dir")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    data = load_dataset(args.dataset, args.data, train_per_class=args.train_per_class, cache_dir=args.cache_dir,
                        input_size=args.input_size if args.dataset == PHOTOS else None)
    encoded = encoded_dataset(data, PretrainedBackbone(input_size=args.input_size), args.cache_dir)
    train, test = encoded.train_x.double(), encoded.test_x.double()
    mean, std = train.mean(0), train.std(0).clamp_min(1e-6)
    train, test = (train - mean) / std, (test - mean) / std
    y, classes = encoded.train_y, data.num_classes
    held_out = torch.randperm(len(y), generator=torch.Generator().manual_seed(0)) < len(y) // 10
    cpu = time.process_time()
    validation = {l2: accuracy(fit(train[~held_out], y[~held_out], classes, l2), train[held_out], y[held_out])
                  for l2 in L2_GRID}
    l2 = max(L2_GRID, key=lambda v: (validation[v], v))  # the strongest penalty among the best
    head = fit(train, y, classes, l2)
    by_task = []
    for task in data.tasks():
        keep = torch.isin(encoded.test_y, torch.tensor(task))
        by_task.append(round(accuracy(head, test[keep], encoded.test_y[keep]), 2))
    result = {"reference": "head-only", "dataset": args.dataset, "data": Path(args.data).name, "backbone": {"backbone": "lite0",
              "input_size": args.input_size, "cut": "pooled"}, "average_accuracy": sum(by_task) / len(by_task),
              "accuracy_by_task": by_task,
              "accuracy": round(accuracy(head, test, encoded.test_y), 2), "l2": l2, "validation_accuracy": validation,
              "train_accuracy": round(accuracy(head, train, y), 2),
              "fit_cpu_seconds": round(time.process_time() - cpu, 1),
              "train_samples": len(y), "test_samples": len(encoded.test_y), "threads": args.threads,
              "machine": machine_description(torch.device("cpu")),
              "command": "python -m clients.bench.stream.reference " + " ".join(sys.argv[1:] if argv is None else argv),
              "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    write_result(args.out, result)
    print(json.dumps({k: result[k] for k in ("average_accuracy", "accuracy", "accuracy_by_task", "l2")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
