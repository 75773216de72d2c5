"""Torture test of the learner service: ordinary concurrent use, plus SIGKILLs.

A fresh service runs on a loopback port with checkpoints after every step and snapshots every
two steps. Meanwhile, at a paced total rate:
- three clients ingest real CIFAR-10 JPEGs, one per form (POST /samples, an NDJSON stream,
  a WebSocket), every sample with its own id, retrying on their own through the outages;
- a monitor polls /status, /metrics and /readyz every 0.1 s;
- a reader lists snapshots and downloads the latest; a predictor asks for predictions;
- once the first snapshot is out, the service is SIGKILLed every `--kill-every` seconds
  (randomised) and started again.

Then it checks, through the API alone:
- nothing acknowledged was lost and nothing was stored twice: every sample sent is sent again
  with its id, and each acknowledged one must come back as a duplicate with its original
  sequence number; the log holds exactly one sample per distinct id, numbered 1..N;
- nothing was trained twice (or skipped): samples trained == samples received, trained_upto == N;
- the worker never died: no answer of any endpoint was a 5xx, every status showed the worker
  alive with no restart and no error;
- a graceful restart at the end resumes the same lineage.

    python -m clients.bench.live.torture --data ../shared/datasets/cifar10-jpeg.zip --seconds 300 \
        --kill-every 8 --out results/reliability/torture-cpu.json
"""

from __future__ import annotations

import argparse
import base64
import itertools
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

from clients.api import Retry, ServiceClient, ServiceError, new_id
from clients.bench.live.local_service import LocalService, real_jpegs
from clients.bench.results import write_result

SERVICE_ENV = {"ASER_CHECKPOINT_EVERY_STEPS": "1", "ASER_SNAPSHOT_EVERY_STEPS": "2", "ASER_MEM_SIZE": "100",
               "ASER_MAX_BATCH_WAIT_S": "0.2"}
PATIENT = Retry(attempts=60, backoff=0.1, max_pause=1.0)  # rides out a restart of several seconds


