"""A real client's view of a Split stream: a fresh service (its defaults, or `--env` settings) in an
empty data directory receives a data set's training photos over HTTP (NDJSON `POST /samples`) task by
task, two classes a task in the data set's order, the task's classes interleaved, as a device in the
field would send them. Measured through `POST /predict` on `--test-per-class` held-out photos of
every class seen so far: once each new class has sent 10, 100 and 1000 photos (the benchmark's
anytime accuracy, `clients.bench.stream.protocol.AnytimeProbe`), and at the end of each task. At the end: the head
the service serves (and its stream-measured choice), and the ONNX snapshot's parity with `/predict`
(the same top-1 label on every test photo, the largest gap in its probability). With `--rate R` the
device sends R photos a second, ten at a time, and a service that rehearses while idle
(ASER_IDLE_REHEARSAL) has the time between them; with `--quiet-every N --quiet-s S` it also goes quiet for S
seconds after every N photos, as a device's day has idle hours (a service with ASER_SLEEP sleeps then), and once its
stream has ended it waits for the service's sleep over what is new before the final measure (`after_idle`). With
`--fresh-sleep` its user then asks for a fresh sleep (`POST /sleep?fresh=true`: the top trained again from ImageNet's
weights over everything held) and measures once more (`after_fresh`); where `--env ASER_SLEEP_FRESH_IDLE_S` is set it
asks for nothing and waits for the service's own night sleep (longer than `--quiet-s`, or the quiet gaps hold one).
"None of these" through the service: with `--hold-out` class `seed` of the set is never sent (a different one each
seed), and with `--far-data` another set's test photos are asked too; at the last measure /predict's `unknown_score`
of the learned classes' test photos against the held-out class's (near) and the far set's gives each AUROC, and its
`unknown` the false-alarm rate and the share caught (`clients.bench.stream.unknowns` measures the same in process);
the ONNX snapshot's scores are compared with /predict's beside its probabilities.

    python -m clients.bench.live.client_stream --data ../shared/datasets/eurosat-rgb.zip --seeds 0-2 \\
        --out results/client-stream/eurosat-default.json
    python -m clients.bench.live.client_stream --data ../shared/datasets/cifar10-jpeg.zip --train-per-class 1000 \\
        --out results/client-stream/cifar10-default.json
    python -m clients.bench.live.client_stream --data ../shared/datasets/eurosat-rgb.zip --train-per-class 150 \\
        --hold-out --far-data ../shared/datasets/mini-imagenet-slice.zip --seeds 0-4 \\
        --out results/client-stream/eurosat-150a-class-unknowns.json
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shlex
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch

from clients.api import ServiceClient
from clients.bench.live.local_service import LocalService, real_jpegs
from clients.bench.machine import machine_description
from clients.bench.results import write_result
from clients.bench.stream.protocol import ANYTIME_POINTS
from clients.bench.stream.sweep import seeds as parse_seeds
from clients.bench.stream.via_service import paced
from clients.onnx_client import OnnxClassifier
from learner.metrics import auroc

CLASSES_A_TASK = 2
LARGE = 10**9  # every photo a class has
PACED_BATCH = 10  # photos a paced device sends at once: the service's batch
FAR_PHOTOS = 300  # the far set's test photos asked


def class_names(data: Path) -> list[str]:
    """Both shared sets' class order is the alphabetical order of their class folders."""
    with zipfile.ZipFile(data) as z:
        return sorted({x.split("/")[-2] for x in z.namelist() if x.endswith(".jpg")})


def predicted(client: ServiceClient, photos: list[bytes], k: int = 1) -> list[dict]:
    """/predict's answer for each photo, 64 a request: its top-k (`top`), `unknown` and `unknown_score`."""
    out = []
    for i in range(0, len(photos), 64):
        answer = client.predict(photos[i:i + 64], k=k)
        n = len(answer["results"])
        out += [{"top": top, "unknown": unknown, "unknown_score": score} for top, unknown, score in
                zip(answer["results"], answer.get("unknown", [False] * n), answer.get("unknown_score", [None] * n))]
    return out


def measured(client: ServiceClient, test: list[tuple[str, bytes]]) -> dict:
    """/predict on (label, photo) pairs, every class's probability: the top-1 accuracy, how far the probabilities
    mean what they say (`clients.bench.stream.protocol.calibration_figures`) and the share called "none of these"."""
    from clients.bench.stream.protocol import calibration_figures

    labels = sorted({label for label, _ in test})
    answers = predicted(client, [p for _, p in test], k=20)  # every class the test has seen (all of them here)
    rows = [[{t["label"]: t["probability"] for t in a["top"]}.get(label, 0.0) for label in labels] for a in answers]
    p, y = torch.tensor(rows), torch.tensor([labels.index(label) for label, _ in test])
    return {"accuracy": round(100 * float((p.argmax(1) == y).float().mean()), 2),
            "calibration": calibration_figures(p, y),
            "unknown_share": round(sum(a["unknown"] for a in answers) / len(test), 4)}


