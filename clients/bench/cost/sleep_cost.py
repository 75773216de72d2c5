"""What a sleep (ASER_SLEEP) costs the awake service: ingest, predictions, memory and the lag bound.

On camera-sized JPEGs of real photos (`clients.bench.cost.service_cost.camera_photos`), fresh services:
1. ingest awake: the same photos into a service that never sleeps (ASER_SLEEP=false) and into a sleeping one (no
   idle sleep during it):
   CPU milliseconds a trained photo, photos a second, the learner's peak RSS;
2. /predict of one photo on the sleeping service, idle, then while it sleeps (POST /sleep over those photos): p50 and
   p99, the learner's peak RSS during the sleep, the sleep's CPU and updates;
3. on another sleeping service with ASER_MAX_LAG_S=6, fed the same photos, a stream of CIFAR-10 JPEGs at --rate
   samples a second that starts while a sleep is under way: the largest lag /status showed, how long the sleep took
   to yield, and what was trained and skipped;
4. once a sleep has taught the top and the held-back samples chose it (classes of at least 110 samples, each holding
   10 back): Split EuroSAT tiles of three classes into a service that never sleeps and a sleeping one, a sleep on the
   second, then more tiles of the same classes into both: ingest's cost as in 1., the top served on the sleeping one;
   and on a third, sleeping, service whose online score answers every batch through the top
   (ASER_ONLINE_SCORE_TOP_EVERY=1).

    python -m clients.bench.cost.sleep_cost --out results/speed/sleep-cost.json
    python -m clients.bench.cost.sleep_cost --only-top-served --out results/speed/sleep-cost-top-in-runtime.json  # 4.
    python -m clients.bench.cost.sleep_cost --only-sleep --out results/speed/sleep-cost-lean.json  # 1. and 2., asleep
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from clients.api import ServiceClient
from clients.bench.cost.service_cost import ProcessWatch, camera_photos, ingest, latencies, wait_trained
from clients.bench.cost.speed import ALLOCATOR_ENV
from clients.bench.live.local_service import LocalService, real_jpegs
from clients.bench.machine import machine_description
from clients.bench.results import write_result

AWAKE = {"ASER_SLEEP_IDLE_S": "86400", "ASER_SLEEP_FRESH_IDLE_S": "0"}  # no idle sleep: sleeps come when asked
NO_SLEEP = {"ASER_SLEEP": "false"}  # streaming LDA alone: the default until sleep became it (2026-12-06)
EVERY_BATCH_SCORED = {"ASER_ONLINE_SCORE_TOP_EVERY": "1"}  # the online score's top pass on every batch, as before


def wait_state(client: ServiceClient, state: str, timeout: float = 600) -> dict:
    deadline = time.time() + timeout
    while time.time() < deadline:
        sleep = client.status()["sleep"]
        if sleep["state"] == state:
            return sleep
        time.sleep(0.1)
    raise TimeoutError(f"the service was not {state} within {timeout} s")


def predictions_during_a_sleep(service: LocalService, blobs: list[bytes], n: int) -> dict:
    """POST /sleep, then one-photo predictions until the sleep ends (at most n); the learner's peak RSS meanwhile."""
    with ServiceClient(service.url, timeout=300) as client, ProcessWatch(service.proc.pid) as watch:
        client.http.post("/sleep").raise_for_status()
        wait_state(client, "sleeping")
        during = latencies(service.url, blobs, n, 1)
        sleep = wait_state(client, "awake", timeout=3600)
    return {"predict_during_sleep": during, "peak_rss_mb_during_sleep": round(watch.peak["learner_mb"], 1),
            "sleep": sleep["last"], "store": sleep["store"]}


def stream_into_a_sleep(service: LocalService, samples: list[tuple[str, bytes]], rate: float) -> dict:
    """A sleep under way, then a stream at `rate` a second: the worst lag, and how soon the sleep yielded."""
    worst, stop, yielded_after = [0.0], threading.Event(), [None]
    with ServiceClient(service.url, timeout=120) as client:
        client.http.post("/sleep").raise_for_status()
        wait_state(client, "sleeping")
        time.sleep(2.0)  # well under way
        t0 = time.perf_counter()

        def watch() -> None:
            with ServiceClient(service.url) as watcher:
                while not stop.is_set():
                    st = watcher.status()
                    worst[0] = max(worst[0], st["lag"]["seconds"])
                    if yielded_after[0] is None and st["sleep"]["state"] == "awake":
                        yielded_after[0] = time.perf_counter() - t0
                    stop.wait(0.1)

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            for i in range(0, len(samples), 10):
                time.sleep(max(0.0, t0 + i / rate - time.perf_counter()))
                batch = samples[i:i + 10]
                client.add_samples([c for c, _ in batch], [b for _, b in batch])
            st = wait_trained(client, client.status()["samples_received"], timeout=600)
        finally:
            stop.set()
            watcher.join()
    last = st["sleep"]["last"]
    return {"rate_per_s": rate, "samples": len(samples), "max_lag_s": 6.0, "worst_lag_s": round(worst[0], 2),
            "sleep_yielded_after_s": None if yielded_after[0] is None else round(yielded_after[0], 2),
            "sleep_yielded": last["yielded"], "trained": st["samples_trained"],
            "skipped": st["lag"]["samples_skipped"]}


