"""The lag bound while classes are forgotten: a fresh service on its defaults (sleep on) fed real CIFAR-10 JPEGs at a
paced rate, with ASER_MAX_LAG_S set; after a warm-up, `DELETE /classes/...` of two classes some seconds apart and a
SIGKILL between them (the service started again at once, the stream riding it out with its retries). A monitor polls
/status every 0.2 s and records the lag after the warm-up; the result has the worst lag against the bound plus 3 s,
each forgetting's answer time, and what the log holds at the end (every acknowledged sample once, no forgotten label).

    python -m clients.bench.live.forget_lag --data ../shared/datasets/cifar10-jpeg.zip --rate 80 --max-lag 6 \\
        --out results/reliability/forget-lag-default.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from clients.api import Retry, ServiceClient, new_id
from clients.bench.live.local_service import LocalService, real_jpegs
from clients.bench.results import write_result

PATIENT = Retry(attempts=120, backoff=0.1, max_pause=1.0)  # rides out a restart


class Monitor(threading.Thread):
    """Polls /status; keeps (time, lag seconds) after `since`."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url, self.points, self.halt = url, [], threading.Event()

    def run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=5) as http:
            while not self.halt.wait(0.2):
                with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
                    self.points.append((time.time(), http.get("/status").json()["lag"]["seconds"]))


def stream(url: str, samples: list[tuple[str, bytes]], rate: float, acked: dict, gone: set) -> None:
    """Send `samples` in batches of 10 at `rate` a second, each with an id, retrying through outages; those of a
    label in `gone` (forgotten: sent again, it would come back as a new class) are left out."""
    with ServiceClient(url, retry=PATIENT) as client:
        start = time.time()
        for i in range(0, len(samples), 10):
            chunk = [s for s in samples[i:i + 10] if s[0] not in gone]
            if not chunk:
                continue
            ids = [new_id() for _ in chunk]
            answer = client.add_samples([lab for lab, _ in chunk], [img for _, img in chunk], ids)
            acked.update(zip(ids, answer["seqs"]))
            pause = start + (i + 10) / rate - time.time()
            if pause > 0:
                time.sleep(pause)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True)
    p.add_argument("--rate", type=float, default=80.0)
    p.add_argument("--max-lag", type=float, default=6.0)
    p.add_argument("--warm-up", type=float, default=30.0, help="seconds before the lag counts and forgetting starts")
    p.add_argument("--seconds", type=float, default=90.0, help="the stream's length")
    p.add_argument("--forget", default="cat,dog", help="the two classes forgotten, comma-separated")
    p.add_argument("--no-kill", action="store_true")
    p.add_argument("--env", action="append", default=[], help="KEY=VALUE for the service (repeatable)")
    p.add_argument("--log", help="keep the service's log here")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    samples = real_jpegs(Path(args.data), int(args.rate * args.seconds))
    env = {"ASER_MAX_LAG_S": str(args.max_lag), **dict(e.split("=", 1) for e in args.env)}
    first, second = args.forget.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        service = LocalService(Path(tmp) / "data", env, log_path=args.log).start()
        monitor, acked, gone = Monitor(service.url), {}, set()
        sender = threading.Thread(target=stream, args=(service.url, samples, args.rate, acked, gone), daemon=True)
        t0 = time.time()
        monitor.start()
        sender.start()
        time.sleep(args.warm_up)
        forgets = []
        with ServiceClient(service.url, retry=PATIENT, timeout=300) as client:
            started = time.time()
            gone.add(first)
            client.forget_class(first)
            forgets.append({"label": first, "at_s": round(started - t0, 1), "answer_s": round(time.time() - started, 2)})
            time.sleep(5)
            killed_at = None
            if not args.no_kill:
                killed_at = time.time() - t0
                service.kill()
                service.start()
            time.sleep(5)
            started = time.time()
            gone.add(second)
            client.forget_class(second)
            forgets.append({"label": second, "at_s": round(started - t0, 1), "answer_s": round(time.time() - started, 2)})
            sender.join()
            final = client.drain(timeout=600)
            classes = final["classes"]
        monitor.halt.set()
        monitor.join()
        service.stop()
    after = [lag for at, lag in monitor.points if at - t0 >= args.warm_up]
    worst = max(after, default=0.0)
    result = {"rate": args.rate, "max_lag_s": args.max_lag, "bound_plus_3": args.max_lag + 3, "worst_lag_s": worst,
              "within": worst <= args.max_lag + 3, "forgets": forgets,
              "killed_at_s": None if killed_at is None else round(killed_at, 1),
              "lag_over_time": [(round(at - t0, 1), lag) for at, lag in monitor.points],
              "acknowledged": len(acked), "samples_received": final["samples_received"],
              "samples_trained": final["samples_trained"], "skipped": final["lag"]["samples_skipped"],
              "forgotten_absent": first not in classes and second not in classes, "env": env,
              "command": "python -m clients.bench.live.forget_lag " + " ".join(sys.argv[1:] if argv is None else argv),
              "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    write_result(args.out, result)
    print(json.dumps({k: result[k] for k in ("worst_lag_s", "within", "forgets", "acknowledged", "samples_received",
                                            "forgotten_absent")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
