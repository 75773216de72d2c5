"""Sleep: the top trained i.i.d.-style over what the device holds, while it is idle.

The wake phase stays what it is (streaming LDA on the frozen features, ASER's memory update, and a step of the top
on one batch in `train_every`, or none with 0); a sleep (SIESTA, Harun et al. 2023) takes `budget` sample-updates
of plain SGD on class-balanced mini-batches drawn from a `source`:

- "store": the latent store (`learner.memory.latent_store`), every trained sample's latent in 8 bits;
- "memory": ASER's memory, the M samples its values kept;
- "both": each batch half from each.

`draw` "balanced" (SIESTA's) draws every store batch class-balanced over everything, with replacement; "new-half"
takes half of each from the samples that arrived since the last sleep (REMIND's mix of new and old), which in a
class-incremental stream is one task's classes: on Split EuroSAT (seed 0) it served 95.01 against balanced's 97.23,
14 of its 22 sleeps undone by the held-back samples (docs/results/sleep.md); "shuffled" takes shuffled passes over
everything the store holds, without replacement, as reference (b) and a fresh sleep do (the store only; on
tf_flowers -0.25 ± 0.76 against balanced, five seeds: not shown different). The budget of a sleep is `epochs` times
the samples new since the last one (the whole stream's sleeps then cost `epochs` passes over it: reference (b)'s count
at 8). A sleep is warm-started from the current top and ends, under a choice on held-back samples
(`learner.heads.held_back`), with the heads chosen again; it keeps its weights unless the held-back samples show the
served answer worse than before by a paired sign test (`shown_worse`; then the weights, the average and the choice it
replaced come back). `should_yield` is asked between steps: a sleep that yields keeps what it trained and owes the
rest of its budget to the next.
`schedule` "constant" steps at `lr` throughout; "cosine" anneals each sleep's rate from `lr` to zero over its budget
(SGDR's warm restart a sleep, Loshchilov & Hutter 2017), so that a sleep ends at weights its last steps settled
rather than at one noisy step's.

A `fresh` sleep (asked for, or a service's night sleep: never on the count of new samples) starts the top again from
ImageNet's weights and a new linear head and trains it as reference (b), the same top trained i.i.d. offline, does:
`fresh_epochs` (unset: `epochs`) shuffled passes over everything the store holds, in batches of `fresh_batch_size`.
Warm sleeps train the top in the stream's order, one task's classes before the next, and end 1-4 points under (b) on a
class that came last (docs/results/sleep.md); a fresh one costs (b)'s CPU each time (at its count of passes). (Its
batches drawn class-balanced with replacement, as a warm sleep's, left the top 1.6 points under these passes on
tf_flowers.) It is published under the same held-back rule; one that yields to arriving samples is undone whole
(half-trained weights serve nothing) and runs again at the next sleep.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

import torch
from torch.nn import functional as F

from ..heads.held_back import MIN_LEAD, Z
from ..memory.latent_store import LatentStore
from ..networks.frozen_runtime import cpu_seconds, trim_heap

SOURCES = ("store", "memory", "both")
KEPT_REPORTS = 1000  # the latest sleeps' reports a learner keeps (a service sleeps for months)
DRAWS = ("balanced", "new-half", "shuffled")
SCHEDULES = ("constant", "cosine")


@dataclass
class SleepConfig:
    epochs: float = 8.0  # sample-updates a sleep for each sample new since the last
    batch_size: int = 32
    # samples forwarded and backpropagated at once, their gradients summed into the batch's: the same step (to float
    # rounding: the top's BatchNorm keeps its statistics), the saved activations a micro-batch's. Lite0's top at cut
    # 11, 160 px, one thread: a step of 32 at once saved 174 MB for 0.94 CPU s, in halves 93 MB for 0.95 s, in
    # quarters 52 MB for 1.08 s (docs/results/sleep.md)
    micro_batch: int = 16
    lr: float = 0.01
    schedule: str = "constant"
    source: str = "store"
    draw: str = "balanced"
    store_capacity: int = 100_000  # samples
    fresh_batch_size: int = 10  # a fresh sleep's step, reference (b)'s
    fresh_epochs: float | None = None  # a fresh sleep's passes over everything held (None: `epochs`)

    def __post_init__(self):
        if self.source not in SOURCES:
            raise ValueError(f"unknown sleep source {self.source!r}; choose one of {', '.join(SOURCES)}")
        if self.draw not in DRAWS:
            raise ValueError(f"unknown sleep draw {self.draw!r}; choose one of {', '.join(DRAWS)}")
        if self.draw == "shuffled" and self.source != "store":
            raise ValueError("the shuffled draw takes passes over the store: it needs source 'store'")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"unknown sleep schedule {self.schedule!r}; choose one of {', '.join(SCHEDULES)}")
        batches = min(self.batch_size, self.micro_batch, self.fresh_batch_size)
        if min(self.epochs, self.fresh_passes) <= 0 or batches < 1 or self.lr <= 0 or self.store_capacity < 1:
            raise ValueError("a sleep needs epochs > 0, batches of at least 1, a rate > 0 and a store of 1 or more")

    @property
    def fresh_passes(self) -> float:
        """A fresh sleep's passes over everything held: `fresh_epochs`, or `epochs` where unset."""
        return self.epochs if self.fresh_epochs is None else self.fresh_epochs


