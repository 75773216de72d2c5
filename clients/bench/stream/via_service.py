"""The benchmark stream through a running service: every mini-batch goes over the ingest
WebSocket as one message (PNG images, the dataset's class names as labels), and each task is
evaluated through POST /predict once the service has trained on everything it acknowledged.

Used by `python -m clients.bench.benchmark run --via URL`; the record has the in-process run's form,
so the two compare directly (same stream order for the same seed; the service's learner has
its own seed, ASER_SEED, and grows its head as classes arrive). With `--stream-rate R` the
stream goes at R samples/s of wall-clock time and never waits for the learner: each task is
evaluated as the model stands when its last sample is acknowledged (the real-time protocol, live;
the service's ASER_MAX_LAG_S and ASER_IDLE_REHEARSAL decide what it does when behind or idle).
"""

from __future__ import annotations

import io
import math
import time

import torch
from PIL import Image

from clients.api import ServiceClient, ServiceError
from clients.bench.results import matrix_summary
from learner.data import ImageDataset, task_batches, task_test_set
from learner.methods.objective import ReplayObjective


def png_bytes(image: torch.Tensor) -> bytes:
    """uint8 [3, H, W] -> lossless PNG bytes."""
    buf = io.BytesIO()
    Image.fromarray(image.permute(1, 2, 0).numpy()).save(buf, "PNG", compress_level=1)
    return buf.getvalue()


def wait_until_trained(client: ServiceClient, received: int, timeout: float = 7200) -> dict:
    deadline = time.time() + timeout
    while time.time() < deadline:
        st = client.status()
        if st.get("error"):
            raise RuntimeError(f"the service's learner stopped: {st['error']}")
        if st["samples_trained"] >= received and st.get("serving_current", True):
            return st
        time.sleep(0.2)
    raise TimeoutError(f"the service trained {client.status()['samples_trained']} of {received} samples")


def evaluate_via(client: ServiceClient, data: ImageDataset, tasks: list[list[int]], chunk: int = 500) -> list[float]:
    """Accuracy (percent) of /predict's top-1 label on each task's test set."""
    accs = []
    for classes in tasks:
        x, y = task_test_set(data, classes)
        correct = 0
        for i in range(0, len(y), chunk):
            try:
                answer = client.predict([png_bytes(img) for img in x[i:i + chunk]], k=1)
            except ServiceError as exc:
                if exc.error != "no_classes":
                    raise
                break  # a busy service has not learned a class yet (a fast stream): it answers nothing right
            names = [r[0]["label"] for r in answer["results"]]
            correct += sum(name == data.class_names[int(t)] for name, t in zip(names, y[i:i + chunk]))
        accs.append(100.0 * correct / len(y) if len(y) else math.nan)
    return accs


def wall_clock_rate(args) -> float | None:
    """--stream-rate as samples per second of wall-clock time (None: as fast as acknowledged)."""
    if not args.stream_rate:
        return None
    try:
        return float(args.stream_rate)
    except ValueError:
        raise SystemExit("error: with --via, --stream-rate is samples per second (the Nx form needs the "
                         "in-process cost model)") from None


def paced(batches, rate: float | None, start: float, sent: int):
    """The batches, each sent no sooner than its samples are due at `rate` samples/s."""
    for labels, images in batches:
        if rate:
            time.sleep(max(0.0, start + sent / rate - time.perf_counter()))
        sent += len(images)
        yield labels, images


def run_via(args, data: ImageDataset, seed: int, bar) -> dict:
    """Stream the class-incremental benchmark through the service at args.via; returns the record."""
    rate = wall_clock_rate(args)
    client = ServiceClient(args.via, token=args.token, timeout=600)
    st = client.status()
    default = ReplayObjective()  # a method without replay reports neither: it takes the defaults' form
    served = (st["method"], st["config"].get("step", default.step), st["config"].get("loss", default.loss))
    if served != (args.method, args.step, args.loss):
        raise SystemExit(f"error: the service at {args.via} runs method, step, loss {served}, "
                         f"not {(args.method, args.step, args.loss)}")
    if rate is None and st["lag"]["max_lag_s"]:
        raise SystemExit(f"error: {args.via} bounds its lag (ASER_MAX_LAG_S={st['lag']['max_lag_s']:g}) and would skip "
                         "samples of a stream sent at once; start it with ASER_MAX_LAG_S=0 for the offline protocol, "
                         "or pass --stream-rate for the real-time one")
    if st["samples_received"]:
        raise SystemExit(f"error: {args.via} has already received {st['samples_received']} samples; "
                         "--via needs a fresh service (an empty data directory)")
    tasks = data.tasks(args.tasks)
    stream_gen = torch.Generator().manual_seed(seed)
    matrix: list[list[float]] = []
    received, train_seconds, start = 0, 0.0, time.perf_counter()
    with client.websocket() as ws:
        for classes in tasks:
            t0 = time.perf_counter()
            batches = ((([data.class_names[int(c)] for c in y], [png_bytes(img) for img in x]))
                       for x, y in task_batches(data, classes, args.batch_size, stream_gen, args.one_class_batches))
            for ack in ws.pipeline(paced(batches, rate, start, received), window=16):
                if "error" in ack:
                    raise RuntimeError(f"the service refused a batch: {ack}")
                received += ack["accepted"]
                bar.update(1)
            if rate is None:
                wait_until_trained(client, received)
            train_seconds += time.perf_counter() - t0
            matrix.append(evaluate_via(client, data, tasks))
            bar.set_postfix(task=len(matrix), acc=f"{sum(matrix[-1][:len(matrix)]) / len(matrix):.1f}")
    st = client.status()
    client.close()
    live = {"realtime": {"stream_rate": rate, "stream_rate_arg": str(args.stream_rate), "max_lag_s": st["lag"]["max_lag_s"],
                         "idle_rehearsal": st["lag"]["rehearsal_steps"] > 0, "trained": st["samples_trained"],
                         "skipped": st["lag"]["samples_skipped"], "thinned": st["lag"]["samples_thinned"],
                         "rehearsal_steps": st["lag"]["rehearsal_steps"], "lean_steps": st["lag"]["lean_steps"],
                         "lean_when_behind": st["lag"]["lean_when_behind"],
                         "unseen": received - st["samples_trained"] - st["lag"]["samples_skipped"]}} if rate else {}
    return {**live,
        "method": st["method"],
        "dataset": args.dataset,
        "mem_size": st["config"]["mem_size"],
        "seed": seed,
        "via": args.via,
        **matrix_summary(matrix),
        "train_seconds": round(train_seconds, 2),
        "steps": st["steps"],
        "settings": {**st["config"], "train_samples": int(data.train_y.numel()),
                     "test_samples": int(data.test_y.numel()), "train_per_class": args.train_per_class,
                     "test_per_class": args.test_per_class, "one_class_batches": args.one_class_batches},
        "device": st["device"],
    }
