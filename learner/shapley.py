"""Exact KNN Shapley values (Jia et al. 2019), equations (3)-(4) of the ASER paper.

All evaluation points are valued at once: one distance matrix, one stable sort, one reversed
cumulative sum. No Python loop over points.

>>> import torch
>>> ev = torch.tensor([[0.0]])
>>> cand = torch.tensor([[1.0], [2.0], [3.0]])
>>> knn_shapley(ev, torch.tensor([0]), cand, torch.tensor([0, 1, 0]), k=1)
tensor([[ 0.8333, -0.1667,  0.3333]])
"""

from __future__ import annotations

import torch


def pairwise_distances(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Euclidean distances [len(a), len(b)] by the matmul form sqrt(|a|^2 + |b|^2 - 2 a.b):
    14x faster than explicit differences at 500 x 500 x 160 on one CPU thread (4 against 57
    ms), the bulk of a KNN-SV valuation. Points closer than float rounding may order either
    way; exact ties of small integer coordinates stay exact."""
    return torch.cdist(a, b, compute_mode="use_mm_for_euclid_dist")


def knn_shapley(
    eval_feats: torch.Tensor,
    eval_labels: torch.Tensor,
    cand_feats: torch.Tensor,
    cand_labels: torch.Tensor,
    k: int,
) -> torch.Tensor:
    """KNN-SV s_j(i) of every candidate i with respect to every evaluation point j.

    The utility is eq. (2): v_j(S) = 1/K * sum over the min(K, |S|) nearest members of S of
    1[y = y_j]. Distances are Euclidean; ties are broken by candidate index, lower first.

    Returns a float tensor [n_eval, n_cand] on the features' device.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    n_eval, n_cand = eval_feats.shape[0], cand_feats.shape[0]
    dtype = eval_feats.dtype if eval_feats.is_floating_point() else torch.float32
    if n_eval == 0 or n_cand == 0:
        return torch.zeros(n_eval, n_cand, dtype=dtype, device=eval_feats.device)
    dist = pairwise_distances(eval_feats.to(dtype), cand_feats.to(dtype))
    order = torch.sort(dist, dim=1, stable=True).indices  # alpha_1..alpha_N per eval point
    match = (cand_labels[order] == eval_labels[:, None]).to(dtype)

    # increments[m] = s(alpha_m) - s(alpha_{m+1}) of eq. (4), m = 1..N-1 (1-based);
    # the last entry is the base case eq. (3). Eq. (3) reads 1[y]/N, which assumes N >= K;
    # the exact base case is 1[y] * min(K, N) / (K * N), equal to eq. (3) when N >= K.
    rank = torch.arange(1, n_cand + 1, dtype=dtype, device=eval_feats.device)
    factor = torch.clamp(rank, max=k) / (k * rank)
    increments = torch.empty_like(match)
    increments[:, :-1] = (match[:, :-1] - match[:, 1:]) * factor[:-1]
    increments[:, -1] = match[:, -1] * factor[-1]
    sorted_values = increments.flip(1).cumsum(1).flip(1)

    values = torch.empty_like(sorted_values)
    values.scatter_(1, order, sorted_values)
    return values
