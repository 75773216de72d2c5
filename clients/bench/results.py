"""Benchmark result files: loading, naming a configuration, the summary table (mean ± 95%
t-interval over seeds, as the paper reports), paired comparisons between two configurations run
with the same seeds, and the plots.

>>> run_label({"method": "er", "settings": {"step": "separate", "loss": "ace"}})
'er (separate, ace)'
>>> d = paired_difference({1: 40.0, 2: 42.0, 3: 41.0}, {1: 43.0, 2: 44.0, 3: 43.5, 4: 50.0})
>>> d["seeds"], round(d["mean"], 2), d["wins_a"], d["wins_b"]
(3, 2.5, 0, 3)
"""

from __future__ import annotations

import json
import math
import tomllib
from collections import defaultdict
from pathlib import Path

from learner import METHODS
from learner.catch_up import MEMORY_SHARE
from learner.metrics import average_accuracy, average_forgetting, mean_ci95


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
    if settings.get("ema"):
        modes.append(f"ema {settings['ema']:g}")
    if settings.get("one_class_batches"):
        modes.append("one-class batches")
    if settings.get("replay_batch", 10) != 10:
        modes.append(f"replay {settings['replay_batch']}")
    if settings.get("feature_max_age", 100) != 100:  # fresh or staler features never pool with the default bound
        modes.append(f"age {settings['feature_max_age']}")
    if settings.get("train_per_class"):  # a reduced stream never pools with full-length runs
        modes.append(f"{settings['train_per_class']}/class")
    if backbone := settings.get("backbone"):  # the pretrained backbone: its input size, cut and latent bits
        modes.append(f"{backbone['backbone']} {backbone['input_size']}px cut {backbone['cut']}"
                     + (f" {backbone['latent_bits']}-bit" if backbone["latent_bits"] != 16 else ""))
    if settings.get("serving_head"):
        modes.append(f"serve {settings['serving_head']}")
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
    averaged over the tasks (`clients.bench.benchmark.AnytimeProbe`)."""
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


def load_paper(path: Path) -> dict:
    """A published table (e.g. `results/paper-table1.toml`): dataset -> method -> A_T as printed,
    one string for every M or a table of them by M."""
    return tomllib.loads(Path(path).read_text())


def paper_value(paper: dict, dataset: str, mem: int, label: str) -> str:
    """The published A_T of the configuration's method at this M, for cross-entropy runs under either
    step (the authors' code steps ER, MIR and GSS separately, ASER jointly); "" where none applies.

    >>> paper = {"cifar10": {"er": {"1000": "38.4 ± 1.7"}, "ewc": "17.9 ± 0.3"}}
    >>> [paper_value(paper, "cifar10", m, label) for m, label in
    ...  ((1000, "er"), (1000, "er (separate)"), (1000, "er (ace)"), (200, "er"), (0, "ewc"))]
    ['38.4 ± 1.7', '38.4 ± 1.7', '', '', '17.9 ± 0.3']
    """
    method = label.split(" (")[0]
    if label not in (method, f"{method} (separate)"):
        return ""
    row = paper.get(dataset, {}).get(method, "")
    return row if isinstance(row, str) else row.get(str(mem), "")


def summary_table(groups: dict[tuple, list[dict]], paper: dict | None = None) -> str:
    """One row per configuration; with `paper` (see `load_paper`) the published A_T beside ours."""
    order = {m: i for i, m in enumerate(METHODS)}
    realtime = any(r.get("realtime") for rs in groups.values() for r in rs)
    anytime = any(r.get("anytime") for rs in groups.values() for r in rs)
    columns = SUMMARY_COLUMNS + (REALTIME_COLUMNS if realtime else ()) + (ANYTIME_COLUMNS if anytime else ())
    headers = [h for h, _ in columns]
    if paper:  # beside our A_T
        headers.insert(1, "paper's A_T (%)")
    lines = [f"| dataset | M | configuration | seeds | {' | '.join(headers)} | train s / run |",
             "|---|---|---|---|" + "---|" * len(headers) + "---|"]
    for (dataset, mem, label), rs in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1],
                                                                           order.get(kv[0][2].split()[0], 99),
                                                                           kv[0][2])):
        def cell(value):  # a column some runs lack (added later, or not a replay method) says over how many
            vs = [v for v in map(value, rs) if v is not None]
            return fmt(vs) + (f" (n={len(vs)})" if vs and len(vs) < len(rs) else "")

        cells = [cell(value) for _, value in columns]
        if paper:
            cells.insert(1, paper_value(paper, dataset, mem, label) or "-")
        lines.append(f"| {dataset} | {mem or '-'} | {label} | {len(rs)} | {' | '.join(cells)} | {seconds_cell(rs)} |")
    note = ("Mean ± 95% CI (t-interval) over seeds; fitted bias: the same runs served with a logit bias per class "
            "fitted on the memory (ASER_SERVING_BIAS, the service's default); NCM: nearest class mean on the memory; "
            "new-task acc.: accuracy "
            "on each task right after it, tasks 2..T; replayed of incoming classes: share of the replayed samples "
            "whose class is in the incoming batch, tasks 2..T.")
    if paper:
        note += " Paper's A_T: its Table 1, for the method with cross-entropy under either step."
    if anytime:
        note += (" Anytime @N: accuracy on the classes seen so far once each new class has sent N images, over the "
                 "tasks; CPU s: the step's training CPU seconds plus, on the pretrained backbone, one frozen forward "
                 "an image; memory: the replay memory's stored bytes.")
    if realtime:
        note += (" Real time: anytime acc. is the accuracy on the classes seen so far at points along the stream; "
                 "thinned: skipped samples that did not reach the memory update either (learner.catch_up); "
                 "unseen at the end is the stream the learner had not reached when it ended (its lag).")
    return "\n".join(lines) + "\n\n" + note + "\n"


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


def seconds_cell(rs: list[dict]) -> str:
    """Mean training seconds, split by device where the runs used several (a GPU second is not a CPU second).

    >>> seconds_cell([{"train_seconds": 100.0}, {"train_seconds": 300.0}])
    '200'
    >>> seconds_cell([{"train_seconds": 1500.0}, {"train_seconds": 300.0, "device": "cuda"}])
    '1500 (cpu, 1); 300 (cuda, 1)'
    >>> seconds_cell([{"train_seconds": 300.0, "device": "cuda:0"}])
    '300 (cuda, 1)'
    """
    by_device: dict[str, list[float]] = {}
    for r in rs:
        by_device.setdefault(device_kind(r), []).append(r["train_seconds"])
    if list(by_device) == ["cpu"]:
        return f"{sum(by_device['cpu']) / len(rs):.0f}"
    return "; ".join(f"{sum(v) / len(v):.0f} ({d}, {len(v)})" for d, v in sorted(by_device.items()))


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


def _ratio(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{value:.2f}x"


def cpu_ratio(a_runs: list[dict], b_runs: list[dict]) -> float:
    """B's mean CPU seconds a run (`cpu_seconds`) over A's, over the seeds both have."""
    a, b = by_seed(a_runs, cpu_seconds), by_seed(b_runs, cpu_seconds)
    seeds = set(a) & set(b)
    return sum(b[s] for s in seeds) / sum(a[s] for s in seeds) if seeds else math.nan


def anytime_comparison_table(rows: list[dict]) -> str:
    """The pairs whose runs recorded anytime accuracy: each point's paired difference and the CPU ratio."""
    rows = [r for r in rows if r["anytime@10"]["seeds"]]
    if not rows:
        return ""
    lines = ["| dataset | M | A | B | B − A: anytime @10 | @100 | @1000 (pts) "
             "| B / A CPU s (step + frozen forward) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cells = [_signed(r[f"anytime@{n}"]) if r[f"anytime@{n}"]["seeds"] else "n/a" for n in ("10", "100", "1000")]
        lines.append(f"| {r['dataset']} | {r['mem_size'] or '-'} | {r['a']} | {r['b']} | {' | '.join(cells)} | "
                     f"{_ratio(r['cpu_ratio'])} |")
    return "\n".join(lines) + "\n\nPaired over the seeds both ran; anytime @N as in the summary.\n"


def comparison_table(rows: list[dict]) -> str:
    anytime = any(r["anytime"]["seeds"] for r in rows)  # real-time runs
    lines = ["| dataset | M | A | B | paired seeds | B − A: A_T (pts) | seeds A / B wins | B − A: NCM A_T (pts) "
             + ("| B − A: anytime acc. (pts) " if anytime else "") + "| B / A train time |",
             "|---|---|---|---|---|---|---|---|" + ("---|" if anytime else "") + "---|"]
    for r in rows:
        acc, ncm = r["accuracy"], r["ncm"]
        ncm_cell = "n/a" if not ncm["seeds"] else _signed(ncm) + (
            f" (n={ncm['seeds']})" if ncm["seeds"] != acc["seeds"] else "")  # NCM only in newer runs
        anytime_cell = (_signed(r["anytime"]) if r["anytime"]["seeds"] else "n/a") + " | " if anytime else ""
        lines.append(f"| {r['dataset']} | {r['mem_size'] or '-'} | {r['a']} | {r['b']} | {acc['seeds']} | "
                     f"{_signed(acc)} | {acc['wins_a']} / {acc['wins_b']} | {ncm_cell} | {anytime_cell}"
                     f"{_ratio(r['compute_ratio'])} |")
    return "\n".join(lines) + ("\n\nMean paired difference ± 95% paired t-interval over the seeds both ran; train time: "
                               "B's mean train seconds over A's on the seeds both ran on one kind of device.\n")


# the served average's corrections on the memory, each evaluated beside the average in every run with a memory
CORRECTIONS = {"recomputed BatchNorm statistics (--serving-bn memory)": "average_accuracy_bn_memory",
               "fitted logit bias (--serving-bias)": "average_accuracy_bias_memory"}


def corrections_table(results: list[dict]) -> str:
    """Each correction against the average as served, paired within each run that evaluated both
    (issue 37's rule 3): every run, then by memory size; "" if no run evaluated one.

    >>> runs = [{"dataset": "d", "mem_size": 10, "average_accuracy": a, "average_accuracy_bias_memory": a + d}
    ...         for a, d in ((40.0, 1.0), (42.0, 3.0), (41.0, 2.0))]
    >>> print(corrections_table(runs).splitlines()[2])
    | fitted logit bias (--serving-bias) | all | 3 | +2.00 ± 2.48 | 3 / 0 |
    >>> corrections_table([{"dataset": "d", "mem_size": 0, "average_accuracy": 20.0}])
    ''
    """
    lines = []
    for name, key in CORRECTIONS.items():
        runs = [r for r in results if r.get(key) is not None]
        if not runs:
            continue
        scopes = [("all", runs)] + [(f"{d} M={m}", [r for r in runs if (r["dataset"], r["mem_size"]) == (d, m)])
                                    for d, m in sorted({(r["dataset"], r["mem_size"]) for r in runs})]
        for scope, rs in scopes if len(scopes) > 2 else scopes[:1]:
            diff = paired_difference({i: r["average_accuracy"] for i, r in enumerate(rs)},
                                     {i: r[key] for i, r in enumerate(rs)})
            lines.append(f"| {name} | {scope} | {diff['seeds']} | {_signed(diff)} | "
                         f"{diff['wins_b']} / {diff['wins_a']} |")
    if not lines:
        return ""
    return ("| correction on the memory | scope | runs | − the average as served: A_T (pts) | runs above / below |\n"
            "|---|---|---|---|---|\n" + "\n".join(lines) +
            "\n\nPaired within each run (the same trained weights, served two ways); mean ± 95% t-interval.\n")


def _signed(d: dict) -> str:
    if d["seeds"] < 2:
        return f"{d['mean']:+.2f}" if d["seeds"] else "n/a"
    return f"{d['mean']:+.2f} ± {d['ci95']:.2f}"


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_accuracy(groups: dict, path: Path) -> None:
    """Average accuracy on the tasks observed so far, after each task (the paper's Figure 2)."""
    import numpy as np

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for (_dataset, mem, label), rs in sorted(groups.items()):
        curves = [[sum(row[: i + 1]) / (i + 1) for i, row in enumerate(r["accuracy_matrix"])] for r in rs
                  if len(r["accuracy_matrix"]) > 1]
        if not curves:
            continue
        arr = np.array(curves)
        x = np.arange(1, arr.shape[1] + 1)
        mean = arr.mean(0)
        ax.plot(x, mean, marker="o", label=f"{label} (M={mem})")
        if len(curves) > 1:
            ci = np.array([mean_ci95(list(arr[:, i]))[1] for i in range(arr.shape[1])])
            ax.fill_between(x, mean - ci, mean + ci, alpha=0.2)
        ax.set_xticks(x)
    ax.set_ylim(0, 100)
    ax.set_xlabel("tasks trained")
    ax.set_ylabel("average accuracy on observed tasks (%)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def plot_seeds(groups: dict, labels: list[str], path: Path, dataset: str, mem: int) -> None:
    """A_T per seed of the given configurations (one dataset and memory size), seeds on the x axis,
    so paired runs line up."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for label in labels:
        rs = sorted(groups.get((dataset, mem, label), []), key=lambda r: r["seed"])
        if rs:
            ax.plot([r["seed"] for r in rs], [r["average_accuracy"] for r in rs], marker="o", label=label)
    ax.set_xlabel("seed")
    ax.set_ylabel("A_T (%)")
    ax.set_title(f"{dataset}, M={mem}: final average accuracy per seed")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
