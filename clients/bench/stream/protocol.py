"""One benchmark run under the paper's protocol: the stream of a dataset's tasks, each sample seen
once in mini-batches, the learner evaluated on every task after each (the accuracy matrix), and
the result record (A_T, F_T, the anytime accuracy, the CPU seconds, the command that produced it).
`clients.bench.benchmark` is its command line."""

from __future__ import annotations

import argparse
import math
import shlex
import sys
import time
from pathlib import Path

import torch

from clients.bench.machine import machine_description, resolve_device
from clients.bench.results import matrix_summary
from clients.bench.stream.noise import REVIEW_SHARES, LabelNoise, nearest_classes
from clients.bench.stream.realtime import Stream, cost_model, simulate
from clients.bench.stream.resume import load_run_state, run_identity, save_run_state
from learner import make_learner
from learner.data import ImageDataset, task_batches, task_test_set
from learner.heads.head_choice import CANDIDATES
from learner.heads.ncm import memory_ncm
from learner.methods.augment import AUGMENTATIONS
from learner.methods.registry import IID_EPOCHS, REPLAY_METHODS, lean_method, shapley_settings, uses_shapley_settings
from learner.methods.sleep import SleepConfig
from learner.metrics import brier_score, expected_calibration_error
from learner.networks.frozen_runtime import cpu_seconds


def evaluate(learner, data: ImageDataset, tasks: list[list[int]], seen: int | None = None) -> dict[str, list]:
    """Test accuracy (percent) on each task's held-out set, by classifier: the softmax head of the
    serving weights ("head"), the nearest-class-mean classifier on the memory ("ncm", for a learner
    with one), with a moving average the trained weights' own head ("trained"), and for a learner
    with a memory the serving head under the other corrections on the memory, one at a time
    (`ContinualLearner.refresh_serving`): "bn_memory" or "bn_average" (the other BatchNorm
    statistics), "bias_memory" or "bias_none" (with or without the fitted logit bias), so that
    every run pairs them. The head, the NCM and the other bias answer on one pass of serving
    features (the bias moves no feature); the trained weights and the other statistics take one each.
    With `seen`, only the first `seen` tasks are scored: the later ones' cells are None (no metric reads
    them; on Split CIFAR-10 and Mini-ImageNet they were 0.0 in every run that scored them)."""
    learner.refresh_serving()  # an evaluation point
    if learner.head_choice is not None:
        return evaluate_candidates(learner, data, tasks, seen)
    ncm = memory_ncm(learner)
    out: dict[str, list] = {"head": [], **({"ncm": []} if ncm else {}),
                            **({"trained": []} if learner.ema is not None else {})}
    test_sets = [task_test_set(data, classes) for classes in tasks[:seen]]
    features = [learner.serving_features(x) for x, _ in test_sets]
    for (x, y), f in zip(test_sets, features):
        out["head"].append(percent_correct(learner.predict_features(f).cpu(), y))
        if ncm is not None:
            out["ncm"].append(percent_correct(ncm.predict(f).cpu(), y))
        if learner.ema is not None:
            out["trained"].append(percent_correct(learner.predict(x, serving=False).cpu(), y))
    if len(getattr(learner, "buffer", ())):
        if learner.backbone.trains_bn:  # the pretrained top keeps ImageNet's statistics: nothing to recompute
            other_bn = "average" if learner.serving_bn == "memory" else "memory"
            with learner.serving_from(bn=other_bn):
                out[f"bn_{other_bn}"] = [percent_correct(learner.predict(x).cpu(), y) for x, y in test_sets]
        other_bias = "bias_none" if learner.serving_bias else "bias_memory"
        with learner.serving_from(bias=not learner.serving_bias):
            out[other_bias] = [percent_correct(learner.predict_features(f).cpu(), y)
                               for f, (_, y) in zip(features, test_sets)]
    return {classifier: row + [None] * (len(tasks) - len(row)) for classifier, row in out.items()}


