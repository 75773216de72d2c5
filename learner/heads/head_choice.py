"""Which head answers, as the stream measures it: a prequential choice, class by class.

Every incoming batch is answered by each candidate head before the learner trains on it (test, then
train: the stream is the test set): streaming LDA on the frozen features ("slda"), the top trained by
replay from ASER's memory ("top"), the mean of their probabilities ("mix"), and their log-linear pool ("pool":
`pooled`, its weight and temperature fitted on held-back samples where the choice holds some). Each candidate's hits
are kept over the last WINDOW samples of each class. A class is answered by the candidate measured
best on it, once that candidate leads the one answering by at least MARGIN over at least MIN_SCORED
of the class's recent samples (hysteresis: a lead inside the noise moves nothing); until then, while
the class is young, streaming LDA answers it. The served probabilities are, for each class, those of
its head, renormalised (`compose`); where every class has the same head they are that head's.

In a class-incremental stream the incoming samples are the newest classes': a class keeps the choice
measured while it was last seen. `measure="held-back"` chooses on samples of every class seen that no head
trained on instead (`learner.heads.held_back`): the learner holds a few back from each class and asks
`choose_on_held` every MEASURE_EVERY steps, when a class arrives, and before an evaluation in process or an idle
service answers (`ContinualLearner.measure_held`), which fits the pool first; the stream's scores are then only
reported. There a `prior` head takes each measured class unless its held samples show it worse (the pool, "pool",
is the service's where unset: above the mean ten images into each new class on every set measured,
docs/results/adapting.md).

The pool weighs the top only on the classes it was fitted on (`pool_of`): a class not yet measured on held samples
has streaming LDA's log-probability as its term, at the pool's temperature. A log-linear pool lets a head that has
not learned a class veto it, and the top has not learned a young one; serving a young class by streaming LDA's own
column beside pooled ones (renormalised by `compose`) instead weighs two softmaxes of different temperatures.
Under the pool as prior, a class not yet measured is answered by the pool, so its answer stays streaming LDA's.
For the same reason the top alone answers no class while one is young: the held samples are the measured classes',
and on them the top, which never answers a class it has not learned, looks best precisely because of that blindness.

>>> import torch
>>> choice = HeadChoice(window=4, min_scored=2, margin=0.25)
>>> sure = lambda c: torch.nn.functional.one_hot(torch.tensor(c), 2).float()  # rows of probabilities
>>> for _ in range(2):  # class 1: the top answers right, streaming LDA wrong
...     choice.score(candidates(sure([0]), sure([1])), torch.tensor([1]))
>>> choice.head_of(0), choice.head_of(1)
('slda', 'top')
>>> both = candidates(torch.tensor([[0.6, 0.4]]), torch.tensor([[0.9, 0.1]]))
>>> choice.compose(both)  # class 0's from slda, class 1's from the top
tensor([[0.8571, 0.1429]])
"""

from __future__ import annotations

from collections import deque

import torch

from .held_back import HeldBack, paired_search

CANDIDATES = ("slda", "top", "mix", "pool")
STREAMING = "slda"  # what answers a class until another head is measured better on it
BLIND = "top"  # the candidate that gives a class it has not trained on no probability
WINDOW = 200  # a class's recent samples over which each candidate's hits count
MIN_SCORED = 50  # of them, how many a head needs before it can take a class
MARGIN = 0.03  # the lead a challenger needs over the head answering a class
MEASURES = ("stream", "held-back")
MEASURE_EVERY = 50  # steps between choices on the held-back samples
# the pool's weights on the top and temperatures its fit tries; unfitted, the geometric mean
POOL_WEIGHTS = tuple(round(0.05 * i, 2) for i in range(21))
POOL_TEMPERATURES = tuple(float(t) for t in torch.logspace(-1.5, 1.0, 26))
UNFITTED_POOL = (0.5, 1.0)


def pooled(slda: torch.Tensor, top: torch.Tensor, weight: float | torch.Tensor, temperature: float) -> torch.Tensor:
    """The log-linear pool of two heads' probabilities: softmax(t ((1 - w) log p_slda + w log p_top)), `weight` one
    for every class or one a class. Streaming LDA's Gaussian model answers with more confidence than it has earned,
    so the mean of the two probabilities leans on it; a weight fitted by likelihood does not. Tensor operations
    only (the ONNX snapshot exports it)."""
    logits = (1 - weight) * slda.clamp_min(1e-30).log() + weight * top.clamp_min(1e-30).log()
    return torch.softmax(temperature * logits, 1)


