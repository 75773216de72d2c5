"""Noisy labels in the benchmark's stream (`run --label-noise P`): a share P of the stream's samples, drawn
independently, arrive labelled as another class seen so far (symmetric flips; the test set stays clean), or with
`--label-noise-mode pair` as the seen class that looks most like theirs (the nearest class mean in the frozen
network's features: the confusion a person in the field makes, each class always into the same one). Every sample
goes to the learner with its stream position as its key (`observe(keys=...)`), so that at the end the memory's
suspects (`ReplayLearner.suspects`: ASER's KNN-SV of each remembered sample to the others) are scored against the
flips exactly, and the flipped samples found are corrected (`correct_sample`, as `PATCH /samples/{seq}` does) to
measure what correcting them gives back: the memory's suspects, the stream's samples valued below zero, then a person
reading further down the same list (`REVIEW_SHARES` of the stream, lowest-valued first).

>>> noise = LabelNoise(0.5, seed=0)
>>> noise.begin([0, 1])
>>> y, keys = noise.flip(torch.zeros(8, dtype=torch.long))
>>> int((y != 0).sum()) == len(noise.flipped), keys.tolist()
(True, [0, 1, 2, 3, 4, 5, 6, 7])
>>> pairs = LabelNoise(1.0, seed=0, nearest={0: [2, 1], 1: [0, 2], 2: [0, 1]})
>>> pairs.begin([0, 1])
>>> pairs.flip(torch.tensor([0, 1]))[0].tolist()  # class 2, nearest to 0, has not come yet
[1, 0]
>>> pairs.begin([2])
>>> pairs.flip(torch.tensor([0, 1, 2]))[0].tolist()
[2, 0, 0]
"""

from __future__ import annotations

import time

import torch

from learner.memory.shapley import MemoryReference

SUSPECTS_SCORED = 100  # the goal reads precision among the 100 most suspected
# a deeper review: the lowest-valued shares of the stream a person looks at, past those below zero
REVIEW_SHARES = (0.3, 0.4)
MODES = ("symmetric", "pair")


def nearest_classes(learner, data, per_class: int = 100) -> dict[int, list[int]]:
    """Each class's others, nearest first: by the distance between the class means of the frozen network's features
    over the first `per_class` training samples (of the pixels themselves for a network trained from scratch)."""
    means = {}
    for c in data.train_y.unique().tolist():
        x = data.train_x[data.train_y == c][:per_class].to(learner.device)
        features = learner.backbone.encode_with_features(x)[1]
        means[c] = (x.flatten(1) if features is None else features).float().mean(0).cpu()
    classes = sorted(means)
    distance = torch.cdist(torch.stack([means[c] for c in classes]), torch.stack([means[c] for c in classes]))
    return {c: [classes[j] for j in distance[i].argsort().tolist() if j != i] for i, c in enumerate(classes)}


