"""Benchmark result files: loading, naming a configuration, each run's values (the tables' columns),
and paired comparisons between two configurations run with the same seeds (`tables` writes them,
`plots` draws them).

>>> run_label({"method": "er", "settings": {"step": "separate", "loss": "ace"}})
'er (separate, ace)'
>>> d = paired_difference({1: 40.0, 2: 42.0, 3: 41.0}, {1: 43.0, 2: 44.0, 3: 43.5, 4: 50.0})
>>> d["seeds"], round(d["mean"], 2), d["wins_a"], d["wins_b"]
(3, 2.5, 0, 3)
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path

from learner.catch_up import MEMORY_SHARE
from learner.metrics import average_accuracy, average_forgetting, mean_ci95


def write_result(path: str | Path, result: dict) -> None:
    """A result file: indented JSON, its folder made if missing."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result, indent=2) + "\n")


def matrix_summary(matrix: list[list[float]], suffix: str = "") -> dict:
    """An accuracy matrix with its A_T and F_T (None with one evaluation), under the keys a result
    file uses (`suffix` "_ncm" for the nearest-class-mean classifier's).

    >>> matrix_summary([[90.0, 0.0], [60.0, 80.0]])
    {'accuracy_matrix': [[90.0, 0.0], [60.0, 80.0]], 'average_accuracy': 70.0, 'average_forgetting': 30.0}
    """
    forgetting = average_forgetting(matrix)
    return {f"accuracy_matrix{suffix}": matrix, f"average_accuracy{suffix}": average_accuracy(matrix),
            f"average_forgetting{suffix}": None if math.isnan(forgetting) else forgetting}


