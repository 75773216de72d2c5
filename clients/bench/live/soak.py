"""Soak run: weeks of a device's stream compressed into minutes, against a real service on
loopback with retention set small, to show that the disk and the memory stay flat once
retention starts, that nothing acknowledged is lost, and that no request gets a 5xx.

It starts a fresh service (ER by default, so the learner keeps up; `--env` for others) with a
temporary data directory, checkpoints every 10 steps and retention every 2 s that drops trained
pixels at once and sample ids after 60 s (the defaults: a day and 30 days), then sends real CIFAR-10 JPEGs with unique sample ids at `--rate` samples/s for
`--minutes`, retrying each request until it is acknowledged (a 507 or a lost answer is
retried with the same ids, so it is stored once). Every `--every` seconds it records the
database's size on disk, the service's resident memory, received / trained / backlog and the
retention totals (and the proportional set size of the service with its snapshot exporter: what
they take together). At the end it stops the service and checks, in the database file itself, that
every acknowledged id within the id horizon is there exactly once, under the sequence number it was
acknowledged with, and that the log's rows are exactly the sequence numbers acknowledged.

    python -m clients.bench.live.soak --data ../shared/datasets/cifar10-jpeg.zip --minutes 10 \
        --out results/reliability/soak-cpu.json

A sustained overload is the same run faster than the learner, with a lag bound: the series then
shows the lag held near the bound and the shares trained and skipped.

    python -m clients.bench.live.soak --data ../shared/datasets/cifar10-jpeg.zip --minutes 6 --rate 60 \
        --env ASER_METHOD=sv-upd --env ASER_MAX_LAG_S=30 --out results/load/overload-cpu.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sqlite3
import sys
import tempfile
import time
from pathlib import Path

import httpx

from clients.api import Retry, ServiceClient, ServiceError
from clients.bench.live.local_service import LocalService, real_jpegs
from clients.bench.results import write_result

# ER-ACE as the committed soak results ran it (the options that now default on under er, pinned off)
SOAK_ENV = {"ASER_METHOD": "er", "ASER_LOSS": "ace", "ASER_AUGMENT": "false", "ASER_ITERATIONS": "1",
            "ASER_EMA": "0", "ASER_CHECKPOINT_EVERY_STEPS": "10", "ASER_SNAPSHOT_EVERY_STEPS": "0",
            "ASER_RETAIN_PIXELS_S": "0", "ASER_RETAIN_EVERY_S": "2", "ASER_RETAIN_IDS_S": "60",
            "ASER_HISTORY_EVERY_STEPS": "50"}


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def pss_bytes(pid: int) -> int:
    """A process's proportional set size: its private pages and its share of the pages it shares
    (torch's libraries, mapped by the service and its exporter alike), so processes add up."""
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) * 1024
    return 0


def tree_pss_bytes(pid: int) -> int:
    """The memory a process and its children (the service's snapshot exporter) take together."""
    children = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            children += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    total = pss_bytes(pid)
    for child in children:
        try:
            total += tree_pss_bytes(child)
        except OSError:  # it ended meanwhile
            pass
    return total


def send_until_acknowledged(client: ServiceClient, batch: list[tuple[str, bytes, str]], answers: dict) -> list[int]:
    """POST one batch with its ids until it is acknowledged; counts every status seen."""
    while True:
        try:
            ack = client.add_samples([c for c, _, _ in batch], [b for _, b, _ in batch], ids=[i for _, _, i in batch])
            answers["201"] = answers.get("201", 0) + 1
            return ack["seqs"]
        except ServiceError as exc:
            answers[str(exc.status)] = answers.get(str(exc.status), 0) + 1
            time.sleep(1 if exc.status != 507 else 5)
        except httpx.TransportError:
            answers["transport_error"] = answers.get("transport_error", 0) + 1
            time.sleep(1)


def verify(db_path: Path, acknowledged: dict[str, int], recent: set[str]) -> dict:
    """Every acknowledged id in `recent` (acknowledged within the id horizon) once, under the
    sequence number it was acknowledged with; no row that was not acknowledged."""
    with contextlib.closing(sqlite3.connect(db_path)) as conn:
        rows = dict(conn.execute("SELECT sample_id, seq FROM samples WHERE sample_id IS NOT NULL"))
        last = conn.execute("SELECT seq FROM sqlite_sequence WHERE name = 'samples'").fetchone()[0]
    recent = {i: acknowledged[i] for i in recent}
    missing = [i for i in recent if i not in rows]
    moved = [i for i, seq in recent.items() if i in rows and rows[i] != seq]
    stray = [i for i in rows if i not in acknowledged]
    return {"acknowledged": len(acknowledged), "last_seq": last, "checked": len(recent), "in_log": len(rows),
            "missing": len(missing), "moved": len(moved), "not_acknowledged": len(stray)}


