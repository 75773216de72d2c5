"""Every trained sample's latent, compressed, for a sleep to rehearse (`learner.methods.sleep`).

ASER's memory keeps M samples chosen by value; a sleep trains the top i.i.d.-style over everything the
device has seen, as REMIND and SIESTA do from compressed mid-network features. A latent [C, H, W] is kept in
8 bits with one scale a channel (symmetric: the cut's output is a linear projection, signed), 7,392 bytes at
cut 11 and 128 px against 14,336 in fp16; a pooled 8-bit latent is kept as it is. Once `capacity` is reached
a new sample evicts a random member of the largest class (its own class's, when that is among the largest), so the
store stays class-balanced and an old class keeps its share. Each slot records when it arrived, so a sleep can find
what is new, and the caller's id of its sample, so that a label found wrong is corrected here too (`correct`). The
codes live in tensors here; a store that keeps them elsewhere (the service's, on disk) overrides `_put` and `_get`.

>>> import torch
>>> store = LatentStore(capacity=4, shape=(2, 1, 1), seed=0)
>>> store.add(torch.tensor([[[[127.0]], [[-254.0]]]] * 3), torch.tensor([0, 0, 0]))
>>> len(store), store.class_counts()
(3, {0: 3})
>>> store.add(torch.zeros(2, 2, 1, 1), torch.tensor([1, 1]))  # full: class 0 (the largest) gives one up
>>> store.class_counts()
{0: 2, 1: 2}
>>> latents, labels = store.read((store.labels == 0).nonzero()[:1, 0])
>>> latents.flatten().tolist(), labels.tolist()
([127.0, -254.0], [0])
>>> store.add(torch.ones(1, 2, 1, 1), torch.tensor([1]), keys=torch.tensor([41]))
>>> store.correct(41, None), store.class_counts()  # forgotten: its slot is free
(True, {0: 2, 1: 1})
"""

from __future__ import annotations

import torch

CODE_MAX = 127  # symmetric int8


def sample_bytes(shape: tuple[int, ...], eight_bit_input: bool) -> int:
    """What one stored sample takes: its codes, a scale a channel, and its label and arrival."""
    scales = 0 if eight_bit_input else 2 * (1 if len(shape) == 1 else shape[0])
    return int(torch.tensor(shape).prod()) + scales + 16


