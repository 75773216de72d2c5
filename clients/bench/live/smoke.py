"""Smoke test of a deployed learner and its inference replicas, through their APIs alone
(docker-compose, Kubernetes, or anything else that serves them).

    python -m clients.bench.live.smoke --learner URL --replica URL --replica URL --ledger FILE stream
    ... kill the learner, start it again ...
    python -m clients.bench.live.smoke --learner URL --replica URL --replica URL --ledger FILE verify

The learner is called with ASER_ADMIN_TOKEN, the replicas with ASER_READ_TOKEN (the variables
the service reads). It expects a learner with an empty log.

`stream` sends real CIFAR-10 JPEGs of two classes to the learner as NDJSON, every sample with
its own id, and keeps what was acknowledged in the ledger; once all is trained it asks for a
snapshot and checks that every replica serves it and labels held-out images as the learner does.

`verify`, after the learner was killed: every sample of the ledger sent again with its id comes
back as a duplicate with its original sequence number; the learner holds exactly those samples
and has trained on each once; then it learns two more classes and the replicas follow again.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from clients.api import Retry, ServiceClient, ServiceError, new_id
from clients.bench.live.local_service import real_jpegs

FIRST_CLASSES, LATER_CLASSES = ["airplane", "automobile"], ["bird", "cat"]
PATIENT = Retry(attempts=40, backoff=0.25, max_pause=2.0)  # rides out a restart of the learner


class SmokeFailure(AssertionError):
    pass


class LearnerMovedOn(SmokeFailure):
    """The learner published a newer model between a snapshot and the check of it."""


def check(ok: bool, message: str) -> None:
    if not ok:
        raise SmokeFailure(message)


def wait_for(what: str, probe, timeout: float, pause: float = 0.5):
    """Call `probe` until it returns something truthy; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not (value := probe()):
        if time.monotonic() > deadline:
            raise SmokeFailure(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(pause)
    return value


class Deployment:
    def __init__(self, learner: str, replicas: list[str], admin_token: str | None, read_token: str | None):
        self.learner = ServiceClient(learner, admin_token, timeout=120, retry=PATIENT)
        self.replicas = [ServiceClient(url, read_token, retry=PATIENT) for url in replicas]

    def ingest(self, samples: list[tuple[str, bytes, str]]) -> dict[str, int]:
        """NDJSON ingest; the sequence number the learner acknowledged for each id."""
        acks = self.learner.stream_samples(samples, chunk=100)
        refused = [a for a in acks if "error" in a]
        check(not refused, f"the learner refused samples: {refused[:3]}")
        return {s[2]: a["seqs"][0] for s, a in zip(samples, acks, strict=True)}

    def drain(self, timeout: float = 600) -> dict:
        """The learner's status once it has trained on everything it received."""
        status = self.learner.drain(timeout)
        check(status["backlog"] == 0, f"the learner still had {status['backlog']} samples to train after {timeout}s")
        return status

    def publish(self, timeout: float = 180) -> dict:
        """A snapshot of the current model, once every replica serves it."""
        snapshot = self.learner.create_snapshot()
        for replica in self.replicas:
            wait_for(f"{replica.base_url} to serve snapshot {snapshot['id']}",
                     lambda r=replica: r.status()["snapshot_id"] == snapshot["id"], timeout)
        return snapshot

    def publish_and_agree(self, probes: list[bytes], tries: int = 3) -> tuple[dict, list[str]]:
        """`publish`, then `agree`; again where the learner moved on in between (an idle learner sleeps, and a sleep
        that changed the model publishes a snapshot of its own), at most `tries` times."""
        for attempt in range(tries):
            snapshot = self.publish()
            try:
                return snapshot, self.agree(snapshot, probes)
            except LearnerMovedOn:
                if attempt == tries - 1:
                    raise

    def agree(self, snapshot: dict, probes: list[bytes]) -> list[str]:
        """Every replica labels the probes from `snapshot` exactly as the learner does."""
        learner = self.learner.predict(probes, k=1)
        if learner["model_version"] != snapshot["model_version"]:
            raise LearnerMovedOn(f"the learner answers version {learner['model_version']}, the snapshot is "
                                 f"{snapshot['model_version']}")
        labels = [r[0]["label"] for r in learner["results"]]
        for replica in self.replicas:
            answer = replica.predict(probes, k=1)
            if answer["snapshot_id"] != snapshot["id"]:
                raise LearnerMovedOn(f"{replica.base_url} answered from {answer['snapshot_id']}, not {snapshot['id']}")
            theirs = [r[0]["label"] for r in answer["results"]]
            differ = sum(a != b for a, b in zip(labels, theirs, strict=True))
            check(differ == 0, f"{replica.base_url} labels {differ} of {len(probes)} images unlike the learner")
        return labels


def stream(deployment: Deployment, data: Path, ledger_path: Path, per_class: int) -> dict:
    images = real_jpegs(data, per_class * len(FIRST_CLASSES), classes=FIRST_CLASSES)
    samples = [(label, image, new_id()) for label, image in images]
    started = time.perf_counter()
    seqs = deployment.ingest(samples)
    check(sorted(seqs.values()) == list(range(1, len(samples) + 1)), "the learner's log was not empty")
    # the learner exports on its own as soon as it knows new classes: replicas get ready unasked
    for replica in deployment.replicas:
        wait_for(f"{replica.base_url} to load a snapshot of its own accord", replica.ready, 180)
    ready_s = time.perf_counter() - started
    status = deployment.drain()
    probes = [image for _, image in real_jpegs(data, 40, split="test", classes=FIRST_CLASSES)]
    snapshot, labels = deployment.publish_and_agree(probes)
    check(set(labels) <= set(FIRST_CLASSES), f"labels outside the classes sent: {set(labels)}")
    found = {"acknowledged": len(seqs), "trained": status["samples_trained"], "snapshot": snapshot["id"],
             "probes": len(probes), "replicas_ready_after_s": round(ready_s, 1)}
    ledger_path.write_text(json.dumps({"per_class": per_class, "ids": [s[2] for s in samples], "seqs": seqs,
                                       "stream": found}))
    return found


def verify(deployment: Deployment, data: Path, ledger_path: Path) -> dict:
    ledger = json.loads(ledger_path.read_text())
    images = real_jpegs(data, ledger["per_class"] * len(FIRST_CLASSES), classes=FIRST_CLASSES)
    wait_for("the learner to be ready again", deployment.learner.ready, 180)
    again = deployment.learner.add_samples([label for label, _ in images], [image for _, image in images],
                                           ledger["ids"])
    check(again["duplicates"] == len(images), f"{len(images) - again['duplicates']} acknowledged samples were lost")
    moved = [i for i, seq in zip(ledger["ids"], again["seqs"]) if ledger["seqs"][i] != seq]
    check(not moved, f"{len(moved)} samples came back with other sequence numbers")
    n = len(images)
    status = deployment.drain()
    for key in ("samples_received", "samples_trained", "trained_upto"):
        check(status[key] == n, f"after the restart {key} = {status[key]}, expected {n}")
    # the restarted learner goes on learning, and the replicas follow it
    later = real_jpegs(data, ledger["per_class"] * len(LATER_CLASSES), classes=LATER_CLASSES)
    deployment.ingest([(label, image, new_id()) for label, image in later])
    status = deployment.drain()
    classes = FIRST_CLASSES + LATER_CLASSES
    snapshot, _ = deployment.publish_and_agree([image for _, image in real_jpegs(data, 40, split="test",
                                                                                 classes=classes)])
    check(set(snapshot["classes"]) == set(classes), f"snapshot classes {snapshot['classes']}")
    return {"stream": ledger["stream"], "resent_duplicates": again["duplicates"],
            "samples_trained": status["samples_trained"], "snapshot": snapshot["id"], "classes": snapshot["classes"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("phase", choices=["stream", "verify"])
    p.add_argument("--learner", required=True, help="the learner's base URL")
    p.add_argument("--replica", action="append", default=[], help="a replica's base URL (repeat)")
    p.add_argument("--data", default="../shared/datasets/cifar10-jpeg.zip", help="a CIFAR-10 JPEG zip")
    p.add_argument("--ledger", required=True, help="what stream acknowledged, for verify")
    p.add_argument("--per-class", type=int, default=100, help="images sent per class")
    p.add_argument("--out", help="write the phase's findings here as JSON (with --note key=value pairs)")
    p.add_argument("--note", action="append", default=[], help="key=value to record with the findings")
    args = p.parse_args(argv)
    deployment = Deployment(args.learner, args.replica, os.environ.get("ASER_ADMIN_TOKEN"),
                            os.environ.get("ASER_READ_TOKEN"))
    started = time.perf_counter()
    try:
        if args.phase == "stream":
            found = stream(deployment, Path(args.data), Path(args.ledger), args.per_class)
        else:
            found = verify(deployment, Path(args.data), Path(args.ledger))
    except (SmokeFailure, ServiceError) as exc:
        print(f"smoke {args.phase} FAILED: {exc}", file=sys.stderr)
        return 1
    found = {"phase": args.phase, **found, "seconds": round(time.perf_counter() - started, 1),
             **dict(n.split("=", 1) for n in args.note)}
    print(json.dumps(found))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(found, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
