"""The benchmark's markdown tables: the summary (mean ± 95% t-interval over seeds, as the paper
reports), every run's A_T by seed, paired comparisons, and the serving corrections.

>>> from clients.bench.results import group
>>> runs = [{"dataset": "d", "mem_size": 10, "method": "er", "seed": s, "average_accuracy": a}
...         for s, a in ((0, 40.0), (1, 42.5))]
>>> print(seeds_table(group(runs)).splitlines()[2])
| d | 10 | er | 40.00 | 42.50 |
"""

from __future__ import annotations

import math
import tomllib
from pathlib import Path

from clients.bench.results import (
    ANYTIME_COLUMNS,
    REALTIME_COLUMNS,
    SUMMARY_COLUMNS,
    device_kind,
    fmt,
    paired_difference,
)
from clients.bench.stream.noise import REVIEW_SHARES
from learner import METHODS


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


def _ratio(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{value:.2f}x"


def candidates_table(groups: dict[tuple, list[dict]]) -> str:
    """Under a measured head choice (`--choose-head`), each candidate head's A_T and anytime @10, and what the
    served answer, the top and the mean add to streaming LDA, paired within each run; "" without such runs.

    >>> run = lambda a, s, t, m: {"average_accuracy": a, "average_accuracy_slda": s, "average_accuracy_top": t,
    ...     "average_accuracy_mix": m, "anytime": {"10": a}, "anytime_slda": {"10": s}}
    >>> row = candidates_table({("d", 10, "x"): [run(91.0, 90.0, 89.0, 92.0), run(92.0, 90.5, 90.0, 93.0)]})
    >>> row.splitlines()[2].split(" | ")[3:]  # served, LDA, top, mean; served, top, mean − LDA; anytime @10
    ['91.5 ± 6.4', '90.2 ± 3.2', '89.5 ± 6.4', '92.5 ± 6.4', '+1.25 ± 3.18', '-0.75 ± 3.18', '+2.25 ± 3.18', '+1.25 ± 3.18 |']
    """
    rows = [(key, rs) for key, rs in sorted(groups.items()) if all("average_accuracy_slda" in r for r in rs)]
    if not rows:
        return ""
    lines = ["| dataset | configuration | seeds | served A_T | streaming LDA | the top | their mean "
             "| served − LDA | top − LDA | mean − LDA | served − LDA: anytime @10 |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for (dataset, _, label), rs in rows:
        values = {h: [r[f"average_accuracy{h}"] for r in rs] for h in ("", "_slda", "_top", "_mix")}
        lda = dict(enumerate(values["_slda"]))
        diffs = [_signed(paired_difference(lda, dict(enumerate(values[h])))) for h in ("", "_top", "_mix")]
        anytime = paired_difference({i: r["anytime_slda"]["10"] for i, r in enumerate(rs)},
                                    {i: r["anytime"]["10"] for i, r in enumerate(rs)})
        lines.append(f"| {dataset} | {label} | {len(rs)} | {' | '.join(fmt(v) for v in values.values())} | "
                     f"{' | '.join(diffs)} | {_signed(anytime)} |")
    return "\n".join(lines) + ("\n\nEvery candidate scored at each evaluation of the same run (A_T in %); differences "
                               "paired within runs, mean ± 95% t-interval.\n")


def noise_table(groups: dict[tuple, list[dict]]) -> str:
    """Runs on a noisy stream (`--label-noise`): how noisy the memory ended, how well its most suspected samples
    find the flips, the valuation's CPU, and the served accuracy at the end before and after the flipped samples
    found are relabelled; "" without such runs.

    >>> run = lambda p, a, b: {"label_noise": {"memory": 1000, "memory_flipped": 170, "precision_at_100": p,
    ...     "recall_at_100": p / 2, "precision_below_zero": 0.8, "recall_below_zero": 0.7, "suspects_cpu_seconds": 0.06,
    ...     "final_accuracy": a, "final_accuracy_corrected": b}}
    >>> noise_table({("d", 10, "x"): [run(0.84, 92.0, 92.1), run(0.80, 92.5, 92.5)]}).splitlines()[2].split(" | ")[3:6]
    ['17.0 ± 0.0', '82.0 ± 25.4', '41.0 ± 12.7']
    """
    rows = [(key, [r["label_noise"] for r in rs]) for key, rs in sorted(groups.items())
            if all("memory" in r.get("label_noise", {}) for r in rs)]
    if not rows:
        return ""
    lines = ["| dataset | configuration | seeds | memory flipped (%) | precision @100 (%) | recall @100 (%) "
             "| precision, value < 0 (%) | recall, value < 0 (%) | valuation CPU s | A_T at the end "
             "| after relabelling the flips found (pts) | the stream: precision, value < 0 (%) | recall (%) "
             "| after relabelling its flips found too (pts) | its valuation CPU s |"
             + "".join(f" lowest {share:.0%} reviewed: recall (%), after (pts) |" for share in REVIEW_SHARES),
             "|---" * (15 + len(REVIEW_SHARES)) + "|"]
    for (dataset, _, label), ns in rows:
        pct = lambda key: fmt([100 * n[key] for n in ns])  # noqa: E731
        gain = _gain_over_noisy_end(ns, lambda n: n["final_accuracy_corrected"])
        flipped = fmt([100 * n["memory_flipped"] / n["memory"] for n in ns])
        stream = "| – | – | – | – |" + " – |" * len(REVIEW_SHARES)
        if all("stream_precision" in n for n in ns):
            more = _gain_over_noisy_end(ns, lambda n: n["final_accuracy_stream_corrected"])
            stream = (f"| {pct('stream_precision')} | {pct('stream_recall')} | {_signed(more)} "
                      f"| {fmt([n['stream_valuation_cpu_seconds'] for n in ns])} |")
            stream += "".join(f" {_review_cell(ns, i)} |" for i in range(len(REVIEW_SHARES)))
        lines.append(f"| {dataset} | {label} | {len(ns)} | {flipped} | {pct('precision_at_100')} "
                     f"| {pct('recall_at_100')} | {pct('precision_below_zero')} | {pct('recall_below_zero')} "
                     f"| {fmt([n['suspects_cpu_seconds'] for n in ns])} | {fmt([n['final_accuracy'] for n in ns])} "
                     f"| {_signed(gain)} {stream}")
    return "\n".join(lines) + ("\n\nThe memory's samples valued against each other (mean KNN-SV, the sample left "
                               "out); precision and recall of the flips among the 100 most suspected and among those "
                               "below zero; the stream: every sample sent valued for the memory as it ended, and the "
                               "flipped ones below zero relabelled after the memory's, then a deeper review (the "
                               "flips among the stream's lowest-valued shares); mean ± 95% t-interval over seeds.\n")


def _review_cell(ns: list[dict], stage: int) -> str:
    """A deeper review's stage: its recall and the served accuracy's paired gain over the noisy end ("–" where a run
    has no such stage: it came before the review was recorded)."""
    if not all(len(n.get("stream_review", [])) > stage for n in ns):
        return "–"
    gain = _gain_over_noisy_end(ns, lambda n: n["stream_review"][stage]["final_accuracy"])
    return f"{fmt([100 * n['stream_review'][stage]['recall'] for n in ns])}, {_signed(gain)}"


def _gain_over_noisy_end(ns: list[dict], after) -> dict:
    """The served accuracy after a correction (`after` of a run's noise record) less the noisy end, paired by run."""
    return paired_difference({i: n["final_accuracy"] for i, n in enumerate(ns)},
                             {i: after(n) for i, n in enumerate(ns)})


def _signed(d: dict) -> str:
    if d["seeds"] < 2:
        return f"{d['mean']:+.2f}" if d["seeds"] else "n/a"
    return f"{d['mean']:+.2f} ± {d['ci95']:.2f}"


def seeds_table(groups: dict[tuple, list[dict]]) -> str:
    """Each configuration's A_T on every seed it ran (a blank where it did not): the lists the
    summary's intervals come from, for pairing by eye and for the docs to link rather than copy."""
    seeds = sorted({r["seed"] for rs in groups.values() for r in rs})
    lines = [f"| dataset | M | configuration | {' | '.join(f'seed {s}' for s in seeds)} |",
             "|---|---|---|" + "---|" * len(seeds)]
    for (dataset, mem, label), rs in sorted(groups.items()):
        by = {r["seed"]: r["average_accuracy"] for r in rs}
        cells = [f"{by[s]:.2f}" if s in by else "" for s in seeds]
        lines.append(f"| {dataset} | {mem or '-'} | {label} | {' | '.join(cells)} |")
    return "\n".join(lines) + "\n"
