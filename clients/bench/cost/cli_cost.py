"""Does `aser add` keep the learner as busy as the benchmark's client? The same camera photos into two fresh
services on their defaults: one fed by `clients.bench.cost.service_cost`'s client (the Python client, batches of 10, as
fast as acknowledged), one by `aser add` on the photos written as a folder a class; trained photos a second from the
first photo sent to the last one trained, and the learner's CPU a trained photo, for each.

    python -m clients.bench.cost.cli_cost --photos 3000 --out results/speed/cli-add.json
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from clients.api import ServiceClient
from clients.bench.cost.service_cost import ProcessWatch, camera_photos, ingest, wait_trained
from clients.bench.live.local_service import LocalService
from clients.bench.machine import machine_description
from clients.bench.results import write_result


def through_the_cli(service: LocalService, photos: list[tuple[str, bytes]], folder: Path, batch: int) -> dict:
    for i, (label, jpeg) in enumerate(photos):
        path = folder / label / f"{i:05d}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(jpeg)
    with ServiceClient(service.url, timeout=120) as client, ProcessWatch(service.proc.pid) as watch:
        (own0, exports0), t0 = watch.cpu_seconds(), time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "clients.cli", "--url", service.url, "add", str(folder),
                               "--batch", str(batch), "--quiet", "--journal", str(folder.parent / "sent")],
                              capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"aser add failed: {done.stderr}")
        sent_s = time.perf_counter() - t0
        st = wait_trained(client, len(photos), timeout=3600)
        wall, (own, exports) = time.perf_counter() - t0, watch.cpu_seconds()
    trained = st["samples_trained"]
    return {"photos": len(photos), "trained": trained, "wall_s": round(wall, 1), "sent_s": round(sent_s, 1),
            "trained_per_s": round(trained / wall, 2),
            "cpu_ms_per_trained_photo": round(1000 * (own - own0 + exports - exports0) / max(trained, 1), 1),
            "peak_rss_mb": {k: round(v, 1) for k, v in watch.peak.items()}, "summary": done.stdout.strip(),
            "batch": batch}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m clients.bench.cost.cli_cost", description=__doc__.split("\n")[0])
    p.add_argument("--photos-zip", default="../shared/datasets/mini-imagenet-slice.zip")
    p.add_argument("--photos", type=int, default=3000)
    p.add_argument("--batch", type=int, default=20, help="aser add's photos a request (its default)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    photos = camera_photos(Path(args.photos_zip), args.photos)
    with tempfile.TemporaryDirectory() as tmp:
        client_service = LocalService(Path(tmp) / "client", {}).start()
        try:
            by_client = ingest(client_service, photos)
        finally:
            client_service.stop()
        cli_service = LocalService(Path(tmp) / "cli", {}).start()
        try:
            by_cli = through_the_cli(cli_service, photos, Path(tmp) / "photos", args.batch)
        finally:
            cli_service.stop()
    out = {"benchmark_client": by_client, "aser_add": by_cli,
           "ratio_trained_per_s": round(by_cli["trained_per_s"] / by_client["trained_per_s"], 3),
           "machine": machine_description(torch.device("cpu")),
           "command": "python -m clients.bench.cost.cli_cost " + " ".join(sys.argv[1:] if argv is None else argv),
           "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    write_result(Path(args.out), out)
    print({k: out[k] for k in ("ratio_trained_per_s",)}, by_client["trained_per_s"], by_cli["trained_per_s"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