TILE_CLASSES = ["AnnualCrop", "HerbaceousVegetation", "PermanentCrop"]  # the set's most confused: where a top can lead


def sleep_once(client: ServiceClient, timeout: float = 3600) -> dict:
    """POST /sleep until a sleep has trained (one asked while the last samples settle may yield at once); its report."""
    before, deadline = client.status()["sleep"]["sleeps"], time.time() + timeout
    while time.time() < deadline:
        client.http.post("/sleep").raise_for_status()
        asked = time.time()
        while time.time() < min(deadline, asked + 30):
            sleep = client.status()["sleep"]
            if sleep["sleeps"] > before and sleep["state"] == "awake":
                return sleep["last"]
            time.sleep(0.2 if sleep["state"] == "awake" else 1.0)
            if sleep["state"] == "sleeping":
                asked = time.time()  # under way: wait for it
    raise TimeoutError(f"no sleep trained within {timeout} s")


def wait_snapshot(client: ServiceClient, reason: str, timeout: float = 600) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if any(s["reason"] == reason for s in client.http.get("/snapshots").json()["snapshots"]):
            return
        time.sleep(0.5)
    raise TimeoutError(f"no snapshot for a {reason} within {timeout} s")


def ingest_after_a_sleep(service: LocalService, first: list[tuple[str, bytes]],
                         later: list[tuple[str, bytes]]) -> dict:
    """`first` into a fresh service, a sleep where it sleeps, then what ingesting `later` costs (`ingest`), one-tile
    predictions, and which head served then."""
    service.start()
    try:
        with ServiceClient(service.url, timeout=300) as client:
            for i in range(0, len(first), 50):
                client.add_samples([c for c, _ in first[i:i + 50]], [b for _, b in first[i:i + 50]])
            wait_trained(client, len(first), timeout=3600)
            if client.status()["sleep"] is not None and sleep_once(client)["kept"]:
                wait_snapshot(client, "sleep")  # its export's CPU is the sleep's, not the ingest's after it
        result = ingest(service, later)
        result["predict"] = latencies(service.url, [b for _, b in later], 200, 1)
        with ServiceClient(service.url) as client:
            st = client.status()
        choice = st["head_choice"] or {}
        return {**result, "serving_head": st["serving_head"], "pool": choice.get("pool"),
                "held_back": choice.get("held_back"), "sleep": (st["sleep"] or {}).get("last"),
                "online": {k: st["online"][k] for k in ("samples_scored", "samples_unscored", "accuracy")}}
    finally:
        service.stop()


def top_served(args, tmp: Path) -> dict:
    """4.: a service that never sleeps and a sleeping one, each fed the same tiles around a sleep
    (`ingest_after_a_sleep`)."""
    tiles = real_jpegs(Path(args.eurosat), args.before_sleep + args.after_sleep, classes=TILE_CLASSES)
    return {name: ingest_after_a_sleep(LocalService(tmp / f"tiles-{name}", env), tiles[:args.before_sleep],
                                       tiles[args.before_sleep:])
            for name, env in (("no_sleep", NO_SLEEP), ("sleep", {"ASER_SLEEP": "true", **AWAKE}),
                              ("sleep_scoring_every_batch", {"ASER_SLEEP": "true", **AWAKE, **EVERY_BATCH_SCORED}))}


def sleeping_service(photos: list[tuple[str, bytes]], args, tmp: Path) -> dict:
    """1. and 2. on a sleeping service: its ingest, predictions idle and during a sleep, the learner's RSS."""
    blobs = [b for _, b in photos]
    sleeping = LocalService(tmp / "sleep", {"ASER_SLEEP": "true", **AWAKE}).start()
    try:
        out = {"ingest": ingest(sleeping, photos), "predict_idle": latencies(sleeping.url, blobs, args.predictions, 1)}
        return out | predictions_during_a_sleep(sleeping, blobs, args.predictions)
    finally:
        sleeping.stop()


def _sleep_only(args, argv) -> int:
    photos = camera_photos(Path(args.photos_zip), args.photos)
    with tempfile.TemporaryDirectory() as tmp:
        out = {"photos": len(photos)} | sleeping_service(photos, args, Path(tmp))
    p99 = {k: out[f"predict_{k}"]["p99_ms"] for k in ("idle", "during_sleep")}
    out["summary"] = {"peak_rss_mb_ingest": out["ingest"]["peak_rss_mb"]["learner_mb"],
                      "peak_rss_mb_during_sleep": out["peak_rss_mb_during_sleep"],
                      "predict_p99_ratio": round(p99["during_sleep"] / p99["idle"], 2)}
    return _write(out, args, argv)