class LabelNoise:
    def __init__(self, rate: float, seed: int, nearest: dict[int, list[int]] | None = None):
        self.rate = rate
        self.nearest = nearest  # pair mode: each class's others, nearest first (None: symmetric flips)
        self.generator = torch.Generator().manual_seed(10_007 + seed)  # apart from the stream's order
        self.flipped: dict[int, tuple[int, int]] = {}  # stream position -> (label given, true label)
        self.sent = 0
        self.seen: list[int] = []  # the classes the stream has sent so far

    def begin(self, classes: list[int]) -> None:
        """A pass of the stream starts with these classes."""
        self.seen = sorted(set(self.seen) | set(classes))

    def flip(self, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch's labels, each flipped with probability `rate` to another class seen so far, and its keys."""
        given = labels.clone()
        draws = torch.rand(labels.numel(), generator=self.generator)
        picks = torch.randint(max(len(self.seen) - 1, 1), (labels.numel(),), generator=self.generator)
        keys = torch.arange(self.sent, self.sent + labels.numel())
        for i, y in enumerate(labels.tolist()):
            others = [c for c in self.seen if c != y]
            if self.nearest is not None:
                others = [c for c in self.nearest[y] if c in others][:1]
            if others and draws[i] < self.rate:
                given[i] = others[int(picks[i]) % len(others)]
                self.flipped[int(keys[i])] = (int(given[i]), y)
        self.sent += labels.numel()
        return given, keys

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state(), "flipped": dict(self.flipped), "sent": self.sent,
                "seen": self.seen}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])
        self.flipped, self.sent, self.seen = dict(state["flipped"]), state["sent"], list(state["seen"])

    def detection(self, learner) -> dict:
        """Precision and recall of the memory's most suspected samples, how noisy the memory is, and the CPU the
        valuation took."""
        record = {"rate": self.rate, "mode": MODES[self.nearest is not None], "flipped": len(self.flipped),
                  "sent": self.sent}
        if getattr(learner, "buffer", None) is None or len(learner.buffer) == 0:
            return record
        cpu0 = time.process_time()
        slots, scores = learner.suspects()
        cpu = time.process_time() - cpu0
        keys = learner.buffer.keys[slots.cpu()].tolist()
        wrong = torch.tensor([k in self.flipped for k in keys])
        top, below = wrong[:SUSPECTS_SCORED], scores < 0
        return {**record, "memory": len(keys), "keyed": sum(k >= 0 for k in keys), "memory_flipped": int(wrong.sum()),
                f"precision_at_{SUSPECTS_SCORED}": round(float(top.float().mean()), 4),
                f"recall_at_{SUSPECTS_SCORED}": round(float(top.sum()) / max(int(wrong.sum()), 1), 4),
                "suspected_below_zero": int(below.sum()),
                "precision_below_zero": round(float(wrong[below].float().mean()), 4) if below.any() else None,
                "recall_below_zero": round(float(wrong[below].sum()) / max(int(wrong.sum()), 1), 4),
                "suspects_cpu_seconds": round(cpu, 3)}

    def correct_found(self, learner) -> list[int]:
        """Relabel the flipped samples among the SUSPECTS_SCORED most suspected, as a user shown them would; returns
        their keys."""
        slots, _ = learner.suspects(SUSPECTS_SCORED)
        found = [k for k in learner.buffer.keys[slots.cpu()].tolist() if k in self.flipped]
        for key in found:
            given, true = self.flipped[key]
            learner.correct_sample(key, given, true)
        return found

    def stream_values(self, learner, stream) -> torch.Tensor:
        """Every sample the stream sent (`stream`: its batches again, (stored form, true labels), in order), valued
        for the whole memory as it ended (`shapley.MemoryReference`) under the label it was given, a batch at a time
        as it arrived (its samples candidates beside each other): below zero, its label disagrees with the memory."""
        memory = learner.frozen_features(learner.buffer.images[:len(learner.buffer)]).float().cpu()
        reference = MemoryReference(memory, learner.buffer.labels[:len(learner.buffer)].cpu(),
                                    getattr(learner.update_policy, "k", 3))
        position, values = 0, []
        for x, y in stream:
            keys = range(position, position + len(y))
            given = torch.tensor([self.flipped.get(key, (int(c),))[0] for key, c in zip(keys, y)])
            features = learner.frozen_features(x.to(learner.device)).float().cpu()
            # kept as floats: 5,000 small tensors between each batch's large ones grew the heap to 12 GB on CIFAR-10
            values.extend(reference.values_of(features, given).tolist())
            position += len(y)
        return torch.tensor(values)

    def review(self, learner, stream, reviewed: torch.Tensor, done: set[int]) -> dict:
        """A person shown the stream positions `reviewed` relabels the flipped ones among them (those in `done`
        already were; `done` gains the rest): precision and recall of the flips there."""
        keys = reviewed.tolist()
        wanted = {key for key in keys if key in self.flipped and key not in done}
        position = 0
        for x, y in stream:
            for key in sorted(wanted.intersection(range(position, position + len(y)))):
                learner.correct_sample(key, *self.flipped[key], x[key - position:key - position + 1])
            position += len(y)
        done |= wanted
        hits = sum(key in self.flipped for key in keys)
        return {"reviewed": len(reviewed), "precision": round(hits / max(len(reviewed), 1), 4),
                "recall": round(hits / max(len(self.flipped), 1), 4), "relabelled": len(wanted)}