def load_results(folder: Path) -> list[dict]:
    results = []
    for f in sorted(Path(folder).rglob("*.json")):
        try:
            r = json.loads(f.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if isinstance(r, dict) and "accuracy_matrix" in r and "method" in r:
            results.append(r)
    return results


def run_label(result: dict) -> str:
    """The method, with what is not the default: step, loss, precision mode, the service path.

    >>> run_label({"method": "aser-mu", "settings": {"bf16_latent": True}})
    'aser-mu (bf16-latent)'
    >>> run_label({"method": "er", "settings": {}, "via": "http://127.0.0.1:8000"})
    'er (via service)'
    >>> run_label({"method": "sv-upd", "settings": {"loss": "ace", "train_per_class": 1000}})
    'sv-upd (ace, 1000/class)'
    >>> run_label({"method": "er", "settings": {"loss": "ace", "one_class_batches": True}})
    'er (ace, one-class batches)'
    >>> run_label({"method": "er", "settings": {"loss": "ace", "augment": True, "iterations": 3, "ema": 0.99}})
    'er (ace, aug, 3 iter, ema 0.99)'
    >>> run_label({"method": "er", "settings": {"loss": "ace", "rehearsals": 3}})
    'er (ace, 3 rehearsals a batch)'
    >>> run_label({"method": "er", "settings": {}, "label_noise": {"rate": 0.2}})
    'er (noise 0.2)'
    >>> run_label({"method": "er", "settings": {}, "label_noise": {"rate": 0.2, "mode": "pair"}})
    'er (noise 0.2 pair)'
    >>> run_label({"method": "cb-sv-duel", "settings": {"loss": "ace", "feature_max_age": 0}})
    'cb-sv-duel (ace, age 0)'
    >>> run_label({"method": "er", "settings": {}, "realtime": {"stream_rate_arg": "2x", "max_lag_s": 60.0,
    ...                                                         "idle_rehearsal": False}})
    'er (rate 2x, lag 60 s)'
    >>> run_label({"method": "er", "settings": {}, "realtime": {"stream_rate_arg": "4x", "max_lag_s": 10.0,
    ...                                                         "lean_when_behind": True, "idle_rehearsal": False}})
    'er (rate 4x, lag 10 s, lean when behind)'
    """
    settings = result.get("settings", {})
    modes = [settings[k] for k, default in (("step", "joint"), ("loss", "ce")) if settings.get(k, default) != default]
    modes += [m for m, key in (("bf16", "bf16"), ("bf16-latent", "bf16_latent"), ("compile", "compile"))
              if settings.get(key)]
    if settings.get("augment"):
        modes.append("aug" if settings["augment"] is True else f"aug {settings['augment']}")
    if settings.get("distill"):
        modes.append(f"distill {settings['distill']:g}")
    if settings.get("serving_bn", "average") != "average":
        modes.append(f"bn {settings['serving_bn']}")
    if settings.get("serving_bias"):
        modes.append("bias")
    if settings.get("iterations", 1) != 1:
        modes.append(f"{settings['iterations']} iter")
    if settings.get("train_every", 1) != 1:
        modes.append(f"a step every {settings['train_every']} batches")
    if settings.get("rehearsals"):
        modes.append(f"{settings['rehearsals']} rehearsals a batch")
    if settings.get("optimizer", "sgd") != "sgd":
        modes.append(settings["optimizer"])
    if settings.get("ema"):
        modes.append(f"ema {settings['ema']:g}")
    if settings.get("one_class_batches"):
        modes.append("one-class batches")
    if settings.get("replay_batch", 10) != 10:
        modes.append(f"replay {settings['replay_batch']}")
    if settings.get("feature_max_age", 100) != 100:  # fresh or staler features never pool with the default bound
        modes.append(f"age {settings['feature_max_age']}")
    if noise := result.get("label_noise"):  # a noisy stream never pools with the clean one
        modes.append(f"noise {noise['rate']:g}" + (" pair" if noise.get("mode") == "pair" else ""))
    if settings.get("train_per_class"):  # a reduced stream never pools with full-length runs
        modes.append(f"{settings['train_per_class']}/class")
    if backbone := settings.get("backbone"):  # the pretrained backbone: its input size, cut and latent bits
        modes.append(f"{backbone['backbone']} {backbone['input_size']}px cut {backbone['cut']}"
                     + (f" {backbone['latent_bits']}-bit" if backbone["latent_bits"] != 16 else "")
                     + (" standardised" if backbone.get("standardize") else ""))
    if settings.get("serving_head"):
        modes.append(f"serve {settings['serving_head']}"
                     + (f" until {settings['trained_head_from']} a class" if settings.get("trained_head_from") else "")
                     + {True: " or the head measured better", "held-back": " or the head measured better on held-back "
                        "samples"}.get(settings.get("choose_head"), "")
                     + (f", prior {settings['head_prior']}" if settings.get("head_prior") else "")
                     + (", suspect rule" if settings.get("suspect_rule") else ""))
    if backbone and settings.get("lr", 0.1) != 0.1:
        modes.append(f"lr {settings['lr']:g}")
    if result.get("via"):
        modes.append("via service")
    if rt := result.get("realtime"):  # the real-time protocol never pools with the offline one
        share = rt.get("catch_up_memory_share", MEMORY_SHARE)  # the default, in files written before it
        modes.append(f"rate {rt['stream_rate_arg']}" + (f", lag {rt['max_lag_s']:g} s" if rt["max_lag_s"] else "")
                     + (f", memory share {share:g}" if rt["max_lag_s"] and share != MEMORY_SHARE else "")
                     + (", lean when behind" if rt.get("lean_when_behind") else "")
                     + (", idle rehearsal" if rt["idle_rehearsal"] else ""))
    return result["method"] + (f" ({', '.join(modes)})" if modes else "")


def group(results: list[dict]) -> dict[tuple, list[dict]]:
    """Results by (dataset, memory size, configuration label)."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in results:
        groups[(r["dataset"], r["mem_size"] or 0, run_label(r))].append(r)
    return groups


def fmt(values: list[float]) -> str:
    if not values:
        return "n/a"
    mean, ci = mean_ci95(values)
    return f"{mean:.1f} ± {ci:.1f}" if not math.isnan(ci) else f"{mean:.1f}"


def new_task_accuracy(result: dict) -> float | None:
    """Mean accuracy on each task right after learning it, tasks 2..T: how well new classes are
    learned at all (task 1 has no old classes to compete with).

    >>> new_task_accuracy({"accuracy_matrix": [[90.0, 0.0, 0.0], [50.0, 70.0, 0.0], [40.0, 30.0, 10.0]]})
    40.0
    """
    diagonal = [row[i] for i, row in enumerate(result["accuracy_matrix"])][1:]
    return sum(diagonal) / len(diagonal) if diagonal else None


def incoming_replay_share(result: dict) -> float | None:
    """Mean over tasks 2..T of the % of replayed samples whose class is in the incoming batch."""
    share = result.get("replay_incoming_share", [])[1:]
    return sum(share) / len(share) if share else None


SUMMARY_COLUMNS = (  # header, value of one run (None where a run lacks it)
    ("A_T (%)", lambda r: r.get("average_accuracy")),
    ("F_T (%)", lambda r: r.get("average_forgetting")),
    ("A_T, fitted bias (%)", lambda r: r.get("average_accuracy_bias_memory")),  # as the service serves it
    ("NCM A_T (%)", lambda r: r.get("average_accuracy_ncm")),
    ("NCM F_T (%)", lambda r: r.get("average_forgetting_ncm")),
    ("new-task acc. (%)", new_task_accuracy),
    ("replayed of incoming classes (%)", incoming_replay_share),
)


def cpu_seconds(result: dict) -> float | None:
    """A run's training CPU seconds with one frozen forward an image (the pretrained backbone's, as the
    service pays it; 0 from scratch)."""
    if result.get("train_cpu_seconds") is None:
        return None
    return result["train_cpu_seconds"] + result.get("frozen_forward_cpu_seconds", 0.0)


def anytime_at(point: str):
    """A run's accuracy on the classes seen so far once each new class has sent `point` images,
    averaged over the tasks (`clients.bench.stream.protocol.AnytimeProbe`)."""
    return lambda r: r.get("anytime", {}).get(point)


ANYTIME_COLUMNS = (  # how useful a young model is, and what the run cost
    *((f"anytime @{n} (%)", anytime_at(n)) for n in ("10", "100", "1000")),
    ("CPU s / run, step + frozen forward", cpu_seconds),
    ("memory (KB)", lambda r: r["memory_bytes"] / 1000 if r.get("memory_bytes") else None),
)


def stream_share(key: str):
    """A real-time run's share of the stream `key` (trained, skipped, thinned, unseen at its end), in %.

    >>> stream_share("skipped")({"realtime": {"skipped_share": 0.27}}), stream_share("skipped")({})
    (27.0, None)
    """
    def share(result: dict) -> float | None:
        value = result.get("realtime", {}).get(f"{key}_share")
        return None if value is None else 100 * value

    return share


REALTIME_COLUMNS = (  # the real-time protocol's: accuracy along the stream, and where the stream went
    ("anytime acc. (%)", lambda r: r.get("average_anytime_accuracy")),
    ("trained (%)", stream_share("trained")),
    ("skipped (%)", stream_share("skipped")),
    ("thinned (%)", stream_share("thinned")),
    ("unseen at the end (%)", stream_share("unseen")),
    ("rehearsal steps", lambda r: r["realtime"]["rehearsal_steps"] if r.get("realtime") else None),
    ("lean steps (%)", lambda r: 100 * r["realtime"].get("lean_steps", 0) / max(1, r.get("steps") or 0)
     if r.get("realtime") else None),
)


def paired_difference(a: dict[int, float], b: dict[int, float]) -> dict:
    """B - A over the seeds both have: mean, 95% paired t-interval half-width, wins of each."""
    seeds = sorted(set(a) & set(b))
    diffs = [b[s] - a[s] for s in seeds]
    mean, ci = mean_ci95(diffs) if diffs else (math.nan, math.nan)
    return {"seeds": len(seeds), "mean": mean, "ci95": ci, "wins_a": sum(d < 0 for d in diffs),
            "wins_b": sum(d > 0 for d in diffs), "seed_list": seeds}


def by_seed(rs: list[dict], key) -> dict[int, float]:
    """Each run's value of `key` (a result key, or a function of the result) by seed."""
    value = key if callable(key) else (lambda r: r.get(key))
    return {r["seed"]: value(r) for r in rs if value(r) is not None}


