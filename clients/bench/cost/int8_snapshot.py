"""The int8 snapshot against the fp32 one, measured through two real replicas.

A learner on the pretrained backbone (ASER_BACKBONE=lite0, ASER_SNAPSHOT_INT8=true) learns from
`--train` CIFAR-10 JPEGs, exports a snapshot (the fp32 graph and, where it agrees, its int8
variant), and two replicas follow it, one serving each (ASER_REPLICA_INT8). Both answer the same
`--test` CIFAR-10 test JPEGs: top-1 agreement between them, each one's accuracy, and the latency of a
one-image /predict (`--latency` requests each, one onnxruntime thread a replica, the client on the
same machine), beside the files' sizes.

    python -m clients.bench.cost.int8_snapshot --data ../shared/datasets/cifar10-jpeg.zip \
        --out results/pretrained/int8-snapshot.json
"""

from __future__ import annotations

import argparse
import base64
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

from clients.api import ServiceClient
from clients.bench.live.local_service import LocalService, real_jpegs
from clients.bench.machine import machine_description
from clients.bench.results import write_result

LEARNER_ENV = {"ASER_BACKBONE": "lite0", "ASER_SNAPSHOT_INT8": "true", "ASER_SNAPSHOT_EVERY_STEPS": "0",
               "ASER_CHECKPOINT_EVERY_STEPS": "1000"}


def answers(replica: LocalService, images: list[bytes], batch: int = 50) -> list[str]:
    top = []
    for i in range(0, len(images), batch):
        body = {"images": [base64.b64encode(b).decode() for b in images[i:i + batch]], "k": 1}
        r = httpx.post(f"{replica.url}/predict", json=body, timeout=120)
        r.raise_for_status()
        top += [result[0]["label"] for result in r.json()["results"]]
    return top


def latencies_ms(replica: LocalService, images: list[bytes], n: int) -> list[float]:
    out = []
    with httpx.Client(timeout=60) as http:
        for i in range(n):
            body = {"images": [base64.b64encode(images[i % len(images)]).decode()], "k": 1}
            t0 = time.perf_counter()
            http.post(f"{replica.url}/predict", json=body).raise_for_status()
            out.append(1000 * (time.perf_counter() - t0))
    return out


def wait_for_snapshot(replica: LocalService, timeout: float = 120) -> dict:
    deadline = time.time() + timeout
    while time.time() < deadline:
        st = httpx.get(f"{replica.url}/status").json()
        if st["snapshot_id"] is not None:
            return st
        time.sleep(0.5)
    raise RuntimeError("the replica loaded no snapshot")


def measure(args) -> dict:
    train, test = real_jpegs(Path(args.data), args.train), real_jpegs(Path(args.data), args.test, split="test")
    root = Path(tempfile.mkdtemp(prefix="aser-int8-"))
    learner = LocalService(root / "learner", LEARNER_ENV).start()
    replicas = {}
    try:
        client = ServiceClient(learner.url, timeout=120)
        for i in range(0, len(train), 100):
            client.add_samples([c for c, _ in train[i:i + 100]], [b for _, b in train[i:i + 100]])
        client.drain(timeout=3600)
        snapshot = client.create_snapshot()
        if snapshot["int8"] is None:
            raise RuntimeError("the int8 variant did not agree and was not kept: see the learner's log")
        for variant in ("fp32", "int8"):
            env = {"ASER_REPLICA_SOURCE": learner.url, "ASER_REPLICA_POLL_S": "1", "ASER_REPLICA_THREADS": "1",
                   "ASER_REPLICA_INT8": str(variant == "int8").lower()}
            replicas[variant] = LocalService(root / variant, env, module="service.replica").start()
            assert wait_for_snapshot(replicas[variant])["variant"] == variant
        labels, images = [c for c, _ in test], [b for _, b in test]
        top = {v: answers(r, images) for v, r in replicas.items()}
        latency = {v: latencies_ms(r, images, args.latency) for v, r in replicas.items()}
    finally:
        for service in (*replicas.values(), learner):
            service.stop()
    agree = sum(a == b for a, b in zip(top["fp32"], top["int8"])) / len(images)
    return {
        "snapshot": {"id": snapshot["id"], "classes": len(snapshot["classes"]), "fp32_bytes": snapshot["size_bytes"],
                     "int8_bytes": snapshot["int8"]["size_bytes"],
                     "int8_agreement_at_export": snapshot["int8"]["agreement"]},
        "train_images": len(train), "test_images": len(images),
        "top1_agreement": round(agree, 4),
        "accuracy": {v: round(sum(a == b for a, b in zip(t, labels)) / len(labels), 4) for v, t in top.items()},
        "predict_one_image_ms": {v: {"p50": round(statistics.median(ms), 2),
                                     "p95": round(statistics.quantiles(ms, n=20)[18], 2)} for v, ms in latency.items()},
        "settings": LEARNER_ENV, "replica_threads": 1,
        "machine": machine_description(torch.device("cpu")),
        "command": "python -m clients.bench.cost.int8_snapshot " + " ".join(sys.argv[1:]),
        "measured": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m clients.bench.cost.int8_snapshot", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="the CIFAR-10 zip")
    p.add_argument("--train", type=int, default=1000, help="training images (all ten classes)")
    p.add_argument("--test", type=int, default=1000, help="test images both replicas answer")
    p.add_argument("--latency", type=int, default=200, help="one-image requests timed a replica")
    p.add_argument("--out", help="write the result JSON here")
    args = p.parse_args(argv)
    result = measure(args)
    print(json.dumps(result, indent=2))
    if args.out:
        write_result(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
