"""What the service costs a camera photo, against the floor: CPU, throughput, latency and memory.

It makes camera-sized JPEGs (640x480, quality 90) of real photos (the Mini-ImageNet slice, classes in
its order, 60 a class), starts a fresh service on its defaults (or --env settings; --tree runs another
checkout's service, for a before/after on one machine), and measures:
1. ingest: the photos sent class by class in batches of 10 as fast as acknowledged, snapshots on (a new
   class exports one): trained photos a second, the service's CPU seconds (its process tree) a trained
   photo, the learner process's peak RSS (and the snapshot exporter's, its child);
2. the parts of a photo's CPU, measured here on the same photos with the same code (one thread, the
   service's batch of 10): decoding by the input rule, the frozen part as the learner runs it, the
   streaming head's update; the floor is decoding plus onnxruntime's own time for the frozen part;
3. /predict, unloaded: the latency of 1 and of 32 photos (p50, p99), then of one photo while another
   client sends the largest prediction requests the service takes;
4. the lag bound: a fresh service with ASER_MAX_LAG_S=6 fed CIFAR-10 JPEGs at --rate samples a second
   (80, and 320: several times what it trains) for --lag-seconds: the largest lag /status showed, trained
   and skipped.

    python -m clients.bench.cost.service_cost --out results/speed/service-cost-after.json
    python -m clients.bench.cost.service_cost --tree ../before --out results/speed/service-cost-before.json
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import zipfile
from pathlib import Path

import httpx
import numpy as np
import torch
from PIL import Image

from clients.api import ServiceClient
from clients.bench.live.load import percentile
from clients.bench.live.local_service import LocalService, real_jpegs
from clients.bench.machine import machine_description
from clients.bench.results import write_result
from learner.formats.snapshot import read_image

PER_CLASS = 60  # the slice's photos a class
CAMERA = (640, 480)
INPUT_SIZE = 160  # the default's input size


def camera_photos(path: Path, n: int) -> list[tuple[str, bytes]]:
    """(class, JPEG bytes) of the first n // 60 classes' photos, class after class, each brought to a
    camera's 640x480 (the centre 4:3 of the 84x84 photo, bicubic) and encoded at quality 90."""
    photos = []
    with zipfile.ZipFile(path) as z:
        names = z.namelist()
        for wnid in z.read("mini-imagenet/classes.txt").decode().split()[:max(1, n // PER_CLASS)]:
            for name in sorted(x for x in names if x.startswith(f"mini-imagenet/{wnid}/"))[:PER_CLASS]:
                photo = Image.open(io.BytesIO(z.read(name))).convert("RGB")
                w, h = photo.size
                photo = photo.crop((0, (h - w * 3 // 4) // 2, w, (h + w * 3 // 4) // 2)).resize(CAMERA, Image.BICUBIC)
                buf = io.BytesIO()
                photo.save(buf, "JPEG", quality=90)
                photos.append((wnid, buf.getvalue()))
    return photos[:n]


class ProcessWatch:
    """CPU seconds and resident memory of a process and its children, sampled every `every` s."""

    def __init__(self, pid: int, every: float = 0.2):
        self.pid, self.every = pid, every
        self.peak = {"learner_mb": 0.0, "children_mb": 0.0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> ProcessWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        while not self._stop.is_set():
            self.peak["learner_mb"] = max(self.peak["learner_mb"], rss_mb(self.pid))
            self.peak["children_mb"] = max(self.peak["children_mb"], sum(rss_mb(c) for c in children(self.pid)))
            self._stop.wait(self.every)

    def cpu_seconds(self) -> tuple[float, float]:
        """The process's own CPU seconds, and its children's (the snapshot exporter), living and reaped."""
        own = cpu_seconds(self.pid)
        return own, cpu_seconds(self.pid, reaped=True) - own + sum(cpu_seconds(c) for c in children(self.pid))


def children(pid: int) -> list[int]:
    """The process's children, whichever of its threads started them."""
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return found


def rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def cpu_seconds(pid: int, reaped: bool = False) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    ticks = int(fields[11]) + int(fields[12]) + (int(fields[13]) + int(fields[14]) if reaped else 0)
    return ticks / os.sysconf("SC_CLK_TCK")


def wait_trained(client: ServiceClient, n: int, timeout: float) -> dict:
    deadline = time.time() + timeout
    while time.time() < deadline:
        st = client.status()
        if st["samples_trained"] + st["lag"]["samples_skipped"] >= n and st["backlog"] == 0:
            return st
        time.sleep(0.2)
    raise TimeoutError(f"the service did not train {n} samples in {timeout} s")


def ingest(service: LocalService, photos: list[tuple[str, bytes]]) -> dict:
    """The photos into the service, ten a request; what it took, from what it had trained before."""
    with ServiceClient(service.url, timeout=120) as client, ProcessWatch(service.proc.pid) as watch:
        before = client.status()
        (own0, exports0), t0 = watch.cpu_seconds(), time.perf_counter()
        for i in range(0, len(photos), 10):
            batch = photos[i:i + 10]
            client.add_samples([c for c, _ in batch], [b for _, b in batch])
        st = wait_trained(client, before["samples_trained"] + before["lag"]["samples_skipped"] + len(photos),
                          timeout=3600)
        wall, (own, exports) = time.perf_counter() - t0, watch.cpu_seconds()
        snapshots = len(client.http.get("/snapshots").json()["snapshots"])
    trained = st["samples_trained"] - before["samples_trained"]
    per_photo = 1000 / max(trained, 1)
    skipped = st["lag"]["samples_skipped"] - before["lag"]["samples_skipped"]
    return {"photos": len(photos), "trained": trained, "skipped": skipped,
            "wall_s": round(wall, 1), "trained_per_s": round(trained / wall, 2),
            "cpu_ms_per_trained_photo": round(per_photo * (own - own0 + exports - exports0), 1),
            "of_which_learner_process_ms": round(per_photo * (own - own0), 1),
            "of_which_snapshot_exports_ms": round(per_photo * (exports - exports0), 1),
            "peak_rss_mb": {k: round(v, 1) for k, v in watch.peak.items()}, "snapshots_kept": snapshots,
            "steps": st["steps"]}


def parts(photos: list[tuple[str, bytes]], sample: int = 200) -> dict:
    """CPU milliseconds a photo of each part, on this process's one thread, batches of 10."""
    from learner.heads.streaming_lda import make_head
    from learner.networks.backbone import PretrainedBackbone

    torch.set_num_threads(1)
    blobs = [b for _, b in photos[:sample]]
    t = time.process_time()
    images = torch.from_numpy(np.stack([read_image(b, INPUT_SIZE) for b in blobs]))
    decode = (time.process_time() - t) / len(blobs)
    backbone = PretrainedBackbone(input_size=INPUT_SIZE)
    backbone.encode_with_features(images[:10])  # warm-up: the session is built at first use
    t = time.process_time()
    features = torch.cat([backbone.encode_with_features(images[i:i + 10])[1] for i in range(0, len(blobs), 10)])
    frozen = (time.process_time() - t) / len(blobs)
    eager = time.process_time()
    with torch.no_grad():
        for i in range(0, 50, 10):
            backbone.frozen.lower(images[i:i + 10], backbone.cut)
    eager = (time.process_time() - eager) / 50
    head, labels = make_head("slda", features.shape[1]), torch.arange(len(blobs)) // 40  # past the young
    t = time.process_time()
    for i in range(0, len(blobs), 10):
        head.update(features[i:i + 10], labels[i:i + 10])
    update = (time.process_time() - t) / len(blobs)
    t = time.process_time()
    head.head()
    solve = time.process_time() - t
    return {"decode_ms": round(1000 * decode, 2), "frozen_part_ms": round(1000 * frozen, 2),
            "frozen_part_pytorch_eager_ms": round(1000 * eager, 2), "streaming_head_update_ms": round(1000 * update, 3),
            "streaming_lda_solve_ms": round(1000 * solve, 1),
            "floor_ms": round(1000 * (decode + frozen), 2), "note": "the learner's frozen part is onnxruntime's: "
            "the floor's frozen part is the same session"}


def latencies(url: str, blobs: list[bytes], n: int, per_request: int) -> dict:
    ms = []
    with httpx.Client(base_url=url, timeout=300) as http:
        for i in range(n):
            files = [("image", (f"p{j}.jpg", blobs[(i * per_request + j) % len(blobs)], "image/jpeg"))
                     for j in range(per_request)]
            t0 = time.perf_counter()
            r = http.post("/predict", files=files)
            ms.append(1000 * (time.perf_counter() - t0))
            r.raise_for_status()
    return {"photos_a_request": per_request, "requests": n, "p50_ms": round(statistics.median(ms), 1),
            "p99_ms": round(percentile(ms, 99), 1), "max_ms": round(max(ms), 1)}


def beside_large_requests(url: str, blobs: list[bytes], flood_blobs: list[bytes], n: int) -> dict:
    """One-photo latency while another client sends prediction requests of every image of `flood_blobs`
    (as many as a request may hold: small images, so that the body stays under its limit) back to back."""
    stop, done, errors = threading.Event(), [0], []

    def flood() -> None:
        with httpx.Client(base_url=url, timeout=600) as http:
            files = [("image", (f"p{j}.jpg", b, "image/jpeg")) for j, b in enumerate(flood_blobs)]
            while not stop.is_set():
                r = http.post("/predict", files=files)
                if r.status_code != 200:
                    errors.append(r.status_code)
                done[0] += 1

    thread = threading.Thread(target=flood)
    thread.start()
    time.sleep(2.0)  # the first large request under way
    try:
        one = latencies(url, blobs, n, 1)
    finally:
        stop.set()
        thread.join()
    return {**one, "large_request_images": len(flood_blobs), "large_requests_answered": done[0],
            "large_request_errors": sorted(set(errors))}


def lag_bound(tree: Path, cifar: Path, env: dict, rate: float, seconds: float) -> dict:
    samples = real_jpegs(cifar, int(rate * seconds))
    with tempfile.TemporaryDirectory() as tmp:
        service = LocalService(Path(tmp) / "data", {**env, "ASER_MAX_LAG_S": "6"}, cwd=tree).start()
        worst, stop = [0.0], threading.Event()

        def watch() -> None:
            with ServiceClient(service.url) as client:
                while not stop.is_set():
                    worst[0] = max(worst[0], client.status()["lag"]["seconds"])
                    stop.wait(0.5)

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            with ServiceClient(service.url, timeout=120) as client:
                t0 = time.perf_counter()
                for i in range(0, len(samples), 10):
                    time.sleep(max(0.0, t0 + i / rate - time.perf_counter()))
                    batch = samples[i:i + 10]
                    client.add_samples([c for c, _ in batch], [b for _, b in batch])
                st = wait_trained(client, len(samples), timeout=600)
        finally:
            stop.set()
            watcher.join()
            service.stop()
    return {"rate_per_s": rate, "seconds": seconds, "max_lag_s": 6.0, "worst_lag_s": round(worst[0], 2),
            "trained": st["samples_trained"], "skipped": st["lag"]["samples_skipped"],
            "thinned": st["lag"]["samples_thinned"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--photos-zip", default="../shared/datasets/mini-imagenet-slice.zip")
    p.add_argument("--cifar", default="../shared/datasets/cifar10-jpeg.zip", help="the lag bound's stream")
    p.add_argument("--photos", type=int, default=3000)
    p.add_argument("--tree", default=".", help="the checkout whose service runs (another one: a before/after)")
    p.add_argument("--env", action="append", default=[], metavar="ASER_X=V", help="a setting of the services")
    p.add_argument("--largest", type=int, default=1024, help="images (CIFAR-10 JPEGs) in the flooding client's "
                   "requests at most (fewer where the service takes fewer)")
    p.add_argument("--rate", type=float, nargs="+", default=[80.0, 320.0], help="the lag bound's streams, samples "
                   "a second (one fresh service each)")
    p.add_argument("--lag-seconds", type=float, default=60.0)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    env = dict(kv.split("=", 1) for kv in args.env)
    photos = camera_photos(Path(args.photos_zip), args.photos)
    tree = Path(args.tree).resolve()
    result = {"command": "python -m clients.bench.cost.service_cost "
              + " ".join(sys.argv[1:] if argv is None else argv),
              "machine": machine_description(torch.device("cpu")), "cores": os.cpu_count(), "tree": str(tree),
              "env": env, "finished": None}
    with tempfile.TemporaryDirectory() as tmp:
        service = LocalService(Path(tmp) / "data", env, cwd=tree).start()
        try:
            result["ingest"] = ingest(service, photos)
            blobs = [b for _, b in photos[::7]]
            result["predict"] = [latencies(service.url, blobs, 200, 1), latencies(service.url, blobs, 40, 32)]
            cap = httpx.get(service.url + "/openapi.json").json()["components"]["schemas"]["PredictImages"]
            largest = min(args.largest, cap["properties"]["images"]["maxItems"])  # as many as the service takes
            flood = [b for _, b in real_jpegs(Path(args.cifar), largest, split="test")]
            result["predict_beside_large_requests"] = beside_large_requests(service.url, blobs, flood, 100)
        finally:
            service.stop()
    result["parts"] = parts(photos)
    result["ingest"]["cpu_over_floor"] = round(result["ingest"]["cpu_ms_per_trained_photo"] /
                                               result["parts"]["floor_ms"], 2)
    result["ingest"]["learner_process_over_floor"] = round(result["ingest"]["of_which_learner_process_ms"] /
                                                           result["parts"]["floor_ms"], 2)
    result["lag_bound"] = [lag_bound(tree, Path(args.cifar), env, rate, args.lag_seconds) for rate in args.rate]
    result["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    write_result(args.out, result)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