def onnx_parity(client: ServiceClient, url: str, test: list[tuple[str, bytes]], tries: int = 5) -> dict:
    """Export a snapshot and compare it with /predict of the same model version (an idle refit of
    the served corrections may move the version between the two: then export again): the top-1 label, its
    probability and the "none of these" score."""
    for _ in range(tries):
        snapshot = client.create_snapshot()
        answer = client.predict([test[0][1]], k=1)
        if answer["model_version"] == snapshot["model_version"]:
            break
        time.sleep(2)
    else:
        return {"compared": 0, "why": "the model version kept moving"}
    onnx = OnnxClassifier.from_service(url, str(snapshot["id"]))
    served = predicted(client, [p for _, p in test])
    exported = [a for i in range(0, len(test), 64)
                for a in onnx.answer([io.BytesIO(p) for _, p in test[i:i + 64]], k=1)]
    pairs = [(a["top"][0], b["top"][0]) for a, b in zip(served, exported, strict=True)]
    same = sum(a["label"] == b["label"] for a, b in pairs)
    gap = max(abs(a["probability"] - b["probability"]) for a, b in pairs)
    scored = [(a["unknown_score"], b["unknown_score"]) for a, b in zip(served, exported)
              if a["unknown_score"] is not None and b["unknown_score"] is not None]
    return {"compared": len(test), "same_top1": same, "max_probability_gap": round(gap, 6),
            "unknown_scores_compared": len(scored),
            "max_unknown_score_gap": round(max((abs(a - b) for a, b in scored), default=0.0), 6),
            "snapshot_id": snapshot["id"], "model_version": snapshot["model_version"],
            "snapshot_head": onnx.metadata.get("head", "")}


def none_of_these(client: ServiceClient, known: list[bytes], strangers: dict[str, list[bytes]]) -> dict:
    """How /predict's "none of these" tells each set of `strangers` (near: a held-out class; far: another set) from
    the learned classes' `known` photos: the AUROC of its score, the share of each it calls unknown (of the known
    ones: the false-alarm rate), the photos asked."""
    known_answers = predicted(client, known)
    known_scores = [a["unknown_score"] for a in known_answers]
    out = {"false_alarm_rate": round(sum(a["unknown"] for a in known_answers) / len(known), 4), "auroc": {},
           "caught": {}, "photos": {"known": len(known)}}
    for name, photos in strangers.items():
        answers = predicted(client, photos)
        scores = [a["unknown_score"] for a in answers]
        if None not in known_scores and None not in scores:
            out["auroc"][name] = round(auroc(torch.tensor(known_scores), torch.tensor(scores)), 4)
        out["caught"][name] = round(sum(a["unknown"] for a in answers) / len(photos), 4)
        out["photos"][name] = len(photos)
    return out


class Quiet:
    """A device's idle hours: `seconds` of silence after every `every` photos it sends (0: none)."""

    def __init__(self, every: int = 0, seconds: float = 0.0):
        self.every, self.seconds, self.sent = every, seconds, 0

    def chunks(self, photos: list) -> list[list]:
        """The photos cut where the device goes quiet."""
        if not self.every:
            return [photos]
        cut, out = self.every - self.sent % self.every, []
        while photos:
            out.append(photos[:cut])
            photos, cut = photos[cut:], self.every
        return out

    def after(self, n: int) -> None:
        before, self.sent = self.sent, self.sent + n
        if self.every and self.sent // self.every > before // self.every:
            time.sleep(self.seconds)


def send(client: ServiceClient, photos: list[tuple[str, bytes]], rate: float | None,
         quiet: Quiet | None = None) -> None:
    """As fast as they are acknowledged, or `rate` photos a second, a batch of ten at a time (a device that
    sends what it sees as it sees it: the service is idle between its batches); quiet as `quiet` says."""
    quiet = quiet or Quiet()
    for chunk in quiet.chunks(photos):
        if not rate:
            client.stream_samples(chunk)
        else:
            batches = [(None, chunk[i:i + PACED_BATCH]) for i in range(0, len(chunk), PACED_BATCH)]
            for _, batch in paced(batches, rate, time.perf_counter(), 0):
                client.stream_samples(batch)
        quiet.after(len(chunk))