def soak(args) -> dict:
    samples = real_jpegs(Path(args.data), 2000)
    env = {**SOAK_ENV, **dict(kv.split("=", 1) for kv in args.env)}
    data_dir = Path(tempfile.mkdtemp(prefix="aser-soak-")) / "data"
    service = LocalService(data_dir, env).start()
    client = ServiceClient(service.url, timeout=60, retry=Retry(attempts=1))  # every answer counted here
    answers: dict[str, int] = {}
    acknowledged: dict[str, int] = {}
    acknowledged_at: dict[str, float] = {}
    series = []
    t0 = time.monotonic()
    next_point, sent = 0.0, 0
    try:
        while (elapsed := time.monotonic() - t0) < args.minutes * 60:
            due = int(elapsed * args.rate) - sent
            if due >= args.batch:
                batch = [(samples[(sent + j) % len(samples)][0], samples[(sent + j) % len(samples)][1],
                          f"soak-{sent + j:08d}") for j in range(args.batch)]
                for (_, _, sid), seq in zip(batch, send_until_acknowledged(client, batch, answers)):
                    acknowledged[sid], acknowledged_at[sid] = seq, time.monotonic()
                sent += args.batch
            else:
                time.sleep(0.01)
            if elapsed >= next_point:
                st = client.status()
                series.append({"t_s": round(elapsed, 1), "database_bytes": st["storage"]["database_bytes"],
                               "rss_bytes": rss_bytes(service.proc.pid),
                               "pss_with_children_bytes": tree_pss_bytes(service.proc.pid),
                               "received": st["samples_received"],
                               "trained": st["samples_trained"], "backlog": st["backlog"],
                               "lag_s": st["lag"]["seconds"], "skipped": st["lag"]["samples_skipped"],
                               "thinned": st["lag"]["samples_thinned"],
                               "pixels_dropped": st["storage"]["retention_pixels_dropped"],
                               "freed_bytes": st["storage"]["retention_freed_bytes"]})
                print(json.dumps(series[-1]), flush=True)
                next_point += args.every
        # ids well inside the horizon (retention runs every 2 s) must all be there
        horizon = float(env["ASER_RETAIN_IDS_S"]) - 2 * float(env["ASER_RETAIN_EVERY_S"]) - 1
        recent = {i for i, t in acknowledged_at.items() if time.monotonic() - t < horizon}
    finally:
        service.stop()
    return {"settings": env, "rate_per_s": args.rate, "minutes": args.minutes, "batch": args.batch,
            "answers": answers, "series": series, "check": verify(data_dir / "aser.db", acknowledged, recent),
            "command": "python -m clients.bench.live.soak " + " ".join(sys.argv[1:]),
            "measured": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m clients.bench.live.soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="the CIFAR-10 zip (real JPEGs to send)")
    p.add_argument("--rate", type=float, default=30.0, help="samples per second")
    p.add_argument("--batch", type=int, default=10, help="samples per request")
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--every", type=float, default=10.0, help="seconds between two points of the series")
    p.add_argument("--env", action="append", default=[], metavar="ASER_X=V", help="a service setting (repeatable)")
    p.add_argument("--out", help="write the result JSON here")
    args = p.parse_args(argv)
    result = soak(args)
    first = next((p for p in result["series"] if p["pixels_dropped"] > 0), result["series"][-1])
    print(f"answers {result['answers']}; check {result['check']}; database {first['database_bytes']} B when "
          f"retention began, {result['series'][-1]['database_bytes']} B at the end")
    if args.out:
        write_result(args.out, result)
    fivexx = sum(n for code, n in result["answers"].items() if code.startswith("5") and code != "507")
    check = result["check"]
    ok = not (check["missing"] or check["moved"] or check["not_acknowledged"] or fivexx)
    return 0 if ok and check["last_seq"] == check["acknowledged"] else 1


if __name__ == "__main__":
    sys.exit(main())
