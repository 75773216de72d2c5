"""Heads that learn from a stream without replay: the nearest class mean and streaming LDA.

On frozen features both are exact whatever the order of the stream: they keep sufficient
statistics (counts, class sums, the sum of outer products), update them in O(b d^2) a batch of b,
and solve only when a served head is asked for (`head()`). Classes may arrive at any time, in any
number (unlike Avalanche's StreamingLDA, which fixes the class count up front and inverts a
d x d matrix after every sample).

Streaming LDA (Hayes & Kanan, CVPR-W 2020) with one shared covariance: the within-class scatter is
S_w = sum x x^T - sum_c s_c s_c^T / n_c, exactly that of the data seen so far; the served head is
the linear one w_c = P mu_c, b_c = -mu_c^T P mu_c / 2 with P = (S_w / N + shrinkage I)^-1. As served
(`HEADS["slda"]`) the shrinkage is OAS's, the bias is debiased for a class mean's noise, and a class
younger than YOUNG_CLASS samples is answered by the nearest class mean: what a young service needs.

>>> import torch
>>> g = torch.Generator().manual_seed(0)
>>> x = torch.cat([torch.randn(50, 4, generator=g) + 3, torch.randn(50, 4, generator=g) - 3])
>>> y = torch.tensor([2] * 50 + [5] * 50)
>>> lda = StreamingLDA(dim=4)
>>> for i in range(0, 100, 10):
...     lda.update(x[i:i + 10], y[i:i + 10])
>>> lda.classes(), (lda.head().predict(x) == y).float().mean().item()
([2, 5], 1.0)
>>> ncm = StreamingClassMeans(dim=4)
>>> ncm.update(x, y)
>>> (ncm.head().predict(x) == y).float().mean().item()
1.0
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LinearHead:
    """A solved head: logits = x W^T + b over its `class_ids`; unseen classes get no row."""
    class_ids: torch.Tensor  # [c]
    weight: torch.Tensor  # [c, d]
    bias: torch.Tensor  # [c]

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        return features.to(self.weight.dtype) @ self.weight.T + self.bias

    def predict(self, features: torch.Tensor) -> torch.Tensor:
        return self.class_ids[self.logits(features).argmax(1)]

    def full_logits(self, features: torch.Tensor, num_classes: int, margin: float = 1e4) -> torch.Tensor:
        """Logits over class ids 0..num_classes-1; a class this head has not seen (or forgot) gets its
        row's lowest logit less `margin` (LDA's logits may lie far below zero: a fixed fill could win)."""
        logits = self.logits(features).float()
        floor = (logits.min(1).values if logits.shape[1] else torch.zeros(len(features))) - margin
        out = floor[:, None].expand(-1, num_classes).clone()
        out[:, self.class_ids] = logits
        return out


class StreamingClassMeans:
    """Class sums, counts and sums of squared norms; the head is the nearest class mean in Euclidean
    distance, written as a linear head (w_c = mu_c, b_c = -|mu_c|^2 / 2). `debiased`: a class mean of
    n samples overstates |mu_c|^2 by the within-class variance tr(S_w) / n on average, which keeps a
    young class from ever winning; the bias takes that back (b_c = -(|mu_c|^2 - tr(S_w) / n_c) / 2)."""

    def __init__(self, dim: int, debiased: bool = True):
        self.dim, self.debiased = dim, debiased
        self.sums = torch.zeros(0, dim, dtype=torch.float64)
        self.counts = torch.zeros(0, dtype=torch.float64)
        self.squares = torch.zeros(0, dtype=torch.float64)  # per class, the sum of |x|^2

    def update(self, features: torch.Tensor, labels: torch.Tensor, weight: float = 1.0) -> None:
        """Add the samples to the statistics; `weight` -1 takes samples added before out again, exactly (a
        sample's label found wrong: `remove`)."""
        self._grow(int(labels.max()) + 1)
        x, labels = features.detach().to("cpu", torch.float64), labels.cpu()
        self.sums.index_add_(0, labels, x, alpha=weight)
        self.counts.index_add_(0, labels, torch.ones(len(labels), dtype=torch.float64), alpha=weight)
        self.squares.index_add_(0, labels, (x * x).sum(1), alpha=weight)

    def remove(self, features: torch.Tensor, labels: torch.Tensor) -> None:
        """Take out samples `update` added with these labels, as if they had never come.

        >>> lda = StreamingLDA(dim=2)
        >>> lda.update(torch.tensor([[1.0, 0.0], [0.0, 1.0], [2.0, 2.0]]), torch.tensor([0, 0, 1]))
        >>> before = lda.state_dict()
        >>> lda.update(torch.tensor([[5.0, 5.0]]), torch.tensor([0]))
        >>> lda.remove(torch.tensor([[5.0, 5.0]]), torch.tensor([0]))
        >>> all(torch.allclose(before[k], v) for k, v in lda.state_dict().items())
        True
        """
        self.update(features, labels, weight=-1.0)

    def _grow(self, n: int) -> None:
        if n > len(self.counts):
            extra = n - len(self.counts)
            self.sums = torch.cat([self.sums, torch.zeros(extra, self.dim, dtype=torch.float64)])
            self.counts = torch.cat([self.counts, torch.zeros(extra, dtype=torch.float64)])
            self.squares = torch.cat([self.squares, torch.zeros(extra, dtype=torch.float64)])

    def classes(self) -> list[int]:
        return torch.nonzero(self.counts > 0).flatten().tolist()

    def solve_due(self, solved_counts: torch.Tensor | None) -> bool:
        """Whether a head solved when the class counts were `solved_counts` is out of date: for the
        class means, whenever a sample came (solving costs a division)."""
        return solved_counts is None or not torch.equal(solved_counts, self.counts)

    def youngest(self) -> int:
        """The fewest samples any class seen (and not forgotten) has had; 0 before any."""
        seen = self.counts[self.counts > 0]
        return int(seen.min()) if len(seen) else 0

    def forget(self, class_id: int) -> None:
        if class_id < len(self.counts):
            self.sums[class_id], self.counts[class_id], self.squares[class_id] = 0, 0, 0

    def means(self) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.nonzero(self.counts > 0).flatten()
        return ids, self.sums[ids] / self.counts[ids, None]

    def within_variance(self) -> float:
        """tr(S_w): the summed within-class variance of the features seen, over all of them."""
        ids = torch.nonzero(self.counts > 0).flatten()
        n = float(self.counts[ids].sum())
        scatter = self.squares[ids] - (self.sums[ids] ** 2).sum(1) / self.counts[ids]
        return float(scatter.sum()) / max(n, 1.0)

    def head(self) -> LinearHead:
        ids, mu = self.means()
        norms = (mu * mu).sum(1)
        if self.debiased:
            norms = norms - self.within_variance() / self.counts[ids]
        return LinearHead(ids, mu.float(), (-norms / 2).float())

    def state_dict(self) -> dict:
        return {"sums": self.sums.clone(), "counts": self.counts.clone(), "squares": self.squares.clone()}

    def load_state_dict(self, state: dict) -> None:
        self.sums, self.counts, self.squares = state["sums"].clone(), state["counts"].clone(), state["squares"].clone()


def oas_shrinkage(covariance: torch.Tensor, n: float) -> float:
    """The Oracle Approximating Shrinkage weight (Chen et al. 2010; scikit-learn's `oas`) of an
    empirical covariance from `n` samples: how far to pull it towards mu I, mu its mean variance."""
    p = covariance.shape[0]
    mu = float(torch.trace(covariance)) / p
    flat = covariance.flatten()
    alpha = float(torch.dot(flat, flat)) / flat.numel()  # the mean of its squares, without a d x d temporary
    den = (n + 1.0) * (alpha - mu ** 2 / p)
    return 1.0 if den <= 0 else min((alpha + mu ** 2) / den, 1.0)


class StreamingLDA(StreamingClassMeans):
    """Class means plus the sum of outer products: linear discriminant analysis with one shared,
    shrunk covariance. `shrinkage`: a constant added to the covariance's diagonal (Hayes & Kanan use
    1e-4), or "oas": the covariance pulled towards its mean variance by the OAS weight, large while
    few samples are in. `debiased`: as the class means' bias, in the covariance's metric
    (b_c = -(mu_c^T P mu_c - tr(P S_w) / n_c) / 2). `young`: while a class has fewer samples than
    this, its mean is too rough for the covariance's metric and the nearest class mean answers
    (chosen where the two crossed on seed 0's stream: docs/results/pretrained.md)."""

    def __init__(self, dim: int, shrinkage: float | str = 1e-4, debiased: bool = False, young: int = 0):
        super().__init__(dim, debiased)
        self.shrinkage, self.young = shrinkage, young
        self.outer = torch.zeros(dim, dim, dtype=torch.float64)

    def update(self, features: torch.Tensor, labels: torch.Tensor, weight: float = 1.0) -> None:
        super().update(features, labels, weight)
        x = features.detach().to("cpu", torch.float64)
        self.outer.addmm_(x.T, x, alpha=weight)

    def forget(self, class_id: int) -> None:
        # the shared covariance keeps the forgotten class's scatter: it describes the features, not the
        # class (only the class's own outer products could take it out, d^2 numbers a class)
        super().forget(class_id)

    def covariance(self) -> torch.Tensor:
        """S_w / N, written into one new d x d matrix (a small device holds few of them)."""
        ids = torch.nonzero(self.counts > 0).flatten()
        n = self.counts[ids].sum()
        sums = self.sums[ids]
        covariance = self.outer.clone().addmm_((sums / self.counts[ids, None]).T, sums, alpha=-1.0)
        return covariance.div_(max(float(n), 1.0))

    def solve_due(self, solved_counts: torch.Tensor | None) -> bool:
        """Solving costs O(d^3) (0.1-0.2 s at d = 1280 on one core): a solved head stays until a class
        comes or goes, some class has grown by CLASS_GROWTH (a young class's mean moves fast) or
        all of them by TOTAL_GROWTH (the pooled covariance moves slowly); while the class means answer
        (a class is young), whenever a sample came, as theirs."""
        if solved_counts is None or len(solved_counts) != len(self.counts):
            return True
        seen = self.counts > 0
        if not torch.equal(solved_counts > 0, seen):
            return True
        if self.young and bool(seen.any()) and float(solved_counts[seen].min()) < self.young:
            return not torch.equal(solved_counts, self.counts)
        return bool(self.counts.sum() > solved_counts.sum() * (1 + TOTAL_GROWTH)
                    or (self.counts[seen] > solved_counts[seen] * (1 + CLASS_GROWTH)).any())

    def head(self) -> LinearHead:
        ids, mu = self.means()
        if len(ids) == 0 or (self.young and float(self.counts[ids].min()) < self.young):
            return super().head()
        shrunk = self.covariance()  # shrunk in place below: at most two d x d matrices at once beside `outer`
        rho, variance = 0.0, 0.0
        if self.shrinkage == "oas":
            rho, variance = oas_shrinkage(shrunk, float(self.counts[ids].sum())), float(torch.trace(shrunk)) / self.dim
            shrunk.mul_(1 - rho).diagonal().add_(rho * variance)
        else:
            shrunk.diagonal().add_(self.shrinkage)
        factor = torch.linalg.cholesky(shrunk)  # P = shrunk^-1, symmetric positive definite
        del shrunk
        weight = torch.cholesky_solve(mu.T, factor).T  # [c, d] = mu_c^T P
        norms = (weight * mu).sum(1)
        if self.debiased:
            norms = norms - self._trace_p_cov(factor, rho, variance) / self.counts[ids]
        return LinearHead(ids, weight.float(), (-norms / 2).float())

    def _trace_p_cov(self, factor: torch.Tensor, rho: float, variance: float) -> float:
        """tr(P S_w / N) without forming P S_w: shrunk = (1 - rho) cov + s I, so tr(P cov) =
        (d - s tr(P)) / (1 - rho)."""
        s = rho * variance if self.shrinkage == "oas" else float(self.shrinkage)
        if rho >= 1.0:
            return float(self.dim)  # shrunk is s I with s the mean variance: tr(cov) / s = d
        # tr(P) in float32: half the time of float64's inverse, a bias term's relative 1e-6
        return (self.dim - s * float(torch.cholesky_inverse(factor.float()).diagonal().sum())) / (1 - rho)

    def state_dict(self) -> dict:
        return {**super().state_dict(), "outer": self.outer.clone()}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.outer = state["outer"].clone()


# when a solved streaming LDA head is solved again (`StreamingLDA.solve_due`): Split EuroSAT's A_T and anytime accuracy
# were the same as with a head solved at every sample (docs/results/speed-and-memory.md)
TOTAL_GROWTH, CLASS_GROWTH = 0.05, 0.25
YOUNG_CLASS = 30  # samples below which a class's mean is too rough for LDA's metric (`StreamingLDA.young`)
HEADS = {
    "ncm": lambda dim: StreamingClassMeans(dim, debiased=True),
    "ncm-plain": lambda dim: StreamingClassMeans(dim, debiased=False),
    # streaming LDA as served: OAS shrinkage, the debiased bias, the class means while a class is young
    "slda": lambda dim: StreamingLDA(dim, "oas", debiased=True, young=YOUNG_CLASS),
    "slda-oas": lambda dim: StreamingLDA(dim, "oas"),
    "slda-plain": lambda dim: StreamingLDA(dim, 1e-4),  # Hayes & Kanan's
}


def make_head(name: str, dim: int) -> StreamingClassMeans:
    if name not in HEADS:
        raise ValueError(f"unknown streaming head {name!r}; choose one of {', '.join(HEADS)}")
    return HEADS[name](dim)
