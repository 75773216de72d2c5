"""Memory update policies: reservoir sampling, KNN-SV (ASER), GSS greedy."""

from __future__ import annotations

import torch
from torch.nn import functional as F

from ..networks.reduced_resnet import scale_pixels
from .buffer import ReplayBuffer
from .policy import MemoryUpdate, StepContext
from .sampling import class_balanced_sample, exclude, random_sample
from .shapley import knn_shapley


class ReservoirUpdate(MemoryUpdate):
    """Vitter's algorithm R, one sample at a time: after n samples each is kept w.p. M/n.

    >>> import torch
    >>> buf = ReplayBuffer(2, (1, 1, 1))
    >>> ctx = type("C", (), {"generator": torch.Generator().manual_seed(0)})()
    >>> ReservoirUpdate().update(buf, torch.zeros(5, 1, 1, 1, dtype=torch.uint8), torch.arange(5), ctx)
    >>> len(buf), buf.n_seen
    (2, 5)
    """

    name = "reservoir"

    def update(self, buffer: ReplayBuffer, images: torch.Tensor, labels: torch.Tensor, ctx: StepContext) -> None:
        used = buffer.append(images, labels).numel()
        buffer.n_seen += used
        rest = images.shape[0] - used
        if rest <= 0 or buffer.capacity == 0:
            buffer.n_seen += max(rest, 0)
            return
        # the t-th sample of the stream (1-based) draws j uniform in [0, t) and replaces slot j if j < M
        t = buffer.n_seen + torch.arange(1, rest + 1, dtype=torch.float64)
        j = (torch.rand(rest, generator=ctx.generator, dtype=torch.float64) * t).long()
        buffer.n_seen += rest
        chosen = torch.nonzero(j < buffer.capacity).flatten()
        if chosen.numel() == 0:
            return
        slots = j[chosen]
        # when two samples of one batch draw the same slot, the later one wins, as if sequential
        _, inverse = torch.unique(slots, return_inverse=True)
        last = torch.full((int(inverse.max()) + 1,), -1, dtype=torch.long)
        last = last.scatter_reduce(0, inverse, torch.arange(slots.numel()), "amax")
        src = chosen[last] + used
        buffer.write(slots[last], images[src], labels[src])


class KNNShapleyUpdate(MemoryUpdate):
    """"Memory Update Based on KNN-SV" (Section ASER), as the reference implementation does it.

    While the memory has room, samples are appended. Once full, S_sub (`per_class` samples of
    every class in memory) is the evaluation set and `n_candidates` random other memory
    samples plus the incoming batch are the candidates; incoming samples whose mean KNN-SV
    ranks among the top |candidates from memory| replace the memory candidates that rank
    below them. Classes new to the memory would get no positive value from S_sub, so
    incoming samples of classes holding less than a random share u ~ U(0, 1/C) of the memory
    also join the evaluation set (the reference's "minority class" rule).
    """

    name = "knn-sv"

    def __init__(self, k: int, per_class: int, n_candidates: int):
        self.k, self.per_class, self.n_candidates = k, per_class, n_candidates

    def update(self, buffer: ReplayBuffer, images: torch.Tensor, labels: torch.Tensor, ctx: StepContext) -> None:
        used = buffer.append(images, labels).numel()
        buffer.n_seen += used
        images, labels = images[used:], labels[used:]
        if images.shape[0] == 0 or not buffer.is_full:
            return
        buffer.n_seen += images.shape[0]
        filled = torch.arange(buffer.size, device=buffer.device)
        eval_slots = class_balanced_sample(buffer.labels, filled, self.per_class, ctx.generator)
        cand_slots = random_sample(exclude(filled, eval_slots), self.n_candidates, ctx.generator)

        labels = labels.to(buffer.device)
        threshold = torch.rand((), generator=ctx.generator).item() / max(ctx.num_classes, 1)
        counts = torch.bincount(buffer.labels[: buffer.size], minlength=ctx.num_classes).to(torch.float32)
        share = counts[labels] / buffer.capacity if labels.numel() else counts[:0]
        minority = share < threshold

        both = torch.cat([eval_slots, cand_slots])
        feats, new_feats = ctx.latent.of(both, images)
        eval_feats, cand_feats = feats[: eval_slots.numel()], feats[eval_slots.numel():]
        ev_f = torch.cat([eval_feats, new_feats[minority]])
        ev_y = torch.cat([buffer.labels[eval_slots], labels[minority]])
        ca_f = torch.cat([cand_feats, new_feats])
        ca_y = torch.cat([buffer.labels[cand_slots], labels])
        values = knn_shapley(ev_f, ev_y, ca_f, ca_y, self.k).sum(0)  # sum ranks as the mean does

        n_mem = cand_slots.numel()
        order = torch.sort(values, descending=True, stable=True).indices
        top, bottom = order[:n_mem], order[n_mem:]
        incoming = top[top >= n_mem] - n_mem  # incoming samples that made the top
        evicted = cand_slots[bottom[bottom < n_mem]]  # memory candidates that fell below
        ctx.stats["replaced"] = int(incoming.numel())
        if incoming.numel():
            buffer.write(evicted, images[incoming], labels[incoming], new_feats[incoming], ctx.latent.version)


