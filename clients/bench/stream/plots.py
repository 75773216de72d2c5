"""The benchmark's plots: accuracy over tasks (the paper's Figure 2) and A_T per seed."""

from __future__ import annotations

from pathlib import Path

from learner.metrics import mean_ci95


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