@dataclass
class SleepReport:
    budget: int  # sample-updates this sleep was given
    updates: int = 0  # taken
    steps: int = 0
    cpu_seconds: float = 0.0
    held_before: float | None = None  # the served answer's accuracy on the held-back samples
    held_after: float | None = None
    kept: bool = True  # False: worse on the held-back samples, rolled back
    yielded: bool = False
    fresh: bool = False  # the top started again from ImageNet's weights
    classes: list[int] = field(default_factory=list)  # what it rehearsed

    def as_dict(self) -> dict:
        return {k: round(v, 4) if isinstance(v, float) else v for k, v in self.__dict__.items()}


class Sleeper:
    """A learner's sleep: the store it rehearses, the schedule's count of what is new, and what it has run."""

    def __init__(self, config: SleepConfig, stored_shape: tuple[int, ...], eight_bit: bool, seed: int = 0,
                 store: LatentStore | None = None):
        self.config = config
        # the latents in memory, or a store that keeps them elsewhere (the service's, on disk)
        self.store = store if store is not None else LatentStore(config.store_capacity, stored_shape, eight_bit, seed)
        self.generator = torch.Generator().manual_seed(seed + 7)
        self.mark = 0  # the store's arrivals when the last sleep began
        self.relabelled = 0  # store samples relabelled since: new to the top as much as an arrival is
        self.owed = 0  # sample-updates a yielded sleep left
        self.fresh_asked = False  # the next sleep starts the top again (`fresh`): asked for, or a fresh one yielded
        self.fresh_mark = 0  # the store's arrivals when the last fresh sleep that ran to its end began
        # classes a kept sleep has trained the top on; changed in place only, since a head choice may read this very set
        self.top_classes: set[int] = set()
        self.sleeps, self.updates, self.cpu_seconds = 0, 0, 0.0
        self.reports: list[dict] = []  # every sleep's report, as a dict
        self.current: SleepReport | None = None  # the sleep in progress (its updates so far), for a reader

    @property
    def last(self) -> dict | None:
        return self.reports[-1] if self.reports else None

    @property
    def new_samples(self) -> int:
        """Samples the top has not slept on: arrived, or relabelled in the store, since the last sleep began."""
        return self.store.arrived - self.mark + self.relabelled

    @property
    def new_since_fresh(self) -> int:
        """Samples arrived since the last fresh sleep that ran to its end began (a service's night sleep waits for
        them)."""
        return self.store.arrived - self.fresh_mark

    def night_needs(self, min_new: int, growth: float) -> int:
        """The arrivals since the last fresh sleep a night's (fresh) one waits for: `min_new`, and `growth` times
        what had arrived before it, so that however often the device idles, the fresh sleeps' passes over the store
        together cost at most (1 + 1 / growth) times the last one's.

        >>> sleeper = Sleeper(SleepConfig(), (4,), False)
        >>> sleeper.night_needs(100, 1.0)
        100
        >>> sleeper.fresh_mark = 1000
        >>> sleeper.night_needs(100, 1.0), sleeper.night_needs(100, 0.5)
        (1000, 500)
        """
        return max(min_new, math.ceil(growth * self.fresh_mark))

    def budget(self, fresh: bool = False) -> int:
        """A warm sleep's: `epochs` times the samples new since the last, and what a yielded one owes; a fresh one's:
        `fresh_epochs` (or `epochs`) passes over everything held."""
        if fresh or self.fresh_asked:
            return int(round(self.config.fresh_passes * len(self.store)))
        return int(round(self.config.epochs * self.new_samples)) + self.owed

    def run(self, learner, budget: int | None = None, should_yield=None, fresh: bool = False) -> SleepReport:
        fresh = fresh or self.fresh_asked
        budget = self.budget(fresh) if budget is None else budget
        report = SleepReport(budget=budget, fresh=fresh, classes=sorted(self.store.class_counts()))
        new = self.store.arrived_after(self.mark)
        before = self.mark, self.owed, self.relabelled
        self.mark, self.owed, self.relabelled, self.fresh_asked = self.store.arrived, 0, 0, False
        if not len(self.store) or budget <= 0:
            return report
        if should_yield is not None and should_yield():  # owed whole, nothing measured
            report.yielded = True
            self._owe(report, before)
            return report
        self.current = report
        learner.backbone.release_buffers()  # the pixels' buffers out before the batches' activations come in
        try:
            self._train(learner, report, new, should_yield, before)
            if report.fresh and not report.yielded:  # kept or undone, what it saw is not new to the next night's
                self.fresh_mark = self.mark
            self.sleeps += 1
            self.updates += report.updates
            self.cpu_seconds += report.cpu_seconds
            self.reports = [*self.reports[-(KEPT_REPORTS - 1):], report.as_dict()]
        finally:
            self.current = None  # awake only once the report is in: a reader never sees the sleep ended unreported
            trim_heap()  # the batches' activations freed: back to the system, not kept by the C heap
        return report

    def _owe(self, report: SleepReport, before: tuple[int, int, int]) -> None:
        """A sleep that yielded: a warm one owes the rest of its budget; a fresh one is asked again whole, and what
        was new before it stays new."""
        if report.fresh:
            self.mark, self.owed, self.relabelled = before
            self.fresh_asked = True
        else:
            self.owed = report.budget - report.updates

    def _train(self, learner, report: SleepReport, new: torch.Tensor, should_yield, before: tuple) -> None:
        cpu0 = cpu_seconds()
        budget = report.budget
        right_before = _served_right_on_held(learner)
        saved = _serving_state(learner)
        taught_before = set(self.top_classes)
        batch = self.config.fresh_batch_size if report.fresh else self.config.batch_size
        if report.fresh:
            learner.restart_top(int(torch.randint(2**31, (1,), generator=self.generator)))
            self.top_classes.clear()  # changed in place: a head choice reads this very set
        # the slots of (b)'s shuffled passes, taken in order; None: each batch drawn as it comes (`_draw`)
        shuffled = report.fresh or self.config.draw == "shuffled"
        order = self._shuffled_passes(learner, budget) if shuffled else None
        params = list(learner.model.parameters())  # those without a gradient are skipped
        learner.model.train()
        while report.updates < budget:
            if should_yield is not None and should_yield():
                report.yielded = True
                self._owe(report, before)
                break
            n = min(batch, budget - report.updates)
            x, y = (self._draw(learner, n, new) if order is None
                    else self._read(learner, order[report.updates:report.updates + n]))
            self.step(learner, params, x, y, self.rate(report.updates, budget))
            report.updates += len(y)
            report.steps += 1
        learner.model.zero_grad(set_to_none=True)  # the last step's gradients: a top's size, not needed awake
        learner.rehearsal_steps += report.steps
        self.top_classes |= set(report.classes)  # measured as the top's, taken back if the sleep is undone
        half_trained = report.fresh and report.yielded  # undone whole, nothing to measure
        right_after = None if half_trained else _served_right_on_held(learner)
        if right_before is not None and right_after is not None:
            report.held_before, report.held_after = (round(float(r.float().mean()), 4)
                                                     for r in (right_before, right_after))
        worse = right_before is not None and right_after is not None and shown_worse(right_before, right_after)
        if worse or half_trained:
            self.top_classes.clear()
            self.top_classes |= taught_before
            _restore_serving(learner, saved)
            report.kept = False
        report.cpu_seconds = cpu_seconds() - cpu0  # the served top's graph exported in a child too

    def rate(self, done: int, budget: int) -> float:
        """The SGD rate of the step after `done` of a sleep's `budget` sample-updates.

        >>> Sleeper(SleepConfig(lr=0.01, schedule="cosine"), (1,), False).rate(500, 1000)
        0.005
        """
        if self.config.schedule == "constant":
            return self.config.lr
        return self.config.lr * 0.5 * (1.0 + math.cos(math.pi * done / budget))

    def step(self, learner, params: list[torch.Tensor], x: torch.Tensor, y: torch.Tensor, lr: float) -> None:
        """One step of plain SGD on the batch (x, y) at `lr` (`rate`): its mean cross-entropy's gradient, summed over
        micro-batches."""
        learner.model.zero_grad(set_to_none=True)
        for part_x, part_y in zip(x.split(self.config.micro_batch), y.split(self.config.micro_batch)):
            (F.cross_entropy(learner.forward_logits(part_x), part_y, reduction="sum") / len(y)).backward()
        _sgd_step(params, lr)
        learner.weights_changed()
        if learner.forgotten:
            learner._silence_forgotten()

    def _draw(self, learner, n: int, new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        source = self.config.source
        from_memory = n if source == "memory" else n // 2 if source == "both" else 0
        parts = []
        if from_memory and len(learner.buffer):
            trusted = learner.trusted(learner.buffer.keys[:len(learner.buffer)])  # suspects are not rehearsed
            pool = torch.arange(len(learner.buffer)) if trusted is None else trusted.nonzero().flatten()
            slots = pool[torch.randint(len(pool), (from_memory if len(pool) else 0,), generator=self.generator)]
            slots = slots.to(learner.device)
            parts.append((learner.buffer.images[slots], learner.buffer.labels[slots]))
        rest = n - sum(len(p[1]) for p in parts)
        if rest:
            trusted = learner.trusted(self.store.keys[:len(self.store)])
            half = rest // 2 if self.config.draw == "new-half" and bool(new.any()) else 0
            slots = torch.cat([self.store.draw_balanced(half, self.generator,
                                                        among=new if trusted is None else new & trusted),
                               self.store.draw_balanced(rest - half, self.generator, among=trusted)])
            parts.append(self._read(learner, slots))
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])

    def _read(self, learner, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        latents, labels = self.store.read(slots)
        return latents.to(learner.device, learner.backbone.stored_dtype), labels.to(learner.device)

    def _shuffled_passes(self, learner, n: int) -> torch.Tensor:
        """n slots from shuffled passes over the store's trusted samples, as (b) takes them (a fresh sleep's)."""
        mask = learner.trusted(self.store.keys[:len(self.store)])  # suspects are not rehearsed
        trusted = torch.arange(len(self.store)) if mask is None or not mask.any() else mask.nonzero().flatten()
        passes = -(-n // len(trusted))
        return torch.cat([trusted[torch.randperm(len(trusted), generator=self.generator)] for _ in range(passes)])[:n]

    def correct(self, key: int, new_class: int | None) -> bool:
        """Relabel (None: drop) the stored sample `key`; whether the store held it. A relabel counts as new: the next
        sleep has a budget for it, even where nothing else arrives (a person correcting what the device holds)."""
        found = self.store.correct(key, new_class)
        if found and new_class is not None:
            self.relabelled += 1
        return found

    def forget(self, class_id: int) -> None:
        self.store.forget_class(class_id)
        self.top_classes.discard(class_id)

    def state_dict(self) -> dict:
        return {"store": self.store.state_dict(), "generator": self.generator.get_state(), "mark": self.mark,
                "owed": self.owed, "relabelled": self.relabelled, "fresh_asked": self.fresh_asked,
                "fresh_mark": self.fresh_mark,
                "top_classes": sorted(self.top_classes),
                "sleeps": self.sleeps, "updates": self.updates, "cpu_seconds": self.cpu_seconds,
                "reports": list(self.reports)}

    def load_state_dict(self, state: dict) -> None:
        self.store.load_state_dict(state["store"])
        self.generator.set_state(state["generator"])
        self.mark, self.owed, self.relabelled = state["mark"], state["owed"], state.get("relabelled", 0)
        self.fresh_asked = state.get("fresh_asked", False)
        self.fresh_mark = state.get("fresh_mark", 0)
        self.top_classes.clear()
        self.top_classes.update(state["top_classes"])
        self.sleeps, self.updates, self.cpu_seconds = state["sleeps"], state["updates"], state["cpu_seconds"]
        self.reports = list(state["reports"])


@torch.no_grad()
def _sgd_step(params: list[torch.Tensor], lr: float) -> None:
    """Plain SGD, torch.optim.SGD's update without momentum (p - lr g) by hand: its first step imports
    torch._dynamo, 71 MB kept in a process that never compiles."""
    for p in params:
        if p.grad is not None:
            p.add_(p.grad, alpha=-lr)


def shown_worse(before: torch.Tensor, after: torch.Tensor) -> bool:
    """Whether the held-back samples show the answer after worse than before (which of them each got right): the
    samples it turned wrong outnumber those it turned right by Z standard deviations of a sign test (and by
    MIN_LEAD), the head choice's rule (`learner.heads.held_back`). Within that, the samples cannot tell.

    >>> right = torch.ones(40, dtype=torch.bool)
    >>> shown_worse(right, torch.cat([torch.zeros(1, dtype=torch.bool), right[1:]]))  # one sample in 40: noise
    False
    >>> shown_worse(right, torch.cat([torch.zeros(8, dtype=torch.bool), right[8:]]))
    True
    """
    losses, wins = int((before & ~after).sum()), int((after & ~before).sum())
    return losses - wins >= max(MIN_LEAD, Z * math.sqrt(losses + wins))


def _served_right_on_held(learner) -> torch.Tensor | None:
    """Which held-back samples the served answer gets right, the heads chosen on them first (None without any)."""
    choice = learner.head_choice
    if choice is None or choice.held is None or not choice.held.measured():
        return None
    learner._held_measured_at = None  # held samples may have come since the last measure, at the same weights
    learner.measure_held()
    stored, features, labels = choice.held.stacked()
    served = choice.compose(learner.head_probabilities(stored, features, top=learner.held_top_probabilities()))
    return served.argmax(1) == labels


def _serving_state(learner) -> dict:
    return {"model": copy.deepcopy(learner.model.state_dict()),
            "ema": copy.deepcopy(learner.ema.state_dict()) if learner.ema is not None else None,
            "head_choice": copy.deepcopy(learner.head_choice.state_dict()) if learner.head_choice else None}


def _restore_serving(learner, saved: dict) -> None:
    learner.model.load_state_dict(saved["model"])
    if learner.ema is not None:
        learner.ema.load_state_dict(saved["ema"], learner.model)
    if learner.head_choice is not None:
        learner.head_choice.load_state_dict(saved["head_choice"])
    learner.rename_weights()
    learner._held_measured_at = learner._held_key()  # the restored choice was measured on these weights
