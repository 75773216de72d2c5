"""Memory retrieval policies: random, MIR, ASV / ASV_mu (ASER), Dist / Dist_mu (appendix), and
ASV_mu confined to a class mix drawn at random (among the old classes; within each class)."""

from __future__ import annotations

from dataclasses import replace

import torch
from torch.nn import functional as F

from .policy import MemoryRetrieval
from .sampling import class_balanced_sample, exclude, random_sample
from .shapley import knn_shapley, pairwise_distances


class RandomRetrieval(MemoryRetrieval):
    name = "random"

    def retrieve(self, buffer, images, labels, n, ctx):
        return random_sample(ctx.eligible_slots(buffer), n, ctx.generator)


class MIRRetrieval(MemoryRetrieval):
    """Maximally Interfered Retrieval (Aljundi et al. 2019): from `n_subsample` random memory
    samples, the `n` whose loss grows most after a virtual SGD step on the incoming batch.

    As in the reference, losses use the batch statistics of BatchNorm (train mode); running
    statistics are left untouched by the virtual step and the scoring passes."""

    name = "mir"

    def __init__(self, n_subsample: int = 50):
        self.n_subsample = n_subsample

    def retrieve(self, buffer, images, labels, n, ctx):
        from torch.func import functional_call, grad

        sub = random_sample(ctx.eligible_slots(buffer), self.n_subsample, ctx.generator)
        if sub.numel() <= n:
            return sub
        model = ctx.model
        params = {k: v.detach() for k, v in model.named_parameters()}

        def loss(p, x, y, reduction="mean"):
            buffers = {k: v.detach().clone() for k, v in model.named_buffers()}
            return F.cross_entropy(functional_call(model, (p, buffers), (ctx.to_input(x),)), y, reduction=reduction)

        g = grad(loss)(params, images, labels.to(buffer.device))
        virtual = {k: params[k] - ctx.lr * g[k] for k in params}
        with torch.no_grad():
            x, y = buffer.images[sub], buffer.labels[sub]
            scores = loss(virtual, x, y, "none") - loss(params, x, y, "none")
        return sub[torch.sort(scores, descending=True, stable=True).indices[:n]]


class _LatentScoreRetrieval(MemoryRetrieval):
    """Shared frame of Algorithm 2: S_sub and the candidates are class-balanced subsamples of
    the memory (`per_class` of each class, candidates first, S_sub from the rest, as in the
    reference); the n candidates with the largest score are returned. Until the memory has
    been filled once, retrieval is random (reference behaviour). Memory features come from the
    per-slot cache when at most `max_age` optimizer steps old (0: the current weights only, as
    the paper computes them); the incoming batch's are always fresh."""

    def __init__(self, per_class: int, max_age: int = 0):
        self.per_class, self.max_age = per_class, max_age

    def retrieve(self, buffer, images, labels, n, ctx):
        slots = ctx.eligible_slots(buffer)
        if buffer.n_seen <= buffer.capacity:
            return random_sample(slots, n, ctx.generator)
        cand = class_balanced_sample(buffer.labels, slots, self.per_class, ctx.generator)
        if cand.numel() <= n:
            return cand
        scores = self.score_candidates(buffer, cand, slots, images, labels, ctx)
        return cand[torch.sort(scores, descending=True, stable=True).indices[:n]]

    def score_candidates(self, buffer, cand, slots, images, labels, ctx) -> torch.Tensor:
        """The candidates' scores against S_sub, a class-balanced sample of the other `slots`."""
        evals = class_balanced_sample(buffer.labels, exclude(slots, cand), self.per_class, ctx.generator)
        feats, batch_feats = ctx.latent.of(torch.cat([cand, evals]), images, self.max_age)
        scores = self.score(feats[: cand.numel()], buffer.labels[cand], feats[cand.numel():],
                            buffer.labels[evals], batch_feats, labels.to(buffer.device))
        ctx.stats["retrieval_scores"] = scores
        return scores

    def score(self, cand_f, cand_y, eval_f, eval_y, batch_f, batch_y) -> torch.Tensor:
        raise NotImplementedError


class ASVRetrieval(_LatentScoreRetrieval):
    """ASER retrieval. ASV, eq. (5): max_{j in S_sub} s_j(i) - min_{k in B_n} s_k(i);
    ASV_mu, eq. (6): mean over S_sub minus mean over B_n."""

    def __init__(self, k: int, per_class: int, mean: bool, max_age: int = 0):
        super().__init__(per_class, max_age)
        self.k, self.mean = k, mean
        self.name = "asv-mu" if mean else "asv"

    def score(self, cand_f, cand_y, eval_f, eval_y, batch_f, batch_y):
        coop = knn_shapley(eval_f, eval_y, cand_f, cand_y, self.k)  # [|S_sub|, N_c]
        adv = knn_shapley(batch_f, batch_y, cand_f, cand_y, self.k)  # [b, N_c]
        if self.mean:
            return _mean0(coop) - adv.mean(0)
        return _max0(coop) - adv.min(0).values