class GSSGreedyUpdate(MemoryUpdate):
    """GSS-Greedy (Aljundi et al. 2019) as in the reference: keep a memory whose gradients are
    diverse. Each slot holds a score, its sample's maximal cosine similarity to gradients of
    `n_batches` random memory batches of `batch_size`; a batch dissimilar to the memory
    (max similarity < 0) replaces slots drawn in proportion to their score."""

    name = "gss"

    def __init__(self, n_batches: int = 10, batch_size: int = 10):
        self.n_batches, self.batch_size = n_batches, batch_size
        self.scores: torch.Tensor | None = None

    def state_dict(self) -> dict:
        return {"scores": None if self.scores is None else self.scores.cpu()}

    def load_state_dict(self, state: dict) -> None:
        self.scores = state["scores"]

    def update(self, buffer: ReplayBuffer, images: torch.Tensor, labels: torch.Tensor, ctx: StepContext) -> None:
        if self.scores is None or self.scores.numel() != buffer.capacity:
            self.scores = torch.zeros(buffer.capacity, device=buffer.device)
        self.scores = self.scores.to(buffer.device)  # a state restored from another device
        labels = labels.to(buffer.device)
        grads = _Gradients(ctx)
        if not buffer.is_full:
            n = min(buffer.capacity - buffer.size, images.shape[0])
            images, labels = images[:n], labels[:n]
            if buffer.size == 0:
                sims = torch.full((n,), 0.1, device=buffer.device)
            else:
                sims = _max_cosine(grads.per_sample(images, labels), self._memory_grads(buffer, grads, ctx))
            slots = buffer.append(images, labels)
            self.scores[slots] = sims
            buffer.n_seen += n
            return
        buffer.n_seen += images.shape[0]
        mem_grads = self._memory_grads(buffer, grads, ctx)
        batch_sim = _max_cosine(grads.of_batch(images, labels)[None], mem_grads)[0]
        ctx.stats["gss_batch_sim"] = float(batch_sim)
        if batch_sim >= 0:
            return
        score = self.scores[: buffer.size]
        weights = (score - score.min()) / (score.max() - score.min() + 0.01)
        n = images.shape[0]
        slots = torch.multinomial(weights.cpu(), n, replacement=False, generator=ctx.generator).to(buffer.device)
        item_sim = _max_cosine(grads.per_sample(images, labels), mem_grads)
        odds = torch.stack([(item_sim + 1) / 2, (self.scores[slots] + 1) / 2], 1)
        replace = torch.multinomial(odds.cpu(), 1, generator=ctx.generator).flatten().bool().to(buffer.device)
        if replace.any():
            buffer.write(slots[replace], images[replace], labels[replace])
            self.scores[slots[replace]] = item_sim[replace]

    def _memory_grads(self, buffer: ReplayBuffer, grads: "_Gradients", ctx: StepContext) -> torch.Tensor:
        bs = min(self.batch_size, buffer.size)
        n_batches = min(self.n_batches, buffer.size // bs)
        perm = torch.randperm(buffer.size, generator=ctx.generator)[: n_batches * bs].to(buffer.device)
        return grads.of_batches(buffer.images[perm].view(n_batches, bs, *buffer.image_shape),
                                buffer.labels[perm].view(n_batches, bs))


def _max_cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """For each row of a, its largest cosine similarity with a row of b."""
    sim = a @ b.T / (a.norm(dim=1, keepdim=True) * b.norm(dim=1)[None]).clamp(min=1e-8)
    return sim.max(1).values


class _Gradients:
    """Flattened loss gradients under the current weights, eval-mode BatchNorm (as the
    reference computes GSS scores), vectorised over samples or batches with torch.func."""

    def __init__(self, ctx: StepContext):
        from torch.func import functional_call, grad, vmap

        model = ctx.model
        params = {k: v.detach() for k, v in model.named_parameters()}
        buffers = {k: v.detach() for k, v in model.named_buffers()}
        was_training = model.training

        def loss(p, x, y):
            model.eval()
            try:
                out = functional_call(model, (p, buffers), (scale_pixels(x),))
            finally:
                model.train(was_training)
            return F.cross_entropy(out, y)

        def flat(g):
            return torch.cat([t.reshape(-1) for t in g.values()])

        self._one = lambda x, y: flat(grad(loss)(params, x, y))
        self._vmapped = vmap(lambda x, y: flat(grad(loss)(params, x, y)))

    def of_batch(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self._one(x, y)

    def of_batches(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self._vmapped(x, y)

    def per_sample(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self._vmapped(x[:, None], y[:, None])
