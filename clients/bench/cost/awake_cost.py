"""The learner's CPU a sample awake, in process: the default against the sleeping configuration, whose memory values
samples in the top's space or in the frozen network's (`ContinualLearner.values_frozen`).

Split EuroSAT tiles brought to 160 px, each configuration built afresh, its memory (M=200) filled by the first
`--warm` samples, then `observe` timed (process CPU) over the next `--timed`, batches of ten, one thread; the
configurations take turns `--rounds` times (a loaded machine slows them alike). What is timed is the learner's own
work a batch (the frozen part, streaming LDA, the held-back samples, the memory's update, a step where one is
taken), not the service's (decoding, the log, the latent store's writes, snapshots: `clients.bench.cost.sleep_cost`).

    python -m clients.bench.cost.awake_cost --out results/speed/awake-cost.json
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from clients.bench.machine import machine_description
from learner import make_learner
from learner.data import load_dataset
from learner.methods.sleep import SleepConfig
from learner.networks.backbone import make_backbone
from learner.networks.lite0 import POOLED

SIZE = 160


def configurations() -> dict:
    """name -> the learner's options beside the common ones (ASER's class-balanced memory, ACE, the average)."""
    sleeping = {"cut": 11, "serving_head": "slda", "choose_head": "held-back", "head_prior": "pool",
                "train_every": 0, "sleep": SleepConfig()}
    return {"default": {"cut": POOLED, "serving_head": "slda"},
            "sleep, values in the top's space": {**sleeping, "frozen_values": False},
            "sleep, values in the frozen space (the default since 2026-12-02)": {**sleeping, "frozen_values": True}}


def cpu_ms_a_sample(options: dict, x: torch.Tensor, y: torch.Tensor, warm: int, timed: int) -> float:
    options = dict(options)
    backbone = make_backbone("lite0", (3, SIZE, SIZE), SIZE, options.pop("cut"), 16)
    learner = make_learner("cb-sv-duel", 10, mem_size=200, loss="ace", lr=0.01, ema_decay=0.99, backbone=backbone,
                           seed=0, calibrate=True, **options)
    learner.warm_up()
    for i in range(0, warm, 10):
        learner.observe(x[i:i + 10], y[i:i + 10])
    start = time.process_time()
    for i in range(warm, warm + timed, 10):
        learner.observe(x[i:i + 10], y[i:i + 10])
    return 1000 * (time.process_time() - start) / timed


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="../shared/datasets/eurosat-rgb.zip")
    p.add_argument("--warm", type=int, default=300)
    p.add_argument("--timed", type=int, default=300)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    data = load_dataset("eurosat", args.data, train_per_class=(args.warm + args.timed) // 10 + 1, test_per_class=1)
    order = torch.randperm(len(data.train_y), generator=torch.Generator().manual_seed(0))
    x = F.interpolate(data.train_x[order].float(), size=SIZE, mode="bilinear").round().clamp(0, 255).to(torch.uint8)
    y = data.train_y[order]
    measured = {name: [] for name in configurations()}
    for _ in range(args.rounds):
        for name, options in configurations().items():
            measured[name].append(round(cpu_ms_a_sample(options, x, y, args.warm, args.timed), 2))
            print(name, measured[name][-1], "ms a sample", flush=True)
    default = min(measured["default"])
    result = {"cpu_ms_a_sample": measured,
              "best_of_rounds_over_default": {name: round(min(v) / default, 3) for name, v in measured.items()},
              "input_size": SIZE, "mem_size": 200, "warm": args.warm, "timed": args.timed,
              "machine": machine_description(torch.device("cpu")),
              "command": "python -m clients.bench.cost.awake_cost "
              + shlex.join(sys.argv[1:] if argv is None else argv),
              "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["best_of_rounds_over_default"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