class DistRetrieval(_LatentScoreRetrieval):
    """Appendix B: Dist, eq. (B.1): -[min_{j in S_sub(i)} d(i,j) + min_{k in B_n} d(i,k)];
    Dist_mu, eq. (B.2), with means. S_sub(i) holds the members of S_sub labelled like i; a
    candidate whose class has no member there gets -inf."""

    def __init__(self, per_class: int, mean: bool):
        super().__init__(per_class)
        self.mean = mean
        self.name = "dist-mu" if mean else "dist"

    def score(self, cand_f, cand_y, eval_f, eval_y, batch_f, batch_y):
        d_eval = pairwise_distances(cand_f, eval_f)
        same = cand_y[:, None] == eval_y[None, :]
        d_batch = pairwise_distances(cand_f, batch_f)
        if self.mean:
            to_class = (d_eval * same).sum(1) / same.sum(1)
            to_batch = d_batch.mean(1)
        else:
            to_class = d_eval.masked_fill(~same, float("inf")).min(1).values if same.shape[1] else \
                torch.full((cand_f.shape[0],), float("inf"), device=cand_f.device)
            to_batch = d_batch.min(1).values
        return -torch.nan_to_num(to_class + to_batch, nan=float("inf"))


def _mean0(values: torch.Tensor) -> torch.Tensor:
    return values.mean(0) if values.shape[0] else values.new_zeros(values.shape[1])


def _max0(values: torch.Tensor) -> torch.Tensor:
    return values.max(0).values if values.shape[0] else values.new_zeros(values.shape[1])



class OldClassesBy(MemoryRetrieval):
    """Random retrieval's mix of incoming and old classes, with `choose` (ASV_mu) picking the old
    ones: n eligible slots drawn at random; those of the incoming batch's classes are replayed as
    drawn, and the rest of the n are chosen by `choose` among the slots of the other classes.

    ASV alone never replays an incoming class: a memory sample of the batch's own class is
    valuable to it, and eqs. (5)-(6) subtract that value. Under the ACE loss the replay is where a
    new class meets the old ones (the incoming term covers only the incoming classes), so without
    it the served model never answers the newest task (docs/results/asers-memory.md)."""

    def __init__(self, choose: MemoryRetrieval):
        self.choose = choose
        self.name = f"{choose.name}-old"

    def retrieve(self, buffer, images, labels, n, ctx):
        slots = ctx.eligible_slots(buffer)
        incoming = labels.to(buffer.device).unique()
        drawn = random_sample(slots, n, ctx.generator)
        kept = drawn[torch.isin(buffer.labels[drawn], incoming)]
        if kept.numel() == drawn.numel():
            return drawn
        old = torch.zeros(buffer.capacity, dtype=torch.bool, device=buffer.device)
        old[slots[~torch.isin(buffer.labels[slots], incoming)]] = True
        chosen = self.choose.retrieve(buffer, images, labels, drawn.numel() - kept.numel(), replace(ctx, eligible=old))
        return torch.cat([kept, chosen])


class WithinClassesBy(MemoryRetrieval):
    """Random retrieval's classes, with `choose` (ASV_mu) picking the members: n eligible slots
    drawn at random set how many of each class are replayed, and of each class the candidates
    `choose` scores highest go (its class-balanced candidates; the drawn members make up a class
    with fewer). As the balanced memory lets values decide only within a class: ASV_mu's top-n
    over all classes favoured a few old classes and let others go unreplayed (docs/results/asers-memory.md)."""

    def __init__(self, choose: _LatentScoreRetrieval):
        self.choose = choose
        self.name = f"{choose.name}-within"

    def retrieve(self, buffer, images, labels, n, ctx):
        slots = ctx.eligible_slots(buffer)
        drawn = random_sample(slots, n, ctx.generator)
        if buffer.n_seen <= buffer.capacity or drawn.numel() == 0:
            return drawn
        cand = class_balanced_sample(buffer.labels, slots, self.choose.per_class, ctx.generator)
        scores = self.choose.score_candidates(buffer, cand, slots, images, labels, ctx)
        ranked = cand[torch.sort(scores, descending=True, stable=True).indices]
        picked = []
        for c, k in zip(*buffer.labels[drawn].unique(return_counts=True)):
            best = ranked[buffer.labels[ranked] == c][:k]
            if best.numel() < k:
                best = torch.cat([best, exclude(drawn[buffer.labels[drawn] == c], best)[: k - best.numel()]])
            picked.append(best)
        return torch.cat(picked)
