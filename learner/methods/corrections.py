"""Correcting one sample the learner has already learned from: a label found wrong (relabelled) or a sample to
forget. Its effect leaves every part that keeps one: the streaming head's statistics exactly (its features leave the
old class's sums and count and, relabelled, join the new class's; a forgotten sample's x x^T leaves the shared
scatter too), its memory slot (relabelled, or dropped), the sleep's latent store (found by its key: the next sleep
rehearses it under its new label, or not at all), and the held-back samples (which never trained: moved or dropped
there alone). What gradient steps did to the trained top cannot be taken back exactly: the next steps
and sleeps train it on the corrected memory. `ContinualLearner` inherits it.

With `suspect_rule`, an incoming sample whose value to the memory (`shapley.incoming_values`) is below zero, its
label disagreeing with the remembered samples around it, is kept out of the streaming head's statistics, of what
is replayed from the memory and of what a sleep rehearses, until a person relabels or confirms it (the memory's own
update values it as every sample, and the sleep's store keeps it, undrawn)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..memory.shapley import incoming_values

SUSPECT_EVAL = 200  # remembered samples an incoming batch is valued against: a 200 x (b + 200) valuation a batch
SUSPECT_MIN_CLASS = 20  # a class with fewer remembered samples is too young for its samples to be judged


@dataclass(frozen=True)
class Correction:
    """Where the corrected sample was found: in the memory, among the held-back samples, in the streaming head's
    statistics. Nothing found: neither the memory nor the caller had its stored form, and nothing changed."""

    in_memory: bool = False
    held_back: bool = False
    stream_head: bool = False
    in_sleep_store: bool = False

    @property
    def found(self) -> bool:
        return self.in_memory or self.held_back or self.stream_head or self.in_sleep_store


class SampleCorrections:
    def incoming_suspects(self, frozen: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Which incoming samples (their frozen features and labels) the suspect rule keeps out: a mask."""
        suspected = torch.zeros(len(labels), dtype=torch.bool)
        buffer = getattr(self, "buffer", None)
        if buffer is None or len(buffer) < 2:
            return suspected
        held = buffer.labels[:len(buffer)].cpu()
        counts = torch.bincount(held, minlength=self.num_classes)
        judged = counts[labels.cpu()] >= SUSPECT_MIN_CLASS
        if int((counts > 0).sum()) < 2 or not judged.any():
            return suspected
        sub = torch.randperm(len(buffer), generator=self._suspect_draws)[:SUSPECT_EVAL]
        memory = self.frozen_features(buffer.images[sub.to(buffer.device)]).float().cpu()
        k = getattr(getattr(self, "update_policy", None), "k", 3)
        values = incoming_values(memory, held[sub], frozen[judged.to(frozen.device)].float().cpu(),
                                 labels.cpu()[judged], k)
        suspected[judged] = values < 0
        return suspected

    def correct_sample(self, key: int, old_class: int, new_class: int | None,
                       stored: torch.Tensor | None = None) -> Correction:
        """Relabel as `new_class` (None: forget) the sample the caller called `key` (`observe(keys=...)`), learned
        as `old_class`. The memory finds it by its key; elsewhere `stored` (its stored form, `encode` of its pixels:
        [1, ...]) says what it was, where the caller still has it. `new_class == old_class`: a person confirmed the
        label, and the sample is never a suspect again."""
        if new_class == old_class:
            self.confirmed.add(key)
            return self._admit_kept_out(key, old_class, stored) if key in self.kept_out else Correction()
        sleeper = getattr(self, "sleeper", None)
        in_store = sleeper is not None and sleeper.correct(key, new_class)  # first: a full disk changes nothing
        buffer = getattr(self, "buffer", None)
        slot, stored = self._stored_form(key, stored)
        if stored is None:
            return Correction(in_sleep_store=in_store)
        if new_class is not None:
            self.ensure_classes(new_class + 1)
        held = self.held_back
        if held is not None and held.correct(stored[0], old_class, new_class):
            self.version += 1
            return Correction(held_back=True)
        if self.stream_head is not None:
            features = self.frozen_features(stored.to(self.device)).float()
            channels = self.backbone.channel_means(stored) if self.channel_sums is not None else None
            if key in self.kept_out:  # the suspect rule kept it out: relabelled, it comes in
                self.kept_out.discard(key)
            else:
                self.stream_head.remove(features, torch.tensor([old_class]))
                if channels is not None:
                    self.channel_sums.remove(channels, torch.tensor([old_class]))
            if new_class is not None:
                self.stream_head.update(features, torch.tensor([new_class]))
                if channels is not None:
                    self.channel_sums.update(channels, torch.tensor([new_class]))
            if self.recent_features is not None:  # kept under the class it left
                self.recent_features.drop(key)
            self._solved = None
        if slot is not None:
            if new_class is None:
                buffer.remove_slots(torch.tensor([slot]))
            else:
                buffer.labels[slot] = new_class
        self.version += 1
        return Correction(in_memory=slot is not None, stream_head=self.stream_head is not None,
                          in_sleep_store=in_store)

    def _admit_kept_out(self, key: int, label: int, stored: torch.Tensor | None) -> Correction:
        """A sample the suspect rule kept out, confirmed by a person: it joins the streaming head's statistics (its
        stored form from the memory or the caller), and replay and sleep may draw it again."""
        slot, stored = self._stored_form(key, stored)
        if stored is None:  # nothing to learn it from: it stays out
            return Correction()
        self.kept_out.discard(key)
        if self.stream_head is not None:
            self.stream_head.update(self.frozen_features(stored.to(self.device)).float(), torch.tensor([label]))
            if self.channel_sums is not None:
                self.channel_sums.update(self.backbone.channel_means(stored), torch.tensor([label]))
            self._solved = None
        self.version += 1
        return Correction(in_memory=slot is not None, stream_head=self.stream_head is not None)

    def _stored_form(self, key: int, stored: torch.Tensor | None) -> tuple[int | None, torch.Tensor | None]:
        """The memory's slot of the sample `key` and its stored form there, else the caller's (`stored`)."""
        buffer = getattr(self, "buffer", None)
        slot = buffer.slot_of(key) if buffer is not None else None
        return slot, buffer.images[slot:slot + 1] if slot is not None else stored

    def trusted(self, keys: torch.Tensor) -> torch.Tensor | None:
        """A mask of the `keys` (a memory's or a sleep store's) that replay and sleep may draw: all but the samples
        the suspect rule kept out, until a person relabels or confirms them. None: every one."""
        if not self.kept_out:
            return None
        return ~torch.isin(keys.cpu(), torch.tensor(sorted(self.kept_out), dtype=keys.dtype))