def evaluate_candidates(learner, data: ImageDataset, tasks: list[list[int]], seen: int | None = None) -> dict:
    """Under a measured head choice (`learner.heads.head_choice`): the served answer ("head") and each candidate's
    (streaming LDA, the trained top, their mean) from one pass, on each task's held-out set."""
    out = {name: [] for name in ("head", *CANDIDATES)}
    for classes in tasks[:seen]:
        x, y = task_test_set(data, classes)
        probabilities = learner.candidate_probabilities(x)
        for name in out:
            out[name].append(percent_correct(probabilities["served" if name == "head" else name].argmax(1), y))
    return {classifier: row + [None] * (len(tasks) - len(row)) for classifier, row in out.items()}


def percent_correct(pred: torch.Tensor, y: torch.Tensor) -> float:
    return 100.0 * float((pred == y).float().mean()) if y.numel() else math.nan


def run_once(args, data: ImageDataset, seed: int, progress: bool = True, checkpoint: Path | None = None) -> dict:
    """One full stream for one seed; returns the result record. With `checkpoint`, the run's state
    is saved there after each task and a run started again on it goes on from there."""
    if args.via:
        from clients.bench.stream.via_service import run_via

        bar = _progress(stream_steps(data, data.tasks(args.tasks), args.batch_size, args.one_class_batches),
                        f"{args.method} via {args.via} seed {seed}", progress)
        result = run_via(args, data, seed, bar)
        bar.close()
        return {**result, "machine": "the service's (see device)", "torch": torch.__version__,
                "command": _command(), "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if args.stream_rate:
        return run_realtime(args, data, seed)
    device = resolve_device(args.device)
    torch.manual_seed(seed)
    learner = build_learner(args, data, device, seed)
    tasks = data.tasks(args.tasks)
    stream_gen = torch.Generator().manual_seed(seed)
    passes, evaluate_each = stream_passes(args, data, tasks)
    noise = None
    if getattr(args, "label_noise", 0):
        pairs = getattr(args, "label_noise_mode", "symmetric") == "pair"
        noise = LabelNoise(args.label_noise, seed, nearest_classes(learner, data) if pairs else None)
    run = {"done": 0, "matrix": [], "ncm_matrix": [], "trained_matrix": [], "replay_share": [], "train_seconds": 0.0,
           "resumed_at": [], "machines": []}
    identity = run_identity(args, data, seed)
    saved = load_run_state(checkpoint, identity, data) if checkpoint else None
    if saved:
        learner.load_state_dict(saved["learner"])
        stream_gen.set_state(saved["stream"])
        torch.set_rng_state(saved["torch_rng"])
        run = {**saved["progress"], "resumed_at": [*saved["progress"]["resumed_at"], saved["progress"]["done"]]}
        if noise is not None:
            noise.load_state_dict(saved["noise"])
    machine = machine_description(device)  # a resumed run's legs may have run on several
    run["machines"] = [*[m for m in run["machines"] if m != machine], machine]
    n_steps = sum(pass_steps(args, data, classes) for classes in passes)
    bar = _progress(n_steps, f"{args.method} seed {seed}", progress)
    bar.update(sum(pass_steps(args, data, classes) for classes in passes[:run["done"]]))
    for classes in passes[run["done"]:]:
        train_pass(learner, data, classes, args, stream_gen, run, bar, evaluate_each,
                   last=run["done"] == len(passes) - 1, noise=noise)
        run["done"] += 1
        if run["done"] == len(passes) and not evaluate_each:
            record(evaluate(learner, data, tasks), run)
        bar.write(f"{args.method} seed {seed}: pass {run['done']}/{len(passes)}, "
                  f"{_observed_accuracy(run, evaluate_each)}, {run['train_seconds']:.0f} s training", file=sys.stdout)
        sys.stdout.flush()  # the line a sweep's log shows for a run in progress
        if checkpoint and run["done"] < len(passes):
            save_run_state(checkpoint, {"run": identity, "progress": run, "learner": learner.state_dict(),
                                        "stream": stream_gen.get_state(), "torch_rng": torch.get_rng_state(),
                                        **({"noise": noise.state_dict()} if noise else {})}, data)
    bar.close()
    result = result_record(args, data, seed, device, learner, run)
    if noise is not None:
        one_class = args.one_class_batches and evaluate_each

        def stream():  # the stream's batches in its order, drawn again
            again = torch.Generator().manual_seed(seed)
            return (batch for classes in passes for batch in task_batches(data, classes, args.batch_size, again,
                                                                          one_class))
        result["label_noise"] = noise_record(noise, learner, data, tasks, stream)
    return result


def noise_record(noise: LabelNoise, learner, data: ImageDataset, tasks: list[list[int]], stream) -> dict:
    """How well the memory's suspects find the flips, and the served accuracy at the end once the flipped samples
    found are relabelled: those among the memory's 100 most suspected, then those of the whole stream (`stream()`:
    its batches again) whose value to the memory is below zero; under a sleep schedule, then after a sleep on them;
    then a deeper review, the lowest-valued REVIEW_SHARES of the stream (nested: each includes the last)."""
    record = {**noise.detection(learner), "kept_out_of_streaming_head": learner.suspects_kept_out}
    if "memory" not in record:
        return record
    mean = lambda row: round(sum(row) / len(row), 2)  # noqa: E731
    record["final_accuracy"] = mean(evaluate(learner, data, tasks)["head"])
    done = set(noise.correct_found(learner))
    record["corrected"] = len(done)
    record["final_accuracy_corrected"] = mean(evaluate(learner, data, tasks)["head"])
    cpu0 = time.process_time()  # the valuation and the corrections together
    values = noise.stream_values(learner, stream())
    order = torch.argsort(values, stable=True)
    below = noise.review(learner, stream(), order[:int((values < 0).sum())], done)
    record |= {"stream_valuation_cpu_seconds": round(time.process_time() - cpu0, 2),
               "stream_suspected": below["reviewed"], "stream_precision": below["precision"],
               "stream_recall": below["recall"], "stream_relabelled": below["relabelled"],
               "final_accuracy_stream_corrected": mean(evaluate(learner, data, tasks)["head"])}
    if getattr(learner, "sleeper", None) is not None and learner.sleeper.new_samples:
        report = learner.sleep().as_dict()  # the relabels are new to the top: the idle device sleeps on them
        record["sleep_on_corrections"] = {k: report[k] for k in ("updates", "kept", "cpu_seconds")}
        record["final_accuracy_corrected_slept"] = mean(evaluate(learner, data, tasks)["head"])
    record["stream_review"] = []
    for share in REVIEW_SHARES:  # a person reviewing further down the list: what each share of the stream gives
        stage = noise.review(learner, stream(), order[:max(int(share * len(values)), below["reviewed"])], done)
        record["stream_review"].append({"share": share, **stage, "relabelled": len(done),
                                        "final_accuracy": mean(evaluate(learner, data, tasks)["head"])})
    return record


def run_realtime(args, data: ImageDataset, seed: int) -> dict:
    """One stream for one seed under the real-time protocol (`clients.bench.stream.realtime`)."""
    device = resolve_device(args.device)
    torch.manual_seed(seed)
    tasks = data.tasks(args.tasks)
    costs, rate = stream_costs(args, data, device)
    learner = build_learner(args, data, device, seed)
    stream = Stream(data, tasks, args.batch_size, torch.Generator().manual_seed(seed), float(rate))
    run = {"matrix": [], "ncm_matrix": [], "trained_matrix": [], "replay_share": [], "resumed_at": [],
           "machines": [machine_description(device)], "along": []}  # accuracy at points along the stream

    def evaluate_at(kind: str, index: int) -> None:
        seen = [c for classes in tasks[:index // 2 + 1] for c in classes]
        x, y = task_test_set(data, seen)
        run["along"].append(percent_correct(learner.predict(x).cpu(), y))
        if kind == "end":
            record(evaluate(learner, data, tasks, seen=index // 2 + 1), run)

    t0 = time.perf_counter()
    counts = simulate(learner, stream, costs, args, evaluate_at)
    run["train_seconds"] = time.perf_counter() - t0  # wall time of the simulation, evaluations included
    result = result_record(args, data, seed, device, learner, run)
    result["anytime_accuracy"] = run["along"]
    result["average_anytime_accuracy"] = sum(run["along"]) / len(run["along"])
    result["realtime"] = {"stream_rate": round(float(rate), 3), "stream_rate_arg": str(args.stream_rate),
                          "max_lag_s": args.max_lag, "lean_when_behind": args.lean_when_behind,
                          "idle_rehearsal": args.idle_rehearsal,
                          "rehearsal_share": args.rehearsal_share, "catch_up_memory_share": args.catch_up_memory_share,
                          "cost_model": costs, **counts,
                          **{f"{k}_share": round(counts[k] / stream.n, 4)
                             for k in ("trained", "skipped", "thinned", "unseen")}}
    return result


def stream_costs(args, data: ImageDataset, device: torch.device) -> tuple[dict, float]:
    """The configuration's cost model and the stream's rate in samples/s (calibrating what is absent)."""
    costs = cost_model(args, lambda: build_learner(args, data, device, 0), data, _command())
    if args.lean_when_behind:  # a lean step, and a skip behind, cost what its lean form's do
        lean = argparse.Namespace(**{**vars(args), "method": lean_method(args.method), "iterations": 1,
                                     "augment": False, "distill": 0.0})
        form = cost_model(lean, lambda: build_learner(lean, data, device, 0), data, _command())
        costs = {**costs, "lean_step_s": form["step_s"], "lean_skip_s_per_sample": form["skip_s_per_sample"]}
    rate = args.stream_rate
    if isinstance(rate, str) and rate.endswith("x"):  # a multiple of plain ER's throughput by its cost model
        er = argparse.Namespace(**{**vars(args), "method": "er", "loss": "ce", "step": "joint", "iterations": 1,
                                   "augment": False, "distill": 0.0, "ema": None})
        rate = float(rate[:-1]) * args.batch_size / cost_model(er, lambda: build_learner(er, data, device, 0),
                                                               data, _command())["step_s"]
    return costs, float(rate)


def _observed_accuracy(run: dict, per_task: bool) -> str:
    """Mean accuracy on the tasks observed so far (all of them once an iid run is evaluated)."""
    if not run["matrix"]:
        return "not evaluated yet"
    row = run["matrix"][-1]
    seen = row[:len(run["matrix"])] if per_task else row
    return f"accuracy on the observed tasks {sum(seen) / len(seen):.1f}%"


def augment_policy(value: str) -> bool | str:
    """--augment's value: crop-flip (also the flag alone) or strong."""
    if value not in AUGMENTATIONS:
        raise argparse.ArgumentTypeError(f"choose one of {', '.join(AUGMENTATIONS)}")
    return True if value == "crop-flip" else value


def build_learner(args, data: ImageDataset, device: torch.device, seed: int):
    return make_learner(
        args.method, data.num_classes, mem_size=args.mem_size, dataset=args.dataset, k=args.k,
        n_candidates=args.n_candidates, replay_batch=args.replay_batch,
        exclude_current_task=args.exclude_current_task, loss=args.loss, step=args.step, lr=args.lr,
        iterations=args.iterations, augment=args.augment, distill=args.distill, ema_decay=args.ema,
        serving_bn=args.serving_bn, serving_bias=args.serving_bias, device=device, seed=seed,
        image_shape=data.image_shape, autocast_dtype=torch.bfloat16 if args.bf16 else None,
        latent_dtype=torch.bfloat16 if args.bf16_latent else None, compile=args.compile,
        feature_max_age=args.feature_max_age, backbone=getattr(args, "backbone_object", None),
        train_every=getattr(args, "train_every", 1), optimizer=getattr(args, "optimizer", "sgd"),
        head_lr=getattr(args, "head_lr", None), sleep=sleep_config(args),
        **serving_options(args),
    )


def sleep_config(args) -> SleepConfig | None:
    """The sleep the run's schedule triggers (`--sleep-every`), or None."""
    if not getattr(args, "sleep_every", 0):
        return None
    return SleepConfig(epochs=args.sleep_epochs, batch_size=args.sleep_batch, lr=args.sleep_lr,
                       schedule=args.sleep_schedule, source=args.sleep_source, draw=args.sleep_draw,
                       store_capacity=args.sleep_store, fresh_epochs=getattr(args, "fresh_sleep_epochs", None))


def sleep_settings(args) -> dict:
    """What a run records of its sleep schedule (empty without one)."""
    if not getattr(args, "sleep_every", 0):
        return {}
    return {"sleep": {"every": args.sleep_every, "epochs": args.sleep_epochs, "batch": args.sleep_batch,
                      "lr": args.sleep_lr, "schedule": args.sleep_schedule, "source": args.sleep_source,
                      "draw": args.sleep_draw, "store": args.sleep_store,
                      **({"fresh_at_end": True} if getattr(args, "fresh_sleep_at_end", False) else {}),
                      **({"fresh_epochs": n} if (n := getattr(args, "fresh_sleep_epochs", None)) else {})}}


def sleep_record(learner) -> dict:
    """The sleeps a run took: their count, sample-updates and CPU, and each one's held-back answer before and after."""
    sleeper = getattr(learner, "sleeper", None)
    if sleeper is None:
        return {}
    store = sleeper.store
    return {"sleeps": {"count": sleeper.sleeps, "updates": sleeper.updates,
                       "cpu_seconds": round(sleeper.cpu_seconds, 2), "kept": sum(r["kept"] for r in sleeper.reports),
                       "store_samples": len(store), "store_bytes": len(store) * store.bytes_per_sample,
                       "each": sleeper.reports}}


def serving_options(args) -> dict:
    """The served head's options as set: what builds the learner and what its result records."""
    return {**({"serving_head": args.serving_head} if args.serving_head else {}),
            **({"trained_head_from": args.trained_head_from} if args.trained_head_from else {}),
            **({"choose_head": args.choose_head} if getattr(args, "choose_head", False) else {}),
            **({"head_prior": args.head_prior} if getattr(args, "head_prior", None) else {}),
            **({"calibrate": True} if getattr(args, "calibrate", False) else {}),
            **({"suspect_rule": True} if getattr(args, "suspect_rule", False) else {})}


def stream_passes(args, data: ImageDataset, tasks: list[list[int]]) -> tuple[list[list[int]], bool]:
    """The passes over the training data, each a list of classes, and whether each is evaluated:
    one pass per task, or for iid-online / iid-offline `epochs` passes over every class, shuffled
    together and evaluated once at the end."""
    if args.method not in IID_EPOCHS:
        return tasks, True
    return [[c for t in tasks for c in t]] * (args.epochs or IID_EPOCHS[args.method]), False


def pass_steps(args, data: ImageDataset, classes: list[int]) -> int:
    one_class = args.one_class_batches and args.method not in IID_EPOCHS
    return stream_steps(data, [classes], args.batch_size, one_class)


def train_pass(learner, data: ImageDataset, classes: list[int], args, stream_gen, run: dict, bar,
               evaluate_after: bool, last: bool = False, noise: LabelNoise | None = None) -> None:
    """Observe one pass's mini-batches once each; for a task, evaluate on every task after it, and
    on the classes seen so far once each new class has sent ANYTIME_POINTS images (`anytime`). With a sleep
    schedule, a sleep once `--sleep-every` samples are new, and after the `last` pass's stream (the device idle)."""
    one_class = args.one_class_batches and evaluate_after
    t0, cpu0 = time.perf_counter(), cpu_seconds()
    if evaluate_after:
        learner.begin_task(classes)
    replayed, incoming = 0, 0  # incoming: a tensor summed on the device, read once per task
    anytime = AnytimeProbe(data, data.tasks(args.tasks), len(run["matrix"]), classes) if evaluate_after else None
    if noise is not None:
        noise.begin(classes)
    for x, y in task_batches(data, classes, args.batch_size, stream_gen, one_class):
        keys = None
        if noise is not None:
            y, keys = noise.flip(y)
        stats = learner.observe(x, y, keys=keys)
        replayed += stats.get("replayed", 0)
        incoming += stats.get("replayed_incoming", 0)
        if anytime is not None:
            anytime.after_batch(learner, y, run)
        for _ in range(getattr(args, "rehearsals", 0)):  # the idle time before the next batch arrives
            learner.rehearse()
        if getattr(args, "sleep_every", 0) and learner.sleeper.new_samples >= args.sleep_every:
            learner.sleep()
        bar.update(1)
    if last and getattr(args, "sleep_every", 0) and learner.sleeper.new_samples:
        learner.sleep()  # the stream has ended: the device is idle
    if last and getattr(args, "fresh_sleep_at_end", False):
        learner.sleep(fresh=True)  # and its user asks for the top trained again over everything held
    if evaluate_after:
        learner.end_task()
    probing = (anytime.wall, anytime.cpu) if anytime is not None else (0.0, 0.0)
    run["train_seconds"] += time.perf_counter() - t0 - probing[0]
    # the process's CPU seconds (and its graph exports'): what the step costs, whatever else the machine runs beside it
    run["train_cpu_seconds"] = run.get("train_cpu_seconds", 0.0) + cpu_seconds() - cpu0 - probing[1]
    if not evaluate_after:
        return
    if replayed:  # % of replayed samples whose class is in the incoming batch
        run["replay_share"].append(round(100 * float(incoming) / replayed, 2))
    record(evaluate(learner, data, data.tasks(args.tasks), seen=len(run["matrix"]) + 1), run)


ANYTIME_POINTS = (10, 100, 1000)  # images of each new class


class AnytimeProbe:
    """Accuracy on the classes seen so far (every earlier task's and the current one's) at the
    moment each of the current task's classes has sent N images, for N in ANYTIME_POINTS: how
    useful the service is while a class is still young. Its time is not training time."""

    def __init__(self, data: ImageDataset, tasks: list[list[int]], task_index: int, classes: list[int]):
        seen = [c for t in tasks[:task_index + 1] for c in t]
        self.test = task_test_set(data, seen)
        self.classes = torch.tensor(classes)
        self.counts = torch.zeros(len(classes), dtype=torch.long)
        self.pending = list(ANYTIME_POINTS)
        self.wall = self.cpu = 0.0

    def after_batch(self, learner, labels: torch.Tensor, run: dict) -> None:
        self.counts += (labels.cpu()[:, None] == self.classes[None, :]).sum(0)
        while self.pending and int(self.counts.min()) >= self.pending[0]:
            t0, cpu0 = time.perf_counter(), cpu_seconds()
            learner.refresh_serving()
            point = str(self.pending.pop(0))
            if learner.head_choice is None:
                served = torch.softmax(learner.logits(self.test[0]), 1)
                answers = {"anytime": served.argmax(1)}
            else:  # the served answer and each candidate's, from one pass
                probabilities = learner.candidate_probabilities(self.test[0])
                served = learner.calibrated(probabilities)
                probabilities.pop("served")
                answers = {"anytime": served.argmax(1),
                           **{f"anytime_{name}": p.argmax(1) for name, p in probabilities.items()}}
            run.setdefault("anytime_calibration", {}).setdefault(point, []).append(
                calibration_figures(served.cpu(), self.test[1]))
            for key, predicted in answers.items():
                accuracy = percent_correct(predicted.cpu(), self.test[1])
                run.setdefault(key, {}).setdefault(point, []).append(round(accuracy, 2))
            self.wall += time.perf_counter() - t0
            self.cpu += cpu_seconds() - cpu0


def calibration_figures(probabilities: torch.Tensor, labels: torch.Tensor) -> dict:
    """How far the served probabilities mean what they say: the expected calibration error (15 bins) and the Brier
    score, the mean top probability, and the wrong answers given at more than 0.99."""
    confidence, answer = probabilities.max(1)
    wrong = answer != labels
    return {"ece": round(expected_calibration_error(probabilities, labels), 4),
            "brier": round(brier_score(probabilities, labels), 4),
            "mean_confidence": round(float(confidence.mean()), 4),
            "wrong": int(wrong.sum()), "wrong_above_0.99": int((wrong & (confidence > 0.99)).sum())}


def calibration_record(learner, data: ImageDataset, tasks: list[list[int]], run: dict) -> dict:
    """The served probabilities' calibration on every class's test set at the end, and at each anytime point (the
    mean over the tasks that reached it, and each task's ECE: the first task has no held-back samples yet)."""
    x, y = task_test_set(data, [c for t in tasks for c in t])
    served = torch.softmax(learner.logits(x), 1)  # under a head choice, the log of the served probabilities
    points = run.get("anytime_calibration", {})
    anytime = {point: {k: round(sum(f[k] for f in figures) / len(figures), 4) for k in figures[0]}
               for point, figures in points.items()}
    by_task = {point: [f["ece"] for f in figures] for point, figures in points.items()}
    return {"calibration": {"end": calibration_figures(served.cpu(), y), "anytime": anytime,
                            "anytime_ece_by_task": by_task}}


def anytime_summary(run: dict) -> dict:
    """Each point's accuracy averaged over the tasks that reached it, and the per-task lists (of the
    served answer, and under a measured head choice of each candidate: anytime_slda, ...)."""
    out = {}
    for key in ("anytime", *(f"anytime_{name}" for name in CANDIDATES)):
        if by_task := run.get(key, {}):
            out |= {key: {n: round(sum(v) / len(v), 2) for n, v in by_task.items()}, f"{key}_by_task": by_task}
    return out


def result_record(args, data: ImageDataset, seed: int, device: torch.device, learner, run: dict) -> dict:
    matrix, ncm_matrix, trained = run["matrix"], run["ncm_matrix"], run.get("trained_matrix", [])
    ncm = matrix_summary(ncm_matrix, "_ncm") if len(ncm_matrix) == len(matrix) else {}
    ncm |= matrix_summary(trained, "_trained") if trained and len(trained) == len(matrix) else {}
    for key in (*CORRECTED_EVALUATIONS, *CANDIDATES):
        other = run.get(MATRICES[key], [])
        ncm |= matrix_summary(other, f"_{key}") if other and len(other) == len(matrix) else {}
    k, n_c = shapley_settings(args.method, args.dataset, args.k, args.n_candidates)
    uses_shapley = uses_shapley_settings(args.method)
    passes, _ = stream_passes(args, data, data.tasks(args.tasks))
    return {
        "method": args.method,
        "dataset": args.dataset,
        "mem_size": args.mem_size if args.method in REPLAY_METHODS or args.method == "agem" else None,
        "seed": seed,
        **matrix_summary(matrix),
        **ncm,
        **({"replay_incoming_share": run["replay_share"]} if run["replay_share"] else {}),
        **anytime_summary(run),
        **({"head_choice": learner.head_choice.summary()} if learner.head_choice is not None else {}),
        "train_seconds": round(run["train_seconds"], 2),
        **({"train_cpu_seconds": round(run["train_cpu_seconds"], 2)} if "train_cpu_seconds" in run else {}),
        **backbone_record(args, data, learner),
        "steps": learner.steps,
        **({"rehearsal_steps": learner.rehearsal_steps} if learner.rehearsal_steps else {}),
        **sleep_record(learner),
        **calibration_record(learner, data, data.tasks(args.tasks), run),
        **({"resumed_after_pass": run["resumed_at"]} if run["resumed_at"] else {}),
        "settings": {
            "step": args.step, "loss": args.loss, "threads": torch.get_num_threads(),
            "augment": args.augment, "iterations": args.iterations, "ema": args.ema,
            **({"distill": args.distill} if args.distill else {}),
            **({"serving_bn": args.serving_bn} if args.serving_bn != "average" else {}),
            **({"serving_bias": True} if args.serving_bias else {}),
            "k": k if uses_shapley else None, "n_candidates": n_c if uses_shapley else None,
            "lr": args.lr, "batch_size": args.batch_size, "replay_batch": args.replay_batch,
            "epochs": 1 if args.method not in IID_EPOCHS else len(passes),
            "exclude_current_task": args.exclude_current_task, "one_class_batches": args.one_class_batches,
            "bf16": args.bf16, "bf16_latent": args.bf16_latent, "compile": args.compile,
            "train_samples": int(data.train_y.numel()), "test_samples": int(data.test_y.numel()),
            "train_per_class": args.train_per_class, "test_per_class": args.test_per_class,
            **({"feature_max_age": args.feature_max_age} if args.method.startswith("cb") else {}),
            **({"train_every": args.train_every} if getattr(args, "train_every", 1) != 1 else {}),
            **({"rehearsals": args.rehearsals} if getattr(args, "rehearsals", 0) else {}),
            **sleep_settings(args),
            **({"optimizer": args.optimizer} if getattr(args, "optimizer", "sgd") != "sgd" else {}),
            **({"head_lr": args.head_lr} if getattr(args, "head_lr", None) else {}),
            **({"backbone": learner.backbone.identity()} if args.backbone != "scratch" else {}),
            **serving_options(args),
        },
        "device": str(device),
        "machine": " + ".join(run["machines"]),
        "torch": torch.__version__,
        "command": _command(),
        "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def backbone_record(args, data: ImageDataset, learner) -> dict:
    """Memory bytes (a slot's stored form times M), and on a pretrained backbone the frozen forward's
    CPU seconds for the run's stream (its measured cost an image times the training images; the
    benchmark reuses cached latents, the service pays it per image)."""
    buffer = getattr(learner, "buffer", None)
    out = {"memory_bytes": buffer.capacity * learner.backbone.slot_bytes} if buffer is not None else {}
    if args.backbone != "scratch":
        ms = args.frozen_forward_cpu_ms
        out |= {"frozen_forward_cpu_ms": round(ms, 3),
                "frozen_forward_cpu_seconds": round(ms * int(data.train_y.numel()) / 1000, 2)}
    return out


# the serving head under the other corrections on the memory (`evaluate`)
CORRECTED_EVALUATIONS = ("bn_memory", "bn_average", "bias_memory", "bias_none")
# evaluation -> run key
MATRICES = {"head": "matrix", "ncm": "ncm_matrix", "trained": "trained_matrix",
            **{v: f"{v}_matrix" for v in (*CORRECTED_EVALUATIONS, *CANDIDATES)}}


def record(evaluation: dict[str, list[float]], run: dict) -> None:
    for classifier, row in evaluation.items():
        run.setdefault(MATRICES[classifier], []).append(row)


def stream_steps(data: ImageDataset, tasks: list[list[int]], batch_size: int, one_class: bool = False) -> int:
    """Mini-batches in one pass over the class-incremental stream (`task_batches`)."""
    groups = [[c] for t in tasks for c in t] if one_class else tasks
    return sum(math.ceil(int(torch.isin(data.train_y, torch.tensor(g)).sum()) / batch_size) for g in groups)


def _command() -> str:
    return "python -m clients.bench.benchmark " + " ".join(shlex.quote(a) for a in sys.argv[1:])


def _progress(total: int, desc: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="step", disable=not enabled, dynamic_ncols=True, mininterval=2)


def format_matrix(matrix: list[list[float | None]]) -> str:
    """The accuracy matrix as printed after a run; - for a task not scored yet."""
    def cells(row: list[float | None]) -> str:
        return " ".join("     -" if v is None else f"{v:6.1f}" for v in row)

    head = "after \\ task " + " ".join(f"{j + 1:>6}" for j in range(len(matrix[0])))
    rows = [f"{('task ' + str(i + 1)) if len(matrix) > 1 else 'end':>12} {cells(row)}" for i, row in enumerate(matrix)]
    return "\n".join([head, *rows])


