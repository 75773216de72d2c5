"""Calibration under a sleep, in process: which temperature prior the served answer wants once it reads the top.

The service's sleeping learner (`ASER_SLEEP`: cut 11 at 160 px, the head chosen on held-back samples with the pool as
prior, the top trained only in sleeps, calibration on) on Split EuroSAT, `--per-class` training tiles a class, five
tasks of two classes in batches of ten, a sleep at each task's end (as an idle service sleeps). At each task's 100th
sample a class, at its end before the sleep and after it, the served probabilities on `--test-per-class` test tiles
of every class seen, calibrated with the temperature fitted on the held-back samples under each prior
(`learner.heads.calibration`: streaming LDA's, PRIOR_TEMPERATURE, and the composition's,
FITTED_PRIOR_TEMPERATURE): their expected calibration error (15 bins) and mean confidence beside the accuracy.
Calibration never touches training, so one stream a seed measures both, paired.

    python -m clients.bench.stream.sleep_calibration --seeds 0-2 --out results/calibration/eurosat-under-sleep.json
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from clients.bench.machine import machine_description
from clients.bench.results import paired_difference
from clients.bench.stream.sweep import seeds as parse_seeds
from learner import make_learner
from learner.data import load_dataset, task_batches
from learner.heads.calibration import FITTED_PRIOR_TEMPERATURE, PRIOR_TEMPERATURE, fit_temperature
from learner.methods.sleep import SleepConfig
from learner.metrics import expected_calibration_error
from learner.networks.backbone import make_backbone

SIZE, CUT = 160, 11
PRIORS = {"slda": PRIOR_TEMPERATURE, "composed": FITTED_PRIOR_TEMPERATURE}


def sleeping_learner(seed: int):
    backbone = make_backbone("lite0", (3, SIZE, SIZE), SIZE, CUT, 16)
    return make_learner("cb-sv-duel", 1, mem_size=1000, loss="ace", lr=0.01, ema_decay=0.99, backbone=backbone,
                        serving_head="slda", choose_head="held-back", head_prior="pool", train_every=0,
                        sleep=SleepConfig(store_capacity=5000), calibrate=True, seed=seed)


def measure(learner, data, classes: list[int]) -> dict:
    """The served answers on the seen classes' test tiles, calibrated under each prior."""
    keep = torch.isin(data.test_y, torch.tensor(classes))
    x, y = data.test_x[keep], data.test_y[keep]
    served = learner.candidate_probabilities(x)["served"]
    calibration = learner.calibration()
    stored, frozen, labels = learner.held_back.stacked()
    logits = learner.served_logits(stored, frozen).cpu()
    point = {"accuracy": round(float((served.argmax(1) == y).float().mean()), 4), "held_back": len(labels),
             "reads_top": learner.head_choice.reads_top(learner.num_classes)}
    for name, prior in PRIORS.items():
        temperature = fit_temperature(logits, labels, prior)
        p = replace(calibration, temperature=temperature).probabilities(served.clamp_min(1e-30).log())
        point[name] = {"temperature": round(temperature, 3), "ece": round(expected_calibration_error(p, y), 4),
                       "mean_confidence": round(float(p.max(1).values.mean()), 4)}
    return point


def run(seed: int, data) -> list[dict]:
    learner, seen, key, points = sleeping_learner(seed), [], 0, []
    generator = torch.Generator().manual_seed(seed)
    for task in range(5):
        seen += [2 * task, 2 * task + 1]
        n = 0
        for x, y in task_batches(data, seen[-2:], 10, generator):
            learner.observe(x, y, keys=torch.arange(key, key + len(y)))
            key, n = key + len(y), n + len(y)
            if n == 200:
                points.append({"task": task, "at": "100 a class", **measure(learner, data, seen)})
        points.append({"task": task, "at": "end, awake", **measure(learner, data, seen)})
        learner.sleep()
        points.append({"task": task, "at": "end, slept", **measure(learner, data, seen)})
        print(seed, points[-3:], flush=True)
    return points


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="../shared/datasets/eurosat-rgb.zip")
    p.add_argument("--per-class", type=int, default=200)
    p.add_argument("--test-per-class", type=int, default=100)
    p.add_argument("--seeds", default="0-2")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    data = load_dataset("eurosat", args.data, train_per_class=args.per_class, test_per_class=args.test_per_class)
    runs = {seed: run(seed, data) for seed in parse_seeds(args.seeds)}
    # over the points where the served answer reads the top, each seed's mean ECE under each prior, paired
    means = {name: {seed: sum(q[name]["ece"] for q in r if q["reads_top"]) / max(1, sum(q["reads_top"] for q in r))
                    for seed, r in runs.items()} for name in PRIORS}
    command = shlex.join(sys.argv[1:] if argv is None else argv)
    out = {"runs": runs, "mean_ece_where_the_top_is_read": means,
           "composed_minus_slda": paired_difference(means["slda"], means["composed"]),
           "machine": f"{machine_description(torch.device('cpu'))}, 1 thread",
           "command": f"python -m clients.bench.stream.sleep_calibration {command}",
           "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(json.dumps({k: out[k] for k in ("mean_ece_where_the_top_is_read", "composed_minus_slda")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
