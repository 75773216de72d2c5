"""The paper's metrics on the accuracy matrix a[i][j]: test accuracy on task j after training
on tasks 1..i (0-based here).

>>> a = [[0.9, 0.0], [0.6, 0.8]]
>>> round(average_accuracy(a), 4), round(average_forgetting(a), 4)
(0.7, 0.3)
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def average_accuracy(matrix: Sequence[Sequence[float]]) -> float:
    """A_T = 1/T * sum_j a_{T,j}: the mean of the last row."""
    last = list(matrix[-1])
    return sum(last) / len(last)


def forgetting(matrix: Sequence[Sequence[float]], i: int, j: int) -> float:
    """f_{i,j} = max_{l < i} a_{l,j} - a_{i,j} (0-based i, j < i). The max runs from l = j: before task j
    is trained its classes score 0 in class-incremental learning (or are not scored: None), so the rows
    above it cannot raise the max."""
    if not 0 <= j < i < len(matrix):
        raise ValueError(f"forgetting needs 0 <= j < i < T, got i={i}, j={j}")
    return max(matrix[l][j] for l in range(j, i)) - matrix[i][j]


def average_forgetting(matrix: Sequence[Sequence[float]]) -> float:
    """F_T = 1/(T-1) * sum_{j<T} f_{T,j}; undefined (nan) for a single task."""
    t = len(matrix)
    if t < 2:
        return math.nan
    return sum(forgetting(matrix, t - 1, j) for j in range(t - 1)) / (t - 1)


def mean_ci95(values: Sequence[float]) -> tuple[float, float]:
    """Mean and half-width of the 95% t-interval over runs (as the paper reports)."""
    from scipy import stats

    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, math.nan
    return mean, float(stats.t.ppf(0.975, n - 1) * stats.sem(values))


def expected_calibration_error(probabilities, labels, bins: int = 15) -> float:
    """The gap between confidence and accuracy, averaged over `bins` equal-width bins of the top probability and
    weighted by their samples (Guo et al. 2017), in [0, 1].

    >>> import torch
    >>> sure = torch.tensor([[0.99, 0.01]] * 10)
    >>> round(expected_calibration_error(sure, torch.tensor([0] * 5 + [1] * 5)), 3)  # 99% sure, right half the time
    0.49
    """
    import torch

    confidence, answer = probabilities.max(1)
    right = (answer == labels).float()
    edges = torch.linspace(0, 1, bins + 1)
    gap = 0.0
    for low, high in zip(edges[:-1], edges[1:]):
        inside = (confidence > low) & (confidence <= high)
        if bool(inside.any()):
            gap += float(inside.float().mean()) * abs(float(confidence[inside].mean()) - float(right[inside].mean()))
    return gap


def brier_score(probabilities, labels) -> float:
    """The mean squared distance between the probabilities and the one-hot answer, summed over classes.

    >>> import torch
    >>> brier_score(torch.tensor([[1.0, 0.0], [0.5, 0.5]]), torch.tensor([0, 1]))
    0.25
    """
    import torch

    target = torch.nn.functional.one_hot(labels, probabilities.shape[1]).float()
    return float(((probabilities.float() - target) ** 2).sum(1).mean())


def auroc(known, unknown) -> float:
    """The area under the ROC curve of a score meant to be higher on `unknown` samples than on `known` ones: the
    chance that a random unknown scores above a random known (ties count half; Mann-Whitney's U over n1 n0).

    >>> import torch
    >>> auroc(torch.tensor([0.1, 0.2, 0.3]), torch.tensor([0.25, 0.9]))
    0.8333333333333334
    """
    import torch

    scores = torch.cat([torch.as_tensor(known), torch.as_tensor(unknown)]).double()
    ranks = torch.empty_like(scores)
    ordered, order = scores.sort()
    _, inverse, counts = torch.unique_consecutive(ordered, return_inverse=True, return_counts=True)
    ends = counts.cumsum(0).double()
    ranks[order] = (ends - (counts.double() - 1) / 2)[inverse]  # tied scores share their mean rank
    n0, n1 = len(known), len(unknown)
    return float((ranks[n0:].sum() - n1 * (n1 + 1) / 2) / (n1 * n0))
