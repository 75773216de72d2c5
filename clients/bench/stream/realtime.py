"""The real-time protocol (`run --stream-rate R`): the stream does not wait for the learner.

Sample i of the class-incremental stream arrives at i / R seconds. The learner acts on a clock
that its own work advances, by a cost model (seconds per stream step, per sample passed through
the memory, per rehearsal step) calibrated once per configuration and machine and kept in a file
(`--cost-model`), so a run is reproducible from its seed: a method that costs more trains on less
of the stream (Ghunaim et al., CVPR 2023). At each moment the learner, like the service's worker:

- over the lag bound (`--max-lag S`: the oldest waiting sample is older than S), skips the
  samples older than S/2: no gradient step, and the memory update only while those updates keep
  within `--catch-up-memory-share` of its time, the rest thinned (`learner.catch_up`);
- else trains on the next full batch, if one has arrived (with `--lean-when-behind`, in the
  method's cheapest form while the oldest waiting sample is older than S/2, priced as that form,
  `learner.methods.registry.lean_method`, whose memory update the skipped samples then take too);
- else, with `--idle-rehearsal`, takes a replay-only step within `--rehearsal-share` of its time;
- else waits for the next arrival.

The stream ends when its last sample arrives: what was not learned by then is unseen. The model
is evaluated at each task's end (the accuracy matrix: A_T, F_T) and halfway through each task
("anytime" accuracy: on the classes seen so far, at points spread along the stream). The result
has the shares of the stream trained, skipped (of them thinned) and unseen, and the rehearsal steps.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

from learner.catch_up import CHUNK, CatchUp

# a run's own calibrations go here; the committed ones (results/) seed it and change only when named
DEFAULT_COST_MODEL = ".cache/bench/cost-model.json"
COMMITTED_COST_MODEL = Path("results/realtime/cost-model.json")

def configuration_key(args) -> str:
    """What decides a step's cost: the method and its options, the memory, the batch, the threads."""
    augment = {False: "noaug", True: "aug"}.get(args.augment, f"aug{args.augment}")
    parts = [args.method, args.loss, args.step, f"it{args.iterations}", augment,
             *[f"kd{args.distill:g}"] * bool(getattr(args, "distill", 0)),
             f"m{args.mem_size}", f"b{args.batch_size}", f"t{torch.get_num_threads()}", args.dataset]
    return "-".join(parts)