def _top_served_only(args, argv) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        out = {"ingest_top_served": top_served(args, Path(tmp))}
    ms = {k: v["cpu_ms_per_trained_photo"] for k, v in out["ingest_top_served"].items()}
    out["summary"] = {"top_served_cpu_ms_a_tile": ms, "top_served_ratio": round(ms["sleep"] / ms["no_sleep"], 3),
                      "every_batch_scored_ratio": round(ms["sleep_scoring_every_batch"] / ms["no_sleep"], 3)}
    return _write(out, args, argv)


def _write(out: dict, args, argv) -> int:
    command = "python -m clients.bench.cost.sleep_cost " + " ".join(sys.argv[1:] if argv is None else argv)
    out |= {"machine": machine_description(torch.device("cpu")), "command": command,
            "allocator": {k: v for k, v in os.environ.items() if k in ALLOCATOR_ENV},  # the services inherit it
            "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    write_result(Path(args.out), out)
    print(out["summary"])
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m clients.bench.cost.sleep_cost", description=__doc__.split("\n")[0])
    p.add_argument("--photos-zip", default="../shared/datasets/mini-imagenet-slice.zip")
    p.add_argument("--cifar", default="../shared/datasets/cifar10-jpeg.zip", help="the stream into a sleep")
    p.add_argument("--photos", type=int, default=1500)
    p.add_argument("--eurosat", default="../shared/datasets/eurosat-rgb.zip", help="the tiles of 4.")
    p.add_argument("--before-sleep", type=int, default=450, help="tiles of 4. before the sleep (three classes)")
    p.add_argument("--after-sleep", type=int, default=300, help="tiles of 4. after it")
    p.add_argument("--predictions", type=int, default=300, help="one-photo predictions, idle and during the sleep")
    p.add_argument("--rate", type=float, default=80.0)
    p.add_argument("--stream-seconds", type=float, default=30.0)
    only = p.add_mutually_exclusive_group()
    only.add_argument("--only-top-served", action="store_true", help="4. alone")
    only.add_argument("--only-sleep", action="store_true", help="1. and 2. on the sleeping service alone")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if args.only_top_served:
        return _top_served_only(args, argv)
    if args.only_sleep:
        return _sleep_only(args, argv)
    photos = camera_photos(Path(args.photos_zip), args.photos)
    blobs = [b for _, b in photos]
    out = {"photos": len(photos), "ingest": {}}
    with tempfile.TemporaryDirectory() as tmp:
        awake = LocalService(Path(tmp) / "no-sleep", NO_SLEEP).start()
        try:
            out["ingest"]["no_sleep"] = ingest(awake, photos)
            out["predict_no_sleep_idle"] = latencies(awake.url, blobs, args.predictions, 1)
        finally:
            awake.stop()
        sleep = sleeping_service(photos, args, Path(tmp))
        out["ingest"]["sleep"] = sleep.pop("ingest")
        out |= sleep
        bounded = LocalService(Path(tmp) / "bounded", {"ASER_SLEEP": "true", "ASER_MAX_LAG_S": "6", **AWAKE}).start()
        try:
            with ServiceClient(bounded.url, timeout=120) as client:  # what a sleep has to rehearse
                for i in range(0, len(photos), 50):  # camera photos: 50 a request stays under the body limit
                    client.add_samples([c for c, _ in photos[i:i + 50]], blobs[i:i + 50])
                wait_trained(client, len(photos), timeout=3600)
            stream = real_jpegs(Path(args.cifar), int(args.rate * args.stream_seconds))
            out["stream_into_a_sleep"] = stream_into_a_sleep(bounded, stream, args.rate)
        finally:
            bounded.stop()
        out["ingest_top_served"] = top_served(args, Path(tmp))
    ingest_ms = {k: v["cpu_ms_per_trained_photo"] for k, v in out["ingest"].items()}
    after_ms = {k: v["cpu_ms_per_trained_photo"] for k, v in out["ingest_top_served"].items()}
    out["summary"] = {
        "ingest_cpu_ms_a_photo": ingest_ms, "ingest_ratio": round(ingest_ms["sleep"] / ingest_ms["no_sleep"], 3),
        "top_served_cpu_ms_a_tile": after_ms, "top_served_ratio": round(after_ms["sleep"] / after_ms["no_sleep"], 3),
        "predict_p99_idle_ms": out["predict_idle"]["p99_ms"],
        "predict_p99_during_sleep_ms": out["predict_during_sleep"]["p99_ms"],
        "predict_p99_ratio": round(out["predict_during_sleep"]["p99_ms"] / out["predict_idle"]["p99_ms"], 2),
        "peak_rss_mb_during_sleep": out["peak_rss_mb_during_sleep"],
        "worst_lag_s_streaming_into_a_sleep": out["stream_into_a_sleep"]["worst_lag_s"]}
    return _write(out, args, argv)


if __name__ == "__main__":
    sys.exit(main())
