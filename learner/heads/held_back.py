"""Samples no head has trained on, of every class seen, and the paired search that chooses heads on them.

A class-incremental stream brings only the newest classes, so a score kept on incoming samples never sees a
head forget an old class, and it favours a head biased towards the classes that stream now. `HeldBack` keeps a
few samples of each class out of every head's training (neither the step, nor the memory, nor streaming LDA
sees them): from the class's HOLD_FROM-th sample on, every HOLD_EVERY-th, until it holds PER_CLASS. A class's
first samples all train, so a young class's answers lose nothing; a class older than its task keeps its held
samples, so the choice can see it forgotten.

`paired_search` chooses each class's head on them by the whole served answer (the composed probabilities of
`learner.heads.head_choice.compose`), as a paired comparison: a move (one class, or every measured class, to
another head) is taken when the samples it turns right outnumber those it turns wrong by Z standard deviations
of a sign test (and by MIN_LEAD); the best such move first, at most MAX_MOVES a search. A `preferred` head (a
prior) takes a measured class unless the samples show it worse: a move to it needs no lead, only none against.

>>> import torch
>>> held = HeldBack(hold_from=2, every=2, per_class=2)
>>> labels = torch.tensor([0, 0, 0, 0, 0, 0, 1, 1])
>>> held.hold_back(labels).tolist()  # class 0's 2nd and 4th (it then holds 2), class 1's 2nd
[False, True, False, True, False, False, False, True]
>>> held.offered, held.offered_since_newest  # class 1 came with the 7th
(8, 2)
"""

from __future__ import annotations

import math

import torch

HOLD_FROM = 20  # a class's first samples all train: its young answers need them
HOLD_EVERY = 10  # then every tenth is held back ...
PER_CLASS = 20  # ... until the class holds this many
MIN_HELD = 10  # a class is measured once it holds this many
Z = 2.0  # a move's lead over the answers it changes, in standard deviations of a sign test
MIN_LEAD = 3  # and in samples
MAX_MOVES = 5  # a search's moves at most (each tries every class and head)