class Ledger:
    """Every sample sent, and what the service acknowledged for it (thread-safe)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.sent: dict[str, tuple[str, bytes]] = {}
        self.acked: dict[str, int] = {}
        self.per_form: Counter[str] = Counter()
        self.duplicate_acks = 0  # acks of samples already stored: a retry after a lost answer

    def send(self, batch: list[tuple[str, bytes]]) -> list[str]:
        ids = [new_id() for _ in batch]
        with self.lock:
            self.sent.update(zip(ids, batch))
        return ids

    def ack(self, ids: list[str], seqs: list[int], duplicates: int, form: str, problems: list[str]) -> None:
        with self.lock:
            for i, seq in zip(ids, seqs, strict=True):
                if self.acked.setdefault(i, seq) != seq:
                    problems.append(f"sample {i} acknowledged as {seq} after {self.acked[i]}")
            self.per_form[form] += len(ids)
            self.duplicate_acks += duplicates


class Torture:
    def __init__(self, service: LocalService, images: list[tuple[str, bytes]], seconds: float, kill_every: float,
                 rate: float, seed: int = 0):
        self.service, self.images, self.seconds, self.kill_every = service, images, seconds, kill_every
        self.pace = 3 * 5 / rate  # three ingest clients, batches of 5: seconds between one client's batches
        self.rng = random.Random(seed)
        self.ledger = Ledger()
        self.stop = threading.Event()
        self.problems: list[str] = []
        self.polls: Counter[str] = Counter()
        self.server_errors: Counter[str] = Counter()
        self.unreachable: Counter[str] = Counter()
        self.kills: list[float] = []
        self.restart_seconds: list[float] = []
        self.snapshot_ids: set[int] = set()
        self._next = itertools.count()

    def batches(self, size: int = 5):
        """Endless batches of real images, in order, cycling."""
        while not self.stop.is_set():
            yield [self.images[next(self._next) % len(self.images)] for _ in range(size)]

    # --- the clients --------------------------------------------------------------------
    def ingest_rest(self) -> None:
        with ServiceClient(self.service.url, retry=PATIENT) as client:
            for batch in self.batches():
                ids = self.ledger.send(batch)
                self._acked(lambda: client.add_samples([b[0] for b in batch], [b[1] for b in batch], ids), ids, "rest")
                self.stop.wait(self.pace)

    def ingest_ndjson(self) -> None:
        with ServiceClient(self.service.url, retry=PATIENT) as client:
            for batch in self.batches():
                ids = self.ledger.send(batch)
                acks = self._call(lambda: client.stream_samples([(*b, i) for b, i in zip(batch, ids)]), "ndjson")
                if acks is not None:
                    bad = [a for a in acks if "error" in a]
                    if bad:
                        self.problems.append(f"ndjson refused {bad[0]}")
                    else:
                        self.ledger.ack(ids, [a["seqs"][0] for a in acks], sum(a["duplicates"] for a in acks),
                                        "ndjson", self.problems)
                self.stop.wait(self.pace)

    def ingest_websocket(self) -> None:
        with ServiceClient(self.service.url, retry=PATIENT) as client:
            socket = None
            while socket is None and not self.stop.is_set():
                socket = self._call(client.websocket, "websocket")
            if socket is None:
                return
            with socket:
                def messages():
                    for batch in self.batches():
                        ids = self.ledger.send(batch)
                        pending.append(ids)
                        yield [b[0] for b in batch], [b[1] for b in batch], ids
                        self.stop.wait(self.pace)

                pending: list[list[str]] = []
                try:
                    for ack in socket.pipeline(messages(), window=4):
                        ids = pending.pop(0)
                        if "error" in ack:
                            self.problems.append(f"websocket refused {ack}")
                        else:
                            self.ledger.ack(ids, ack["seqs"], ack["duplicates"], "websocket", self.problems)
                except Exception as exc:  # retries exhausted: the samples stay unacknowledged, checked at the end
                    self.problems.append(f"websocket gave up: {type(exc).__name__}: {exc}")

    def _acked(self, send, ids: list[str], form: str) -> None:
        ack = self._call(send, form)
        if ack is not None:
            self.ledger.ack(ids, ack["seqs"], ack["duplicates"], form, self.problems)

    def _call(self, fn, what: str):
        try:
            return fn()
        except ServiceError as exc:
            if exc.status >= 500:
                self.server_errors[what] += 1
            self.problems.append(f"{what}: {exc}")
        except (httpx.HTTPError, OSError) as exc:
            self.unreachable[what] += 1
            if not self.stop.is_set():
                self.problems.append(f"{what} gave up retrying: {type(exc).__name__}")
        return None

    def monitor(self) -> None:
        """/status, /metrics and /readyz, ten times a second."""
        with httpx.Client(base_url=self.service.url, timeout=10) as http:
            while not self.stop.wait(0.1):
                for path in ("/status", "/metrics", "/readyz"):
                    r = self._poll(http, "GET", path)
                    if r is not None and path == "/status":
                        worker = r.json()["worker"]
                        if not worker["alive"] or worker["restarts"] or worker["last_error"] or r.json()["error"]:
                            self.problems.append(f"worker unhealthy: {worker}")

    def reader(self) -> None:
        """Snapshots and predictions, as replicas and users read them."""
        probe = base64.b64encode(self.images[0][1]).decode()
        with httpx.Client(base_url=self.service.url, timeout=30) as http:
            while not self.stop.wait(0.3):
                for method, path, kwargs in (("GET", "/snapshots", {}), ("GET", "/snapshots/latest", {}),
                                             ("POST", "/predict", {"json": {"images": [probe], "k": 2}})):
                    r = self._poll(http, method, path, **kwargs)
                    if r is None:
                        continue
                    if path == "/snapshots":
                        self.snapshot_ids.update(s["id"] for s in r.json()["snapshots"])
                    elif path == "/snapshots/latest" and r.status_code == 200 and not r.content.startswith(b"\x08"):
                        self.problems.append("a downloaded snapshot is not an ONNX file")

    def _poll(self, http: httpx.Client, method: str, path: str, **kwargs) -> httpx.Response | None:
        """One request of the monitor or the reader, counted; the answer unless it failed or was a 5xx."""
        try:
            r = http.request(method, path, **kwargs)
        except httpx.HTTPError:
            self.unreachable[path] += 1
            return None
        self.polls[path] += 1
        if r.status_code >= 500:
            self.server_errors[path] += 1
            self.problems.append(f"{method} {path} answered {r.status_code}: {r.text[:200]}")
            return None
        return r

    def killer(self) -> None:
        deadline = time.time() + self.seconds
        while True:
            pause = self.kill_every * self.rng.uniform(0.5, 1.5)
            if time.time() + pause >= deadline:
                break
            time.sleep(pause)
            self.service.kill()
            self.kills.append(time.time())
            t0 = time.perf_counter()
            self.service.start()
            self.restart_seconds.append(time.perf_counter() - t0)
        time.sleep(max(0.0, deadline - time.time()))

    def await_first_snapshot(self, timeout: float = 180) -> float | None:
        """Kills start once a snapshot exists, so that its listing and download are exercised
        through them however slow this machine exports; seconds waited, None if none came."""
        started = time.perf_counter()
        while not self.snapshot_ids:
            if time.perf_counter() - started > timeout:
                self.problems.append(f"no snapshot was published within {timeout:.0f}s")
                return None
            time.sleep(0.2)
        return round(time.perf_counter() - started, 1)

    # --- the run and the checks ---------------------------------------------------------
    def run(self) -> dict:
        clients = [threading.Thread(target=f, daemon=True) for f in
                   (self.ingest_rest, self.ingest_ndjson, self.ingest_websocket, self.monitor, self.reader)]
        for t in clients:
            t.start()
        self.first_snapshot_s = self.await_first_snapshot()
        self.killer()
        self.stop.set()
        for t in clients:
            t.join(120)
        return self.verify()

    def verify(self) -> dict:
        client = ServiceClient(self.service.url, retry=PATIENT)
        # everything sent, again, with its id: the acknowledged ones must come back unchanged
        sent = list(self.ledger.sent.items())
        resent_dups = 0
        for i in range(0, len(sent), 200):
            chunk = sent[i:i + 200]
            ack = client.add_samples([s[1][0] for s in chunk], [s[1][1] for s in chunk], [s[0] for s in chunk])
            resent_dups += ack["duplicates"]
            for (sid, _), seq in zip(chunk, ack["seqs"]):
                if sid in self.ledger.acked and self.ledger.acked[sid] != seq:
                    self.problems.append(f"acknowledged sample {sid} was {self.ledger.acked[sid]}, now {seq}")
                self.ledger.acked.setdefault(sid, seq)
        final = client.drain()
        n = len(self.ledger.sent)
        if sorted(self.ledger.acked.values()) != list(range(1, n + 1)):
            self.problems.append("the sequence numbers of the distinct ids are not exactly 1..N")
        for key, want in (("samples_received", n), ("samples_trained", n), ("trained_upto", n), ("backlog", 0)):
            if final[key] != want:
                self.problems.append(f"after the run {key} = {final[key]}, expected {want}")
        self.service.stop()  # graceful: the worker checkpoints
        self.service.start()
        again = client.status()
        for key in ("samples_trained", "trained_upto", "steps", "buffer"):
            if again[key] != final[key]:
                self.problems.append(f"after a graceful restart {key} = {again[key]}, was {final[key]}")
        client.close()
        return {
            "seconds": self.seconds, "kills": len(self.kills),
            "restart_seconds_median": round(statistics.median(self.restart_seconds), 2) if self.restart_seconds else None,
            "restart_seconds_max": round(max(self.restart_seconds), 2) if self.restart_seconds else None,
            "samples_sent": n, "acknowledged_before_the_check": dict(self.ledger.per_form),
            "duplicate_acks_during_run": self.ledger.duplicate_acks, "duplicates_on_resend": resent_dups,
            "samples_received": final["samples_received"], "samples_trained": final["samples_trained"],
            "quarantined": final["worker"]["quarantined"], "steps": final["steps"],
            "first_snapshot_s": self.first_snapshot_s, "snapshots_seen": len(self.snapshot_ids),
            "polls": dict(self.polls),
            "server_errors": dict(self.server_errors), "unreachable_during_kills": dict(self.unreachable),
            "problems": self.problems[:50], "problem_count": len(self.problems), "passed": not self.problems,
        }


def run(data: Path, seconds: float, kill_every: float, rate: float, data_dir: Path | None = None,
        env: dict | None = None, log_path: Path | None = None, seed: int = 0) -> dict:
    images = real_jpegs(data, 500)
    with tempfile.TemporaryDirectory() as tmp:
        service = LocalService(data_dir or Path(tmp) / "svc", {**SERVICE_ENV, **(env or {})}, log_path=log_path)
        service.start()
        try:
            result = Torture(service, images, seconds, kill_every, rate, seed).run()
        finally:
            service.stop()
    return {**result, "service_env": {**SERVICE_ENV, **(env or {})}, "rate_samples_per_s": rate}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="../shared/datasets/cifar10-jpeg.zip", help="a CIFAR-10 JPEG zip")
    p.add_argument("--seconds", type=float, default=300)
    p.add_argument("--kill-every", type=float, default=8, help="mean seconds between SIGKILLs")
    p.add_argument("--rate", type=float, default=30, help="samples per second over the three ingest forms")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log", help="append the service's log here")
    p.add_argument("--out", default=".cache/bench/torture-cpu.json", help="the result file (results/ only when named)")
    args = p.parse_args(argv)
    result = run(Path(args.data), args.seconds, args.kill_every, args.rate, log_path=args.log, seed=args.seed)
    from clients.bench.machine import machine_description, resolve_device

    result.update(machine=machine_description(resolve_device("cpu")),
                  command="python -m clients.bench.live.torture "
                  + " ".join(argv if argv is not None else sys.argv[1:]),
                  measured=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    write_result(args.out, result)
    print(json.dumps({k: result[k] for k in ("kills", "samples_sent", "samples_trained", "problem_count", "passed")}))
    print(f"wrote {args.out}")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
