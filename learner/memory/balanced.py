"""A class-balanced memory: CBRS admission, and a victim rule within the class (KNN-SV or not).

Admission follows CBRS (Chrysakis & Moens, ICML 2020), one incoming sample at a time once the
memory is full: a sample of a class holding fewer slots than the largest class always enters and
evicts a member of a largest class (one drawn at random if several tie); a sample of a largest
class enters with probability m_c / n_c (its class's slots over the class's samples seen so far)
and evicts a member of its own class. Once full, the largest class never grows, so every class
ends within one slot of an equal share of what the stream has shown. CBRS over a plain class
quota because it needs no class count in advance (a service's classes arrive when they arrive)
and, within a class, it is reservoir sampling: each sample of the class is equally likely kept.

The victim rule chooses which member of the victim's class leaves:
- `random`: uniform (CBRS itself, the control);
- `value`: the lowest KNN-SV (ASER's criterion, eq. (3)-(4), summed over evaluation points);
- `duel`: the lower KNN-SV of two random members (value decides, chance keeps the class spread);
- `compete`: `value`, and a sample of a largest class enters only if its KNN-SV exceeds its
  class's lowest (ASER's "incoming replaces lower-valued", within the class);
- `diverse`: of the closest pair within the class in the latent space, the member whose second
  nearest same-class neighbour is nearer (the most redundant one).

KNN-SVs of candidates that share one label all tie (every candidate matches or misses each
evaluation point alike), so values are computed over the whole memory: a random half is valued
against the other half and the other way round (incoming samples, for `compete`, join both
candidate sets and take the mean of their two values). The other half's evaluation points are at
most MAX_EVALUATION_POINTS of it, drawn at random: a valuation costs O(candidates x points x d), so
without the cap it grew as M^2 (a memory of 2,400 latents took 3.5x the CPU of 1,000's); a memory of
up to 1,000 is valued against its whole other half as before.

Values almost free: the memory's features live in the buffer's per-slot cache, and a slot's
features are recomputed only when they are older than `max_age` optimizer steps (or missing),
so no value is ever computed on features older than `max_age` steps; `max_age=0` recomputes
every slot for each valuation.

>>> import torch
>>> from learner.memory.buffer import ReplayBuffer
>>> buf = ReplayBuffer(4, (1, 1, 1))
>>> ctx = type("C", (), {"generator": torch.Generator().manual_seed(0), "stats": {}})()
>>> update = ClassBalancedUpdate("random")
>>> update.update(buf, torch.zeros(6, 1, 1, 1, dtype=torch.uint8), torch.tensor([0, 0, 0, 0, 1, 2]), ctx)
>>> sorted(buf.class_counts().items()), update.seen
([(0, 2), (1, 1), (2, 1)], {0: 4, 1: 1, 2: 1})
"""

from __future__ import annotations

import torch

from .buffer import ReplayBuffer
from .policy import MemoryUpdate, StepContext
from .shapley import knn_shapley, pairwise_distances

VICTIM_RULES = ("random", "value", "duel", "compete", "diverse")
MAX_EVALUATION_POINTS = 500  # a valuation's evaluation points at most (the other half of a memory of 1,000)


def update_name(victim: str) -> str:
    """The memory-update name of a balanced rule, as `learner.methods.registry` lists it.

    >>> update_name("duel")
    'cb-duel'
    """
    return f"cb-{victim}"


