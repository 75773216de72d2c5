""""None of these", measured: how well the served model's unknown score tells photos of no learned class.

One class of the stream is held out (class `seed` mod the class count: a different one each seed) and never sent;
the default's learner (streaming LDA on Lite0's frozen features, calibrated: `learner.heads.calibration`) learns the
others task by task, and at the end scores the test photos of the learned classes, of the held-out class (near: the
same kind of photo) and of a far set (another dataset: satellite tiles against photos). Written: the AUROC of the
score (the distance to the nearest class mean) and of other rules (the lack of confidence, their sum, their larger),
the false-alarm rate at the threshold the held-back samples chose (against the one set) and the share of unknowns it
catches, beside the accuracy and the calibration on the learned classes. At a cut below the pooled one (the
service's default, 11) the served score adds the stored latent's channel means' distance; the rule `distance` is
the frozen features' alone (the score served before, the same AUROC).

    python -m clients.bench.stream.unknowns --dataset eurosat --data ../shared/datasets/eurosat-rgb.zip \\
        --far-dataset mini-imagenet --far-data ../shared/datasets/mini-imagenet-slice.zip --seed 0 \\
        --out results/calibration/unknowns-eurosat-seed0.json
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import sys
import time
from pathlib import Path

import torch

from clients.bench.machine import machine_description
from clients.bench.stream.latents import encoded_dataset
from learner import make_learner
from learner.data import ImageDataset, load_dataset, task_batches
from learner.metrics import auroc, brier_score, expected_calibration_error
from learner.networks.backbone import make_backbone

DEFAULT_CUT = 11  # the service's under its default sleep: the stored latent is block 11's input


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--far-dataset", required=True)
    p.add_argument("--far-data", required=True)
    p.add_argument("--far-images", type=int, default=3000, help="far test photos scored at most")
    p.add_argument("--input-size", type=int, default=160)
    p.add_argument("--cut", type=int, default=DEFAULT_CUT,
                   help="the stored latent's cut: below the pooled one, the score reads its channel means too")
    p.add_argument("--false-alarm", type=float, default=0.05)
    p.add_argument("--batch-size", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--cache-dir")
    p.add_argument("--out", required=True)
    return p.parse_args(argv)


def stream(learner, data: ImageDataset, held_out: int, batch_size: int, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for task in data.tasks():
        classes = [c for c in task if c != held_out]
        if classes:
            for x, y in task_batches(data, classes, batch_size, generator):
                learner.observe(x, y)


def parts(learner, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The two scores the rules are made of: the calibrated answer's lack of confidence, and the distance of the
    frozen features to the nearest class mean (the served one)."""
    probabilities = torch.softmax(learner.logits(x), 1).cpu()
    frozen = learner._eval_map(lambda f: f, x, 512, learner.frozen_features).cpu()
    return 1 - probabilities.max(1).values, learner.calibration().distance(frozen)


def rules(learner, sets: dict[str, torch.Tensor]) -> dict:
    """Other rules scored on the same images: each part alone, and the two standardised on the held-back samples,
    summed or the larger."""
    stored, _, _ = learner.held_back.stacked()
    held = parts(learner, stored)
    standard = [lambda v, h=h: (v - h.mean()) / h.std() for h in held]
    out = {}
    for name, x in sets.items():
        doubt, distance = (z(p) for z, p in zip(standard, parts(learner, x)))
        out[name] = {"doubt": doubt, "distance": distance, "sum": doubt + distance,
                     "max": torch.maximum(doubt, distance)}
    return out


def figures(learner, known_x, known_y, near_x, far_x) -> dict:
    calibration = learner.calibration()
    probabilities = torch.softmax(learner.logits(known_x), 1).cpu()
    sets = {"known": known_x, "near": near_x, "far": far_x}
    scores = {name: learner.unknown_scores(x) for name, x in sets.items()}
    other = rules(learner, sets)
    flagged = {name: float(calibration.unknown(s).float().mean()) for name, s in scores.items()}
    return {
        "accuracy": round(100 * float((probabilities.argmax(1) == known_y).float().mean()), 2),
        "ece": round(expected_calibration_error(probabilities, known_y), 4),
        "brier": round(brier_score(probabilities, known_y), 4),
        "calibration": calibration.summary(),
        "auroc": {"near": round(auroc(scores["known"], scores["near"]), 4),
                  "far": round(auroc(scores["known"], scores["far"]), 4)},
        "auroc_of_rules": {rule: {"near": round(auroc(other["known"][rule], other["near"][rule]), 4),
                                  "far": round(auroc(other["known"][rule], other["far"][rule]), 4)}
                           for rule in other["known"]},
        "false_alarm_rate": round(flagged["known"], 4),
        "caught": {"near": round(flagged["near"], 4), "far": round(flagged["far"], 4)},
        "images": {"known": len(known_y), "near": len(near_x), "far": len(far_x)},
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    data = load_dataset(args.dataset, args.data, cache_dir=args.cache_dir)
    far = load_dataset(args.far_dataset, args.far_data, cache_dir=args.cache_dir)
    backbone = make_backbone("lite0", data.image_shape, args.input_size, args.cut)
    data, far = encoded_dataset(data, backbone, args.cache_dir), encoded_dataset(far, backbone, args.cache_dir)
    held_out = args.seed % data.num_classes
    learner = make_learner("slda", data.num_classes, backbone=backbone, seed=args.seed, calibrate=True,
                           false_alarm=args.false_alarm)
    start = time.process_time()
    stream(learner, data, held_out, args.batch_size, args.seed)
    train_cpu = time.process_time() - start
    known = data.test_y != held_out
    result = {"dataset": args.dataset, "far_dataset": args.far_dataset, "seed": args.seed,
              "held_out_class": data.class_names[held_out], "input_size": args.input_size, "cut": args.cut,
              **figures(learner, data.test_x[known], data.test_y[known], data.test_x[~known],
                        far.test_x[:args.far_images]),
              "train_cpu_seconds": round(train_cpu, 1), "machine": machine_description(torch.device("cpu")),
              "python": platform.python_version(), "torch": torch.__version__,
              "command": "python -m clients.bench.stream.unknowns " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
              "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("held_out_class", "accuracy", "ece", "auroc", "false_alarm_rate",
                                             "caught")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