def compress(latents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Latents [n, ...] -> (8-bit codes, fp16 scales [n, channels]) or, already 8-bit, (themselves, None)."""
    if latents.dtype == torch.uint8:
        return latents, None
    x = latents.float()
    peak = x.abs().flatten(2).amax(2) if x.dim() > 2 else x.abs().amax(1, keepdim=True)
    scales = (peak / CODE_MAX).clamp_min(1e-8).to(torch.float16)
    shape = (*scales.shape, *([1] * (x.dim() - 2))) if x.dim() > 2 else scales.shape
    codes = (x / scales.float().view(shape)).round().clamp(-CODE_MAX, CODE_MAX).to(torch.int8)
    return codes, scales


def decompress(codes: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
    if scales is None:
        return codes
    shape = (*scales.shape, *([1] * (codes.dim() - 2))) if codes.dim() > 2 else scales.shape
    return codes.float() * scales.float().view(shape)


class LatentStore:
    def __init__(self, capacity: int, shape: tuple[int, ...], eight_bit_input: bool = False, seed: int = 0):
        if capacity < 1:
            raise ValueError(f"the latent store needs room for at least one sample, got {capacity}")
        self.capacity, self.shape = capacity, tuple(shape)
        self.eight_bit_input = eight_bit_input  # pooled latents arrive in 8 bits already: kept as they are
        self.channels = 1 if len(self.shape) == 1 else self.shape[0]
        self._allocate()
        self.labels = torch.full((capacity,), -1, dtype=torch.long)
        self.arrival = torch.zeros(capacity, dtype=torch.long)  # the sample's rank in the stream, from 1
        self.keys = torch.full((capacity,), -1, dtype=torch.long)  # the caller's id of the sample (-1: none given)
        self.size = 0
        self.arrived = 0  # samples ever added
        self.generator = torch.Generator().manual_seed(seed)

    def __len__(self) -> int:
        return self.size

    def _allocate(self) -> None:
        self.codes = torch.zeros((self.capacity, *self.shape),
                                 dtype=torch.uint8 if self.eight_bit_input else torch.int8)
        self.scales = None if self.eight_bit_input else torch.zeros((self.capacity, self.channels), dtype=torch.float16)

    @property
    def bytes_per_sample(self) -> int:
        return sample_bytes(self.shape, self.eight_bit_input)

    def add(self, latents: torch.Tensor, labels: torch.Tensor, keys: torch.Tensor | None = None) -> None:
        codes, scales = compress(latents.detach().cpu())
        keys = torch.full((len(labels),), -1, dtype=torch.long) if keys is None else keys.cpu().long()
        written: dict[int, int] = {}  # slot -> the sample it holds now (a later one of the batch may evict it)
        evicted = []  # the arrivals of the samples that gave up their slots
        for i, label in enumerate(labels.cpu().tolist()):
            slot = self.size if self.size < self.capacity else self._victim(label)
            if slot < self.size and slot not in written:
                evicted.append(int(self.arrival[slot]))
            self.size = max(self.size, slot + 1)
            self.arrived += 1
            self.labels[slot], self.arrival[slot], self.keys[slot] = label, self.arrived, keys[i]
            written[slot] = i
        if written:
            rows = torch.tensor(list(written.values()))
            self._put(list(written), codes[rows], None if scales is None else scales[rows], evicted)

    def _put(self, slots: list[int], codes: torch.Tensor, scales: torch.Tensor | None, evicted: list[int]) -> None:
        index = torch.tensor(slots)
        self.codes[index] = codes
        if scales is not None:
            self.scales[index] = scales

    def _get(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.codes[slots], None if self.scales is None else self.scales[slots]

    def _victim(self, incoming: int) -> int:
        """A random member of the largest class: the incoming sample's own when it is among the largest, so that no
        two classes are ever more than one sample apart once the store is full."""
        labels = self.labels[:self.size]
        classes, counts = labels.unique(return_counts=True)
        largest = classes[counts == counts.max()]
        if incoming in largest.tolist():
            largest = torch.tensor([incoming])
        target = largest[torch.randint(len(largest), (1,), generator=self.generator)]
        members = (labels == target).nonzero().flatten()
        return int(members[torch.randint(len(members), (1,), generator=self.generator)])

    def read(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The slots' latents, decompressed (float, or the 8-bit pooled form), and their labels."""
        return decompress(*self._get(slots)), self.labels[slots]

    def class_counts(self) -> dict[int, int]:
        classes, counts = self.labels[:self.size].unique(return_counts=True)
        return dict(zip(classes.tolist(), counts.tolist()))

    def draw_balanced(self, n: int, generator: torch.Generator, among: torch.Tensor | None = None) -> torch.Tensor:
        """n slots: a class uniformly, then a member of it uniformly (`among`: a mask of eligible slots)."""
        eligible = torch.ones(self.size, dtype=torch.bool) if among is None else among[:self.size]
        labels = self.labels[:self.size]
        classes = labels[eligible].unique()
        if not len(classes):
            return torch.zeros(0, dtype=torch.long)
        picked = classes[torch.randint(len(classes), (n,), generator=generator)]
        out = torch.empty(n, dtype=torch.long)
        for c in picked.unique().tolist():
            members = ((labels == c) & eligible).nonzero().flatten()
            where = (picked == c).nonzero().flatten()
            out[where] = members[torch.randint(len(members), (len(where),), generator=generator)]
        return out

    def arrived_after(self, mark: int) -> torch.Tensor:
        """A mask of the slots whose sample arrived after the `mark`-th."""
        return self.arrival[:self.size] > mark

    def forget_class(self, class_id: int) -> int:
        return self._drop(self.labels[:self.size] == class_id)

    def correct(self, key: int, new_class: int | None) -> bool:
        """Relabel as `new_class` (None: drop) the sample the caller called `key`; whether the store held it."""
        found = self.keys[:self.size] == key
        if not bool(found.any()):
            return False
        if new_class is None:
            self._drop(found)
        else:
            self.labels[:self.size][found] = new_class
        return True

    def _drop(self, gone: torch.Tensor) -> int:
        """Free the slots of a mask, the others kept in order at the front; how many were freed."""
        removed = int(gone.sum())
        if removed:
            order = torch.cat([(~gone).nonzero().flatten(), gone.nonzero().flatten()])
            for name in ("codes", "scales", "labels", "arrival", "keys"):
                tensor = getattr(self, name)
                if tensor is not None:
                    tensor[:self.size] = tensor[:self.size][order]
            self.size -= removed
            self.labels[self.size:] = -1
            self.keys[self.size:] = -1
        return removed

    def state_dict(self) -> dict:
        n = self.size
        return {"capacity": self.capacity, "shape": list(self.shape), "size": n, "arrived": self.arrived,
                "codes": self.codes[:n].clone(), "scales": None if self.scales is None else self.scales[:n].clone(),
                "labels": self.labels[:n].clone(), "arrival": self.arrival[:n].clone(), "keys": self.keys[:n].clone(),
                "generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        if tuple(state["shape"]) != self.shape:
            raise ValueError(f"a latent store of shape {tuple(state['shape'])} cannot load into {self.shape}")
        n = min(state["size"], self.capacity)
        self.size, self.arrived = n, state["arrived"]
        self.codes[:n], self.labels[:n] = state["codes"][:n], state["labels"][:n]
        self.arrival[:n] = state["arrival"][:n]
        self.keys.fill_(-1)
        if "keys" in state:  # a checkpoint from before the store kept ids: its samples cannot be corrected here
            self.keys[:n] = state["keys"][:n]
        if self.scales is not None:
            self.scales[:n] = state["scales"][:n]
        self.generator.set_state(state["generator"])