class ClassBalancedUpdate(MemoryUpdate):
    def __init__(self, victim: str = "random", k: int = 3, max_age: int = 100):
        if victim not in VICTIM_RULES:
            raise ValueError(f"unknown victim rule {victim!r}; choose one of {', '.join(VICTIM_RULES)}")
        if max_age < 0:
            raise ValueError(f"max_age must be >= 0, got {max_age}")
        self.victim, self.k, self.max_age = victim, k, max_age
        self.name = update_name(victim)
        self.seen: dict[int, int] = {}  # n_c: samples of each class offered so far

    def lean_form(self) -> "ClassBalancedUpdate":
        """CBRS on the same counts: the rule for a learner behind its stream (no feature pass)."""
        lean = ClassBalancedUpdate("random", self.k, self.max_age)
        lean.seen = self.seen  # one count of the stream, whichever form sees a sample
        return lean

    # --- state -------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"seen": dict(self.seen)}

    def load_state_dict(self, state: dict) -> None:
        self.seen.clear()  # in place: a lean form shares it
        self.seen.update(state.get("seen", {}))  # absent from states written before balance existed

    def forget(self, class_id: int) -> None:
        self.seen.pop(class_id, None)

    def _count_seen(self, labels: torch.Tensor) -> None:
        for c in labels.tolist():
            self.seen[c] = self.seen.get(c, 0) + 1

    # --- the update --------------------------------------------------------------------
    def update(self, buffer: ReplayBuffer, images: torch.Tensor, labels: torch.Tensor, ctx: StepContext) -> None:
        used = buffer.append(images, labels).numel()
        self._count_seen(labels[:used])
        buffer.n_seen += used
        if used == images.shape[0] or buffer.capacity == 0:
            return
        images, labels = images[used:], labels[used:].cpu()
        held = buffer.labels[: buffer.size].cpu().clone()  # the memory's labels as this batch changes them
        n_classes = max(int(labels.max()), int(held.max())) + 1
        counts = torch.bincount(held, minlength=n_classes)
        values = _Values(self, buffer, images, labels, ctx)
        written: dict[int, int] = {}  # slot -> incoming index: later victims skip slots filled by this batch
        for i, c in enumerate(labels.tolist()):
            self._count_seen(labels[i:i + 1])
            buffer.n_seen += 1
            if counts.numel() <= c:
                counts = torch.cat([counts, torch.zeros(c + 1 - counts.numel(), dtype=torch.long)])
            largest = int(counts.max())
            if counts[c] < largest:
                tied = torch.nonzero(counts == largest).flatten()
                victim_class = int(tied[torch.randint(tied.numel(), (1,), generator=ctx.generator)])
            elif not self._admits(c, i, counts, held, written, values, ctx):
                continue
            else:
                victim_class = c
            slot = self._victim(victim_class, held, written, values, ctx)
            counts[victim_class] -= 1
            counts[c] += 1
            held[slot] = c
            written[slot] = i
        if written:
            slots = torch.tensor(list(written), dtype=torch.long, device=buffer.device)
            src = torch.tensor(list(written.values()), dtype=torch.long, device=images.device)
            buffer.write(slots, images[src], labels[src.cpu()])
        ctx.stats["replaced"] = len(written)

    def _admits(self, c: int, i: int, counts, held, written, values: "_Values", ctx) -> bool:
        """Whether a sample of a largest class enters (CBRS's m_c / n_c, or `compete`'s values)."""
        if self.victim == "compete":
            members = _members(c, held, written)
            return bool(values.incoming()[i] > values.memory(members).min())
        odds = counts[c].item() / max(self.seen.get(c, 0), 1)
        return torch.rand((), generator=ctx.generator, dtype=torch.float64).item() < odds

    def _victim(self, victim_class: int, held, written, values: "_Values", ctx) -> int:
        members = _members(victim_class, held, written)
        if self.victim == "random":
            return int(members[torch.randint(members.numel(), (1,), generator=ctx.generator)])
        if self.victim == "diverse":
            return int(members[_most_redundant(values.features()[members])])
        if self.victim == "duel" and members.numel() > 2:
            members = members[torch.randperm(members.numel(), generator=ctx.generator)[:2]]
        return int(members[values.memory(members).argmin()])


def _members(c: int, held: torch.Tensor, written: dict) -> torch.Tensor:
    """Slots of class c, those written by this batch left out unless nothing else is left."""
    members = torch.nonzero(held == c).flatten()
    if written:
        older = members[~torch.isin(members, torch.tensor(list(written)))]
        members = older if older.numel() else members
    return members


def _most_redundant(feats: torch.Tensor) -> int:
    """Index of the member of the closest pair whose second nearest neighbour is nearer."""
    if feats.shape[0] < 3:
        return 0
    dist = pairwise_distances(feats, feats)
    dist.fill_diagonal_(float("inf"))
    nearest = dist.topk(2, dim=1, largest=False).values
    a = int(nearest[:, 0].argmin())
    b = int(dist[a].argmin())
    return a if nearest[a, 1] <= nearest[b, 1] else b