def calibrate(build, data, batch_size: int, mem_size: int, rounds: int = 30) -> dict:
    """Median CPU seconds of a stream step, a sample passed through and a rehearsal step, with a
    full memory of real training images (the same learner kind as the run, seed 0).

    CPU time of the process, not wall time: the cost of the work itself, whatever else the machine
    runs beside the calibration (a sweep on the other cores). On one thread the two agree on an
    idle machine; on several, CPU time counts every thread's share."""
    learner, next_batch = _filled(build, data, batch_size, mem_size)
    step = _median_seconds(lambda: learner.observe(*next_batch(batch_size)), rounds)
    skip = calibrate_skip(learner, next_batch, batch_size, rounds)
    rehearse = _median_seconds(learner.rehearse, rounds) if getattr(learner, "buffer", None) is not None else step
    return {"step_s": step, **skip, "rehearse_s": rehearse,
            "clock": "process CPU time", "calibrated": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def calibrate_skip(learner, next_batch, batch_size: int, rounds: int = 30) -> dict:
    """CPU seconds of a skipped sample's memory update: a chunk passed through as the catch-up
    passes it (`batch_size` at a time)."""
    chunk = _median_seconds(lambda: learner.pass_through(*next_batch(CHUNK), batch_size), max(3, rounds // 10))
    return {"skip_s_per_sample": chunk / CHUNK, "skip_batch": batch_size}


def _filled(build, data, batch_size: int, mem_size: int):
    """A learner trained until its memory is full, and the next batches of the same order."""
    learner = build()
    x, y = data.train_x, data.train_y
    order = torch.randperm(y.numel(), generator=torch.Generator().manual_seed(0))
    cursor = [0]

    def next_batch(n):
        idx = order[cursor[0] % y.numel():][:n]
        cursor[0] += n
        return x[idx], y[idx]

    while len(getattr(learner, "buffer", ())) < mem_size and cursor[0] + batch_size <= y.numel():
        learner.observe(*next_batch(batch_size))
    return learner, next_batch


def _median_seconds(fn, n: int) -> float:
    times = []
    for _ in range(n):
        t0 = time.process_time()
        fn()
        times.append(time.process_time() - t0)
    return statistics.median(times)


def cost_model(args, build, data, command: str) -> dict:
    """The configuration's costs from `--cost-model` (calibrated and added to it, with the
    `command` that did it, if absent). An entry whose pass-through was timed on whole chunks
    (before the memory update took skipped samples a batch at a time) gets that cost measured
    again, its step and rehearsal costs kept: runs already made with them stay comparable."""
    path = Path(args.cost_model)
    if not path.exists() and path == Path(DEFAULT_COST_MODEL) and COMMITTED_COST_MODEL.exists():
        path.parent.mkdir(parents=True, exist_ok=True)  # the committed calibrations, written only when named
        path.write_text(COMMITTED_COST_MODEL.read_text())
    models = json.loads(path.read_text()) if path.exists() else {}
    key = configuration_key(args)
    if key not in models:
        models[key] = {**calibrate(build, data, args.batch_size, args.mem_size), "command": command}
    elif "skip_batch" not in models[key]:
        learner, next_batch = _filled(build, data, args.batch_size, args.mem_size)
        models[key].update(calibrate_skip(learner, next_batch, args.batch_size), skip_command=command,
                           skip_calibrated=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    else:
        return {"key": key, **models[key]}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(models, indent=2) + "\n")
    return {"key": key, **models[key]}


class Stream:
    """The class-incremental stream, one sample at a time, and when each arrives."""

    def __init__(self, data, tasks: list[list[int]], batch_size: int, generator: torch.Generator, rate: float):
        from learner.data import task_batches

        xs, ys, self.task_ends = [], [], []
        for classes in tasks:
            for x, y in task_batches(data, classes, batch_size, generator):
                xs.append(x)
                ys.append(y)
            self.task_ends.append(sum(len(y) for y in ys))
        self.x, self.y, self.rate = torch.cat(xs), torch.cat(ys), rate
        self.n = len(self.y)

    def arrival(self, i: int) -> float:
        return i / self.rate

    def arrived(self, t: float) -> int:
        """How many samples have arrived by time t."""
        return min(self.n, int(t * self.rate) + 1) if t >= 0 else 0


def simulate(learner, stream: Stream, costs: dict, args, evaluate_at) -> dict:
    """Run the stream against the learner's clock; `evaluate_at(kind, index)` evaluates the model
    as it is when point `index` of the evaluation schedule comes due."""
    b, bound = args.batch_size, args.max_lag
    share = args.rehearsal_share
    catch_up = CatchUp(bound, args.catch_up_memory_share, b) if bound else None
    points = schedule(stream)
    t, nxt, next_point = 0.0, 0, 0
    counts = {"trained": 0, "skipped": 0, "thinned": 0, "rehearsal_steps": 0, "lean_steps": 0}
    end = stream.arrival(stream.n - 1)
    while True:
        while next_point < len(points) and points[next_point][0] <= t:  # the model as it is now
            evaluate_at(points[next_point][1], next_point)
            next_point += 1
        if t > end or next_point == len(points):
            break
        arrived = stream.arrived(t)
        waiting = arrived - nxt
        if waiting and catch_up and catch_up.due(t, stream.arrival(nxt)):
            upto = max(min(stream.arrived(catch_up.cutoff(t)), nxt + CHUNK), nxt + 1)
            lean = bool(args.lean_when_behind)  # over the bound is behind: the lean update, at its price
            done = catch_up.skip(learner, t, stream.y[nxt:upto], lambda idx, at=nxt: stream.x[at + idx],
                                 costs["lean_skip_s_per_sample" if lean else "skip_s_per_sample"], lean)
            t += done.seconds
            counts["skipped"] += upto - nxt
            counts["thinned"] += done.thinned
            nxt = upto
        elif waiting >= b or (waiting and arrived == stream.n):
            upto = min(nxt + b, arrived)
            lean = bool(args.lean_when_behind and catch_up and catch_up.behind(t, stream.arrival(nxt)))
            learner.observe(stream.x[nxt:upto], stream.y[nxt:upto], lean=lean)
            t += costs["lean_step_s"] if lean else costs["step_s"]
            counts["lean_steps"] += lean
            counts["trained"] += upto - nxt
            nxt = upto
        elif args.idle_rehearsal and learner.rehearse() is not None:
            counts["rehearsal_steps"] += 1
            t += costs["rehearse_s"] / share  # its step, and the pause that keeps it to its share
        else:  # wait for the batch to fill (or the next point, or the stream's end)
            wake = stream.arrival(min(stream.n - 1, nxt + b - 1)) if nxt < stream.n else end
            t = max(t, min(wake, points[next_point][0] if next_point < len(points) else wake)) + 1e-9
    counts["unseen"] = stream.n - counts["trained"] - counts["skipped"]
    return counts


def schedule(stream: Stream) -> list[tuple[float, str]]:
    """(time, kind) of each evaluation: halfway through each task ("mid") and at its end ("end")."""
    points, start = [], 0
    for end in stream.task_ends:
        points += [(stream.arrival((start + end) // 2), "mid"), (stream.arrival(end - 1), "end")]
        start = end
    return points