def comparisons(groups: dict[tuple, list[dict]], pairs: list[tuple[str, str]]) -> list[dict]:
    """Each pair (A, B) of configuration labels, compared within every (dataset, M) that has both (a
    configuration without a memory, such as a streaming head, against the other at each of its M)."""
    out = []
    for a_label, b_label in pairs:
        for (dataset, mem, label), a_runs in sorted(groups.items()):
            if label != a_label:
                continue
            matches = [(m, rs) for (d, m, lb), rs in sorted(groups.items())
                       if d == dataset and lb == b_label and (m == mem or not m or not mem)]
            for b_mem, b_runs in matches:
                out.append(_comparison(dataset, mem or b_mem, a_label, b_label, a_runs, b_runs))
    return out


def _comparison(dataset: str, mem: int, a_label: str, b_label: str, a_runs: list[dict], b_runs: list[dict]) -> dict:
    """B - A on the seeds both ran: A_T, NCM A_T, anytime accuracies, and B's cost relative to A's."""
    def paired(key) -> dict:
        return paired_difference(by_seed(a_runs, key), by_seed(b_runs, key))

    return {"dataset": dataset, "mem_size": mem, "a": a_label, "b": b_label,
            "accuracy": paired("average_accuracy"), "ncm": paired("average_accuracy_ncm"),
            "anytime": paired("average_anytime_accuracy"),
            **{f"anytime@{n}": paired(anytime_at(n)) for n in ("10", "100", "1000")},
            "cpu_ratio": cpu_ratio(a_runs, b_runs), "compute_ratio": compute_ratio(a_runs, b_runs)}