def slept(client: ServiceClient, timeout: float = 3600) -> dict | None:
    """A device idle after its stream: once the service has slept over what is new (ASER_SLEEP; None without)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        status = client.status()
        sleep = status["sleep"]
        if sleep is None:
            return None
        done = sleep["state"] == "awake" and not sleep["owed"]
        if done and sleep["new_samples"] < status["config"]["sleep_min_new"]:
            return sleep
        time.sleep(1.0)
    raise TimeoutError(f"the service did not sleep over what is new within {timeout} s")


def fresh_slept(client: ServiceClient, ask: bool = True, timeout: float = 3600) -> dict:
    """A fresh sleep, asked for (or, `ask` false, the service's night sleep once idle) and waited on: the service's
    sleep once it has ended (ASER_SLEEP)."""
    before = client.status()["sleep"]["sleeps"]
    if ask:
        client.sleep(fresh=True)
    deadline = time.time() + timeout
    while time.time() < deadline:
        sleep = client.status()["sleep"]
        this = sleep["sleeps"] > before if ask else sleep["new_since_fresh"] == 0  # a night's: over all there is
        if this and sleep["state"] == "awake" and not sleep["fresh_asked"] and sleep["last"]["fresh"]:
            return sleep
        time.sleep(1.0)
    raise TimeoutError(f"the fresh sleep did not end within {timeout} s")


def send_task(client: ServiceClient, train: list[tuple[str, bytes]], test: list[tuple[str, bytes]],
              per_class: int, rate: float | None = None, quiet: Quiet | None = None) -> dict:
    """Send one task's photos; measure at each anytime point it reaches and at its end."""
    points, sent, classes = {}, 0, len({label for label, _ in train})
    for point in (*ANYTIME_POINTS, LARGE):
        upto = min(len(train), classes * min(point, per_class))
        if upto <= sent:
            continue
        send(client, train[sent:upto], rate, quiet)
        sent = upto
        status = client.drain()
        found = {**measured(client, test), "serving_head": status["serving_head"],
                 "samples_trained": status["samples_trained"]}
        if point in ANYTIME_POINTS and sent == classes * point:
            points[str(point)] = found
        if sent == len(train):
            points["end"] = found
    return points


@dataclass(frozen=True)
class Strangers:
    """What "none of these" is measured on: a held-out class of the set (class `seed`), another set's test photos."""
    hold_out: bool = False
    far: Path | None = None
    far_photos: int = FAR_PHOTOS

    def held_out(self, names: list[str], seed: int) -> str | None:
        return names[seed % len(names)] if self.hold_out else None

    def photos(self, data: Path, held_out: str | None, per_class: int) -> dict[str, list[bytes]]:
        near = {"near": [p for _, p in real_jpegs(data, per_class, split="test", classes=[held_out])]} \
            if held_out else {}
        return {**near, **({"far": [p for _, p in real_jpegs(self.far, self.far_photos, split="test")]}
                           if self.far else {})}


def run_seed(data: Path, env: dict, seed: int, per_class: int, test_per_class: int, rate: float | None = None,
             quiet: Quiet | None = None, fresh: bool = False, strangers: Strangers = Strangers()) -> dict:
    names = class_names(data)
    held_out = strangers.held_out(names, seed)
    names = [name for name in names if name != held_out]
    tasks = [names[i:i + CLASSES_A_TASK] for i in range(0, len(names), CLASSES_A_TASK)]
    with tempfile.TemporaryDirectory() as tmp:
        service = LocalService(Path(tmp) / "data", {**env, "ASER_SEED": str(seed)}).start()
        try:
            with ServiceClient(service.url, timeout=300) as client:
                started, along, sent = time.monotonic(), [], 0
                for t, classes in enumerate(tasks):
                    seen = [c for task in tasks[:t + 1] for c in task]
                    train = real_jpegs(data, len(classes) * per_class, classes=classes)
                    test = real_jpegs(data, len(seen) * test_per_class, split="test", classes=seen)
                    along.append(send_task(client, train, test, per_class, rate, quiet))
                    sent += len(train)
                    print(f"seed {seed} task {t + 1} {classes}: "
                          + ", ".join(f"@{k} {v['accuracy']}" for k, v in along[-1].items()), flush=True)
                seconds = time.monotonic() - started
                status = client.drain()
                after_idle = None
                if (sleep := slept(client)) is not None:  # the device idle: the service sleeps over what is new
                    status = client.drain()
                    after_idle = {**measured(client, test), "sleep": sleep}
                after_fresh = None
                if fresh and after_idle is not None:  # and its user asks for the top trained again from ImageNet's
                    sleep = fresh_slept(client, ask=not float(env.get("ASER_SLEEP_FRESH_IDLE_S", 0)))
                    status = client.drain()
                    after_fresh = {**measured(client, test), "sleep": sleep}
                unknowns = none_of_these(client, [p for _, p in test], asked) \
                    if (asked := strangers.photos(data, held_out, test_per_class)) else None
                parity = onnx_parity(client, service.url, test)
        finally:
            service.stop()
    anytime = {str(n): [task[str(n)]["accuracy"] for task in along if str(n) in task] for n in ANYTIME_POINTS}
    ten_in = [task["10"]["calibration"] for task in along if "10" in task]
    return {"seed": seed, "final_accuracy": (after_idle or along[-1]["end"])["accuracy"],
            "calibration": {"end": (after_idle or along[-1]["end"])["calibration"],
                            "10": {k: round(sum(c[k] for c in ten_in) / len(ten_in), 4) for k in ten_in[0]}
                            if ten_in else None},
            "calibration_config": status.get("calibration"),
            **({"after_idle": after_idle} if after_idle else {}),
            **({"after_fresh": after_fresh} if after_fresh else {}),
            **({"held_out_class": held_out} if held_out else {}),
            **({"none_of_these": unknowns} if unknowns else {}),
            "anytime": {n: round(sum(v) / len(v), 2) for n, v in anytime.items() if v},
            "tasks": along, "serving_head": status["serving_head"], "head_choice": status["head_choice"],
            "samples_sent": sent,
            "samples_trained": status["samples_trained"], "samples_skipped": status["lag"]["samples_skipped"],
            "steps": status["steps"], "rehearsal_steps": status["lag"]["rehearsal_steps"],
            "stream_seconds": round(seconds, 1), "onnx_parity": parity, "config": status["config"]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default="../shared/datasets/eurosat-rgb.zip", help="CIFAR-10's or EuroSAT's zip")
    parser.add_argument("--train-per-class", type=int, default=LARGE, help="training photos a class (default: all)")
    parser.add_argument("--test-per-class", type=int, default=200, help="held-out photos a class in each measurement")
    parser.add_argument("--seeds", default="0", help="ASER_SEED of each run: 0 or 0-4")
    parser.add_argument("--env", action="append", default=[], metavar="ASER_X=V", help="a setting of the service")
    parser.add_argument("--rate", type=float, metavar="R",
                        help="photos a second the device sends, ten at a time (default: as fast as acknowledged)")
    parser.add_argument("--quiet-every", type=int, default=0, metavar="N",
                        help="the device goes quiet after every N photos (its idle hours)")
    parser.add_argument("--quiet-s", type=float, default=0.0, metavar="S", help="for S seconds")
    parser.add_argument("--fresh-sleep", action="store_true",
                        help="with ASER_SLEEP: after the idle sleep, a fresh one asked for (or with "
                        "ASER_SLEEP_FRESH_IDLE_S, the night's, waited for), and a measure after it")
    parser.add_argument("--hold-out", action="store_true",
                        help="never send class `seed` of the set; ask its test photos as unknowns (near) at the end")
    parser.add_argument("--far-data", help="another set's zip: its test photos asked as unknowns (far) at the end")
    parser.add_argument("--far-photos", type=int, default=FAR_PHOTOS, help="the far set's photos asked")
    parser.add_argument("--out", help="write the result here (JSON)")
    args = parser.parse_args(argv)
    env = dict(item.split("=", 1) for item in args.env)
    strangers = Strangers(args.hold_out, Path(args.far_data) if args.far_data else None, args.far_photos)
    runs = [run_seed(Path(args.data), env, seed, args.train_per_class, args.test_per_class, args.rate,
                     Quiet(args.quiet_every, args.quiet_s), args.fresh_sleep, strangers)
            for seed in parse_seeds(args.seeds)]
    mean = {"final_accuracy": round(sum(r["final_accuracy"] for r in runs) / len(runs), 2),
            "anytime": {n: round(sum(r["anytime"][n] for r in runs) / len(runs), 2) for n in runs[0]["anytime"]},
            **({"after_fresh": round(sum(r["after_fresh"]["accuracy"] for r in runs) / len(runs), 2)}
               if all("after_fresh" in r for r in runs) else {})}
    result = {"data": Path(args.data).name, "train_per_class": args.train_per_class if args.train_per_class < LARGE
              else "all", "test_per_class": args.test_per_class, **({"rate": args.rate} if args.rate else {}),
              **({"quiet_every": args.quiet_every, "quiet_s": args.quiet_s} if args.quiet_every else {}),
              "env": env, "mean": mean, "runs": runs,
              "machine": f"{machine_description(torch.device('cpu')).split(',')[0]}, {os.cpu_count()} cores",
              "command": "python -m clients.bench.live.client_stream "
              + shlex.join(sys.argv[1:] if argv is None else argv),
              "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    print(json.dumps(mean))
    if args.out:
        write_result(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