class _Values:
    """The memory's features and KNN-SVs for one batch's update, computed on first use: each half's
    values only once one of its slots is asked for (a duel's two members often share a half)."""

    def __init__(self, policy: ClassBalancedUpdate, buffer: ReplayBuffer, images: torch.Tensor,
                 labels: torch.Tensor, ctx: StepContext):
        self.policy, self.buffer, self.images, self.labels, self.ctx = policy, buffer, images, labels, ctx
        self._features = self._halves = self._perm = self._memory = self._new = None
        self._incoming: dict[int, torch.Tensor] = {}  # half -> its incoming samples' values, once valued

    def features(self) -> torch.Tensor:
        if self._features is None:
            self._features = refresh_stale(self.buffer, self.ctx.latent, self.policy.max_age)
        return self._features

    def memory(self, slots: torch.Tensor) -> torch.Tensor:
        """The KNN-SVs of `slots` (CPU indices into the memory)."""
        for h in torch.unique(self._split()[slots]).tolist():
            if h not in self._incoming:
                self._value(h)
        return self._memory[slots]

    def incoming(self) -> torch.Tensor:
        """The incoming samples' KNN-SVs: the mean of their values in the two halves."""
        for h in (0, 1):
            if h not in self._incoming:
                self._value(h)
        return (self._incoming[0] + self._incoming[1]) / 2

    def _split(self) -> torch.Tensor:
        """Which half each slot is in (0 or 1): a random half is valued against the other half."""
        if self._halves is None:
            n = self.features().shape[0]
            perm = torch.randperm(n, generator=self.ctx.generator)
            self._halves = torch.zeros(n, dtype=torch.long)
            self._halves[perm[n // 2:]] = 1
            self._perm = perm.to(self._features.device)
            self._memory = torch.zeros(n, dtype=self._features.dtype)
        return self._halves

    def _value(self, h: int) -> None:
        """Half h's KNN-SVs against the other half (eq. (3)-(4), summed over evaluation points)."""
        self._split()
        feats, labels = self.features(), self.buffer.labels[: self.buffer.size]
        n = feats.shape[0]
        cand, ev = (self._perm[: n // 2], self._perm[n // 2:])[:: 1 - 2 * h]
        ev = ev[:MAX_EVALUATION_POINTS]  # a random half in random order: its first ones are a random draw
        cf, cy = feats[cand], labels[cand]
        if self.policy.victim == "compete":
            if self._new is None:
                self._new = (self.ctx.latent.extract(self.images).to(feats.dtype), self.labels.to(feats.device))
            cf, cy = torch.cat([cf, self._new[0]]), torch.cat([cy, self._new[1]])
        v = knn_shapley(feats[ev], labels[ev], cf, cy, self.policy.k).sum(0).cpu()
        self._memory[cand.cpu()] = v[: cand.numel()]
        self._incoming[h] = v[cand.numel():]


def refresh_stale(buffer: ReplayBuffer, latent, max_age: int) -> torch.Tensor:
    """The features of every filled slot, recomputing those missing or older than `max_age`
    optimizer steps under the current weights (`latent.version`); the cache keeps them.

    >>> import torch
    >>> from learner.memory.latent import Latent
    >>> buf = ReplayBuffer(3, (1, 1, 1))
    >>> buf.write(torch.arange(3), torch.arange(3, dtype=torch.uint8).view(3, 1, 1, 1), torch.zeros(3, dtype=torch.long))
    >>> calls = []
    >>> extract = lambda x: calls.append(len(x)) or x.view(len(x), 1).float()
    >>> _ = refresh_stale(buf, Latent(extract, buf, version=5), max_age=2)
    >>> _ = refresh_stale(buf, Latent(extract, buf, version=7), max_age=2)
    >>> _ = refresh_stale(buf, Latent(extract, buf, version=8), max_age=2)
    >>> calls
    [3, 3]
    """
    slots = torch.arange(buffer.size, device=buffer.device)
    stale = slots[~buffer.cached_mask(slots, latent.version, max_age)]
    if buffer.features is None:
        stale = slots
    if stale.numel():
        buffer.store_features(stale, latent.extract(buffer.images[stale]), latent.version)
    return buffer.features[: buffer.size]