class HeldBack:
    def __init__(self, hold_from: int = HOLD_FROM, every: int = HOLD_EVERY, per_class: int = PER_CLASS,
                 min_held: int = MIN_HELD):
        self.hold_from, self.every, self.per_class, self.min_held = hold_from, every, per_class, min_held
        self.seen: dict[int, int] = {}  # samples of each class offered so far
        self.newest_at = 0  # the samples offered before the newest class's first
        self.samples: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # class -> [(stored, frozen)]

    def hold_back(self, labels: torch.Tensor) -> torch.Tensor:
        """Which of an incoming batch's samples to hold back (a mask); counts them as offered."""
        held = torch.zeros(len(labels), dtype=torch.bool)
        for i, label in enumerate(labels.tolist()):
            if label not in self.seen:
                self.newest_at = self.offered
            n = self.seen[label] = self.seen.get(label, 0) + 1
            kept = len(self.samples.get(label, ())) + int(held[:i][labels[:i] == label].sum())
            held[i] = n >= self.hold_from and (n - self.hold_from) % self.every == 0 and kept < self.per_class
        return held

    @property
    def offered(self) -> int:
        return sum(self.seen.values())

    @property
    def offered_since_newest(self) -> int:
        """Samples offered since the newest class's first (itself included)."""
        return self.offered - self.newest_at

    def brings_new_class(self, labels: torch.Tensor) -> bool:
        """Whether a batch holds a class never offered before (one that arrives young)."""
        return any(c not in self.seen for c in labels.unique().tolist())

    def keep(self, stored: torch.Tensor, frozen: torch.Tensor, labels: torch.Tensor) -> None:
        for s, f, label in zip(stored.cpu(), frozen.cpu(), labels.tolist(), strict=True):
            self.samples.setdefault(label, []).append((s.clone(), f.clone()))

    def __len__(self) -> int:
        return sum(len(v) for v in self.samples.values())

    def stacked(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every held sample: (stored, frozen, labels)."""
        pairs = [(s, f, c) for c, held in sorted(self.samples.items()) for s, f in held]
        return (torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs]),
                torch.tensor([p[2] for p in pairs], dtype=torch.long))

    def measured(self) -> list[int]:
        return [c for c, held in sorted(self.samples.items()) if len(held) >= self.min_held]

    def young(self) -> list[int]:
        """Classes offered but not yet measured: the held samples say nothing of them."""
        return [c for c in sorted(self.seen) if len(self.samples.get(c, ())) < self.min_held]

    def correct(self, stored: torch.Tensor, old_class: int, new_class: int | None) -> bool:
        """Move a held sample (found by its stored form) to `new_class`, or drop it (None); whether it was held."""
        held, stored = self.samples.get(old_class, []), stored.cpu()
        at = next((i for i, (s, _) in enumerate(held) if s.shape == stored.shape and torch.equal(s, stored)), None)
        if at is None:
            return False
        sample = held.pop(at)
        if new_class is not None:
            self.samples.setdefault(new_class, []).append(sample)
        return True

    def forget(self, class_id: int) -> None:
        self.samples.pop(class_id, None)
        self.seen.pop(class_id, None)

    def state_dict(self) -> dict:
        return {"seen": dict(self.seen), "newest_at": self.newest_at,
                "samples": {c: [(s, f) for s, f in held] for c, held in self.samples.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.seen = {int(c): n for c, n in state["seen"].items()}
        self.newest_at = state.get("newest_at", 0)  # a state from before it was kept: counted from the first sample
        self.samples = {int(c): [(s, f) for s, f in held] for c, held in state["samples"].items()}


def paired_search(stacked: torch.Tensor, labels: torch.Tensor, choice: torch.Tensor, movable: list[int],
                  compose, preferred: int | None = None, barred: tuple[int, ...] = ()) -> torch.Tensor:
    """Candidates' probabilities [heads, n, classes] of held samples, their labels, each class's head now
    [classes] -> each class's head after the moves the samples support (only `movable` classes move, to no head in
    `barred`), a move to the `preferred` head (an index) wherever the samples do not show it worse.

    >>> import torch
    >>> from learner.heads.head_choice import compose
    >>> head_0 = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 1.0]])  # right on all three
    >>> head_1 = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.6, 0.4]])  # wrong on the third, for class 0
    >>> stacked, labels, now = torch.stack([head_0, head_1]), torch.tensor([0, 1, 1]), torch.tensor([0, 0])
    >>> paired_search(stacked, labels, now, [0, 1], compose).tolist()  # no lead for head 1: nothing moves
    [0, 0]
    >>> paired_search(stacked, labels, now, [0, 1], compose, preferred=1).tolist()  # class 0 as right under it
    [1, 0]
    """
    choice = choice.clone()
    right = compose(stacked, choice).argmax(1) == labels
    for _ in range(MAX_MOVES):
        best = None
        for trial in _moves(choice, movable, [h for h in range(stacked.shape[0]) if h not in barred]):
            answers = compose(stacked, trial).argmax(1) == labels
            wins, losses = int((answers & ~right).sum()), int((~answers & right).sum())
            lead = wins - losses
            to_prior = preferred is not None and bool((trial[trial != choice] == preferred).all())
            needed = 0 if to_prior else max(MIN_LEAD, Z * math.sqrt(wins + losses))
            if lead >= needed and (best is None or lead > best[0]):
                best = (lead, trial, answers)
        if best is None:
            break
        _, choice, right = best
    return choice


def _moves(choice: torch.Tensor, movable: list[int], heads: list[int]):
    """Every measured class to one head, then each class alone to each other head."""
    for head in heads:
        trial = choice.clone()
        trial[movable] = head
        if not torch.equal(trial, choice):
            yield trial
    for c in movable:
        for head in heads:
            if head != int(choice[c]):
                trial = choice.clone()
                trial[c] = head
                yield trial