def candidates(slda: torch.Tensor, top: torch.Tensor | None, pool: tuple[float, float] = UNFITTED_POOL) -> dict:
    """Every candidate's probabilities [n, classes] from streaming LDA's and the top's; `pool`: the pool's
    (weight, temperature), the weight one for every class or one a class (`HeadChoice.pool_of`). `top` None: not
    computed, for a composition that reads none of it (`reads_top`); all ones stand in for it."""
    top = torch.ones_like(slda) if top is None else top
    return {"slda": slda, "top": top, "mix": (slda + top) / 2, "pool": pooled(slda, top, *pool)}


def columns_reading_top(choice: torch.Tensor, pool_weight: torch.Tensor) -> torch.Tensor:
    """Which classes' columns, composed by `choice` (indices into CANDIDATES) with the pool's weight a class, read the
    top's probabilities (a mask): a class answered by the top or the mix, or by a pool with a weight on it.

    >>> slda_and_pool = torch.tensor([0, 3])  # class 0 by streaming LDA, class 1 by the pool
    >>> columns_reading_top(slda_and_pool, torch.tensor([0.0, 0.4])).tolist()
    [False, True]
    """
    by_top = torch.isin(choice, torch.tensor([CANDIDATES.index("top"), CANDIDATES.index("mix")]))
    return by_top | ((choice == CANDIDATES.index("pool")) & (pool_weight != 0))


def reads_top(choice: torch.Tensor, pool_weight: torch.Tensor) -> bool:
    """Whether answers composed by `choice` with the pool's weight a class read the top's probabilities at all. Where
    they do not, the top's probabilities taken as all ones give the same answers without the top's pass.

    >>> slda_and_pool = torch.tensor([0, 3])
    >>> reads_top(slda_and_pool, torch.tensor([0.0, 0.0])), reads_top(slda_and_pool, torch.tensor([0.0, 0.4]))
    (False, True)
    """
    return bool(columns_reading_top(choice, pool_weight).any())


def stack(answers: dict[str, torch.Tensor]) -> torch.Tensor:
    """The candidates' probabilities in CANDIDATES order: [heads, n, classes], as `compose` takes them."""
    return torch.stack([answers[h] for h in CANDIDATES])


def serve(slda: torch.Tensor, top: torch.Tensor | None, choice: torch.Tensor,
          pool: tuple[float, float] = UNFITTED_POOL) -> torch.Tensor:
    """The served probabilities from streaming LDA's and the top's, each class from its head (`choice`, indices
    into CANDIDATES): what a predictor and the ONNX snapshot compute."""
    return compose(stack(candidates(slda, top, pool)), choice)


def fit_pool(slda: torch.Tensor, top: torch.Tensor, labels: torch.Tensor,
             weighed: torch.Tensor | None = None) -> tuple[float, float]:
    """The pool's (weight, temperature) of least negative log-likelihood on labelled samples, over a grid;
    `weighed`: the classes the weight applies to (a mask; the others' term is streaming LDA's), else every one. Over
    none (a sleeping learner before its first sleep), the pool is streaming LDA's answer: it fits nothing, and its
    temperature is calibration's to fit, under streaming LDA's prior (`learner.heads.calibration`)."""
    weighed = torch.ones(slda.shape[1]) if weighed is None else weighed.float()
    if not bool(weighed.any()):
        return 0.0, 1.0
    logs = slda.clamp_min(1e-30).log(), top.clamp_min(1e-30).log()
    best, fitted = float("inf"), UNFITTED_POOL
    for w in POOL_WEIGHTS:
        logits = logs[0] + w * weighed * (logs[1] - logs[0])
        for t in POOL_TEMPERATURES:
            nll = float(torch.nn.functional.cross_entropy(t * logits, labels))
            if nll < best:
                best, fitted = nll, (w, t)
    return fitted


