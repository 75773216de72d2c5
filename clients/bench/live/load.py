"""Load benchmark of the service on loopback: ingest rate against training rate, and predict
latency while the learner trains.

It starts a fresh service (its defaults, M=1000, CPU, or --env settings; the result records the
method) on a free loopback port with a temporary data directory, or uses --url. Then:
1. ingest: `--ingest-clients` threads POST batches of real CIFAR-10 JPEGs for `--seconds`;
   reports acknowledged samples/s and, over the same window, samples/s trained (the ingest
   must outrun the learner: the backlog grows).
2. predict under training: with the backlog keeping the learner busy, `--predict-clients`
   threads (several counts: one phase each) send single-image GET /predict for `--seconds`;
   reports predictions/s, p50/p90/p99/max latency, and the training steps taken meanwhile
   (proof that training ran). Concurrent predictions share forward passes (micro-batching).

    python -m clients.bench.live.load --data ../shared/datasets/cifar10-jpeg.zip --out results/load/load-cpu.json
"""

from __future__ import annotations

import argparse
import base64
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from clients.api import ServiceClient
from clients.bench.live.local_service import LocalService, real_jpegs
from clients.bench.results import write_result


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def ingest_phase(url: str, samples: list[tuple[str, bytes]], clients: int, batch: int, seconds: float) -> dict:
    status = ServiceClient(url).status
    accepted, errors, lock = [0], [0], threading.Lock()
    stop = time.time() + seconds

    def worker(offset: int) -> None:
        with ServiceClient(url) as client:
            i = offset * batch
            while time.time() < stop:
                chunk = [samples[(i + j) % len(samples)] for j in range(batch)]
                i += clients * batch
                try:
                    n = client.add_samples([c for c, _ in chunk], [b for _, b in chunk])["accepted"]
                    with lock:
                        accepted[0] += n
                except Exception:
                    with lock:
                        errors[0] += 1

    before, t0 = status(), time.perf_counter()
    threads = [threading.Thread(target=worker, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed, after = time.perf_counter() - t0, status()
    trained = after["samples_trained"] - before["samples_trained"]
    return {"clients": clients, "batch": batch, "seconds": round(elapsed, 2), "accepted": accepted[0],
            "errors": errors[0], "ingest_samples_per_s": round(accepted[0] / elapsed, 1),
            "trained": trained, "train_samples_per_s": round(trained / elapsed, 1),
            "backlog_after": after["backlog"]}


def predict_phase(url: str, samples: list[tuple[str, bytes]], clients: int, seconds: float) -> dict:
    status = ServiceClient(url).status
    latencies: list[float] = []
    errors, lock = [0], threading.Lock()
    encoded = [base64.urlsafe_b64encode(img).decode().rstrip("=") for _, img in samples[:200]]
    stop = time.time() + seconds

    def worker(offset: int) -> None:
        with httpx.Client(base_url=url, timeout=30) as http:
            i = offset
            while time.time() < stop:
                t0 = time.perf_counter()
                r = http.get("/predict", params={"image": encoded[i % len(encoded)], "k": 3})
                dt = time.perf_counter() - t0
                i += clients
                with lock:
                    if r.status_code == 200:
                        latencies.append(dt)
                    else:
                        errors[0] += 1

    before = status()
    threads = [threading.Thread(target=worker, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    after = status()
    ms = [1000 * x for x in latencies]
    return {"clients": clients, "seconds": seconds, "requests": len(ms), "errors": errors[0],
            "requests_per_s": round(len(ms) / seconds, 1),
            "p50_ms": round(statistics.median(ms), 2), "p90_ms": round(percentile(ms, 90), 2),
            "p99_ms": round(percentile(ms, 99), 2), "max_ms": round(max(ms), 2),
            "training_steps_meanwhile": after["steps"] - before["steps"], "backlog_after": after["backlog"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="../shared/datasets/cifar10-jpeg.zip", help="a CIFAR-10 JPEG zip")
    p.add_argument("--url", help="an already running, fresh service (default: start one)")
    p.add_argument("--samples", type=int, default=2000, help="distinct real images to cycle through")
    p.add_argument("--ingest-clients", type=int, default=4)
    p.add_argument("--ingest-batch", type=int, default=10, help="samples per POST /samples")
    p.add_argument("--predict-clients", type=int, nargs="+", default=[1],
                   help="concurrent predict clients; several values run one phase each")
    p.add_argument("--seconds", type=float, default=20.0, help="length of each phase")
    p.add_argument("--out", default=".cache/bench/load-cpu.json", help="the result file (results/ only when named)")
    p.add_argument("--env", action="append", default=[], metavar="ASER_X=V", help="a setting of the started service")
    args = p.parse_args(argv)

    samples = real_jpegs(Path(args.data), args.samples)
    proc = tmp = None
    url = args.url
    try:
        if url is None:
            tmp = tempfile.TemporaryDirectory()
            env = dict(item.split("=", 1) for item in args.env)
            proc = LocalService(tmp.name, {"ASER_SNAPSHOT_EVERY_STEPS": "0", **env}).start()
            url = proc.url
        ingest = ingest_phase(url, samples, args.ingest_clients, args.ingest_batch, args.seconds)
        print(json.dumps({"ingest": ingest}))
        predict = []
        for clients in args.predict_clients:
            predict.append(predict_phase(url, samples, clients, args.seconds))
            print(json.dumps({"predict": predict[-1]}))
        final = ServiceClient(url).status()
    finally:
        if proc is not None:
            proc.stop()
        if tmp is not None:
            tmp.cleanup()
    from clients.bench.machine import machine_description, resolve_device

    result = {
        "machine": machine_description(resolve_device("cpu")),
        "service": {"method": final["method"], "device": final["device"], **final["config"]},
        "ingest": ingest,
        "predict_while_training": predict,
        "ingest_over_training": round(ingest["ingest_samples_per_s"] / max(ingest["train_samples_per_s"], 1e-9), 1),
        "command": "python -m clients.bench.live.load " + " ".join(argv if argv is not None else sys.argv[1:]),
        "measured": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    write_result(args.out, result)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