def device_kind(run: dict) -> str:
    """cpu or cuda: what a run's seconds were spent on (records older than the field ran on the CPU)."""
    return run.get("device", "cpu").split(":")[0]


def compute_ratio(a_runs: list[dict], b_runs: list[dict]) -> float:
    """B's mean training seconds over A's, over the seeds both ran on one kind of device: what B's difference costs.

    >>> compute_ratio([{"seed": 0, "train_seconds": 100.0}, {"seed": 1, "train_seconds": 300.0}],
    ...               [{"seed": 1, "train_seconds": 900.0}, {"seed": 2, "train_seconds": 5.0}])
    3.0
    >>> compute_ratio([{"seed": 1, "train_seconds": 300.0}], [{"seed": 1, "train_seconds": 30.0, "device": "cuda"}])
    nan
    """
    a, b = by_seed(a_runs, "train_seconds"), by_seed(b_runs, "train_seconds")
    a_device, b_device = ({r["seed"]: device_kind(r) for r in rs} for rs in (a_runs, b_runs))
    seeds = {s for s in set(a) & set(b) if a_device[s] == b_device[s]}
    return sum(b[s] for s in seeds) / sum(a[s] for s in seeds) if seeds else math.nan


def cpu_ratio(a_runs: list[dict], b_runs: list[dict]) -> float:
    """B's mean CPU seconds a run (`cpu_seconds`) over A's, over the seeds both have."""
    a, b = by_seed(a_runs, cpu_seconds), by_seed(b_runs, cpu_seconds)
    seeds = set(a) & set(b)
    return sum(b[s] for s in seeds) / sum(a[s] for s in seeds) if seeds else math.nan