class HeadChoice:
    def __init__(self, window: int = WINDOW, min_scored: int = MIN_SCORED, margin: float = MARGIN,
                 measure: str = "stream", prior: str | None = None):
        if measure not in MEASURES:
            raise ValueError(f"measure must be one of {MEASURES}, got {measure!r}")
        if prior is not None and (prior not in CANDIDATES or measure != "held-back"):
            raise ValueError(f"a prior is one of {CANDIDATES}, for the choice on held-back samples; got {prior!r}")
        self.window, self.min_scored, self.margin, self.measure = window, min_scored, margin, measure
        self.prior = prior
        self.hits: dict[str, dict[int, deque[bool]]] = {h: {} for h in (*CANDIDATES, "served")}
        self.chosen: dict[int, str] = {}
        self.held = HeldBack() if measure == "held-back" else None
        self.measure_every = MEASURE_EVERY
        self.held_accuracy: dict[str, float] = {}  # each candidate's and the served answer's, last measured
        self.pool = UNFITTED_POOL  # the pool's (weight on the top, temperature), fitted on the held-back samples
        # the classes the pool's weight applies to: those measured when it was fitted (None: every class)
        self.pool_classes: list[int] | None = [] if self.held is not None else None
        # what answers a class no choice has moved: the pool as prior answers a young one as streaming LDA would
        self.unmoved = "pool" if prior == "pool" else STREAMING
        # the classes the top has learned (None: every class seen; a top trained only by a sleep knows those it slept
        # on): a measured class it has not learned is treated as young, and the pool does not weigh the top on it
        self.top_classes: set[int] | None = None

    def head_of(self, class_id: int) -> str:
        return self.chosen.get(class_id, self.unmoved)

    def weighed(self, num_classes: int) -> torch.Tensor:
        """Which classes the pool's weight applies to (a mask): `pool_classes`, or every class."""
        if self.pool_classes is None:
            return torch.ones(num_classes, dtype=torch.bool)
        return torch.isin(torch.arange(num_classes), torch.tensor(self.pool_classes, dtype=torch.long))

    def pool_of(self, num_classes: int) -> tuple[torch.Tensor, float]:
        """The pool's weight on the top for each class (0 on one it was not fitted on), and its temperature."""
        return float(self.pool[0]) * self.weighed(num_classes).float(), self.pool[1]

    def score(self, probabilities: dict[str, torch.Tensor], labels: torch.Tensor) -> None:
        """Count one batch answered before its step: each candidate's probabilities [n, classes] of
        samples of classes the heads have seen; then each class in it is chosen again."""
        served = self.compose(probabilities)
        labels = labels.cpu().tolist()
        for head, p in (*probabilities.items(), ("served", served)):
            for label, guess in zip(labels, p.argmax(1).cpu().tolist()):
                self.hits[head].setdefault(label, deque(maxlen=self.window)).append(guess == label)
        if self.held is None:
            for label in set(labels):
                self._choose(label)

    def _choose(self, class_id: int) -> None:
        current = self.head_of(class_id)
        rates = {h: self.accuracy(h, class_id) for h in CANDIDATES}
        best = max(CANDIDATES, key=lambda h: rates[h] if rates[h] is not None else -1.0)
        if rates[best] is not None and rates[current] is not None and rates[best] >= rates[current] + self.margin:
            self.chosen[class_id] = best

    def choose_on_held(self, probabilities: dict[str, torch.Tensor], labels: torch.Tensor) -> None:
        """Fit the pool and choose again on the held-back samples: each candidate's probabilities of them, and
        their labels."""
        classes, measured = probabilities["slda"].shape[1], self.held.measured()
        learned = measured if self.top_classes is None else [c for c in measured if c in self.top_classes]
        self.pool_classes = learned
        self.pool = fit_pool(probabilities["slda"], probabilities["top"], labels, self.weighed(classes))
        probabilities = candidates(probabilities["slda"], probabilities["top"], self.pool_of(classes))
        stacked = stack(probabilities)
        preferred = CANDIDATES.index(self.prior) if self.prior is not None else None
        choice, barred = self.choice(classes), ()
        if self.held.young() or len(learned) < len(measured):  # the top alone answers no class while one is young
            barred = (CANDIDATES.index(BLIND),)
            choice[choice == barred[0]] = CANDIDATES.index(self.unmoved)
        for c in set(measured) - set(learned):  # not learned by the top: answered as a young class is
            choice[c] = CANDIDATES.index(self.unmoved)
        choice = paired_search(stacked, labels, choice, learned, compose, preferred, barred)
        self.chosen = {c: CANDIDATES[int(h)] for c, h in enumerate(choice) if CANDIDATES[int(h)] != self.unmoved}
        answers = {**{h: stacked[i] for i, h in enumerate(CANDIDATES)}, "served": compose(stacked, choice)}
        self.held_accuracy = {h: round(float((p.argmax(1) == labels).float().mean()), 4) for h, p in answers.items()}

    def accuracy(self, head: str, class_id: int) -> float | None:
        """`head`'s share of right answers over the class's recent samples; None below MIN_SCORED."""
        hits = self.hits[head].get(class_id, ())
        return sum(hits) / len(hits) if len(hits) >= self.min_scored else None

    def choice(self, num_classes: int) -> torch.Tensor:
        """Each class's head, as an index into CANDIDATES."""
        return torch.tensor([CANDIDATES.index(self.head_of(c)) for c in range(num_classes)], dtype=torch.long)

    def reads_top(self, num_classes: int) -> bool:
        """Whether the served answer reads the top's probabilities (`reads_top`)."""
        return reads_top(self.choice(num_classes), self.pool_of(num_classes)[0])

    def blind_columns(self, num_classes: int) -> torch.Tensor | None:
        """Where the served answer reads the top: the classes whose column reads nothing of it (a mask; young ones,
        answered by streaming LDA's term), else None."""
        reading = columns_reading_top(self.choice(num_classes), self.pool_of(num_classes)[0])
        return ~reading if bool(reading.any()) else None

    def serves_fitted_pool(self, num_classes: int) -> bool:
        """Whether a class is answered by the pool and the pool was fitted on the held-back samples over classes the
        top has learned (`fit_pool`): the served logits' scale is then a likelihood fit already, even where the fitted
        weight on the top is 0. Only a choice on the held-back samples (`choose_on_held`) gives the pool classes."""
        fitted = self.held is not None and bool(self.weighed(num_classes).any())
        return fitted and bool((self.choice(num_classes) == CANDIDATES.index("pool")).any())

    def compose(self, probabilities: dict[str, torch.Tensor]) -> torch.Tensor:
        """The served probabilities: each class's from its head, renormalised."""
        classes = probabilities[STREAMING].shape[1]
        return compose(stack(probabilities), self.choice(classes))

    def summary(self) -> dict:
        """Each head's share of right answers over the classes' recent samples, overall and per class, and
        which head answers each class."""
        overall = {}
        for head, by_class in self.hits.items():
            hits = [h for recent in by_class.values() for h in recent]
            overall[head] = round(sum(hits) / len(hits), 4) if hits else None
        per_class = {c: {"head": self.head_of(c), **{h: self.accuracy(h, c) for h in CANDIDATES}}
                     for c in sorted(self.hits["served"])}
        held = {} if self.held is None else {"held_back": {"samples": len(self.held), "accuracy": self.held_accuracy}}
        prior = {} if self.prior is None else {"prior": self.prior}
        weighed = {} if self.pool_classes is None else {"classes": list(self.pool_classes)}
        pool = {"pool": {"weight": self.pool[0], "temperature": round(self.pool[1], 4), **weighed}}
        return {"measure": self.measure, **prior, **pool, "window_accuracy": overall, **held, "classes": per_class}

    def forget(self, class_id: int) -> None:
        for by_class in self.hits.values():
            by_class.pop(class_id, None)
        self.chosen.pop(class_id, None)
        if self.held is not None:
            self.held.forget(class_id)
        if self.pool_classes is not None and class_id in self.pool_classes:
            self.pool_classes.remove(class_id)

    def state_dict(self) -> dict:
        return {"hits": {h: {c: list(d) for c, d in by_class.items()} for h, by_class in self.hits.items()},
                "chosen": dict(self.chosen), "pool": list(self.pool),
                "pool_classes": None if self.pool_classes is None else list(self.pool_classes),
                **({"held": self.held.state_dict(), "held_accuracy": self.held_accuracy} if self.held is not None else {})}

    def load_state_dict(self, state: dict) -> None:
        self.hits = {h: {int(c): deque(d, maxlen=self.window) for c, d in state["hits"].get(h, {}).items()}
                     for h in (*CANDIDATES, "served")}
        self.chosen = {int(c): h for c, h in state["chosen"].items()}
        self.pool = tuple(state.get("pool", UNFITTED_POOL))  # a state from before the pool: unfitted
        if self.held is not None and "held" in state:
            self.held.load_state_dict(state["held"])
            self.held_accuracy = dict(state.get("held_accuracy", {}))
        # a state from before the pool weighed by class: it weighed every class measured
        self.pool_classes = state.get("pool_classes", None if self.held is None else self.held.measured())


def compose(stacked: torch.Tensor, choice: torch.Tensor) -> torch.Tensor:
    """Candidates' probabilities [heads, n, classes] and each class's head [classes] -> the served
    probabilities [n, classes]: class c's column from head choice[c], rows renormalised. Written
    with tensor operations only, so that an ONNX snapshot exports it as it is."""
    picked = torch.gather(stacked, 0, choice.to(stacked.device).view(1, 1, -1).expand(1, *stacked.shape[1:]))[0]
    return picked / picked.sum(1, keepdim=True).clamp_min(1e-30)
