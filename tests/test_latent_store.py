"""The sleep's latent store: in memory (learner.memory.latent_store) and on disk (service.storage.latent_store) alike,
bounded and class-balanced, 8 bits within a scale of the latent, and on disk following the lineage across restarts."""

from __future__ import annotations

import torch

from learner.memory.latent_store import LatentStore
from service.storage.latent_store import DiskLatentStore, store_capacity

SHAPE = (4, 2, 2)
IDENTITY = {"backbone": "lite0", "cut": 11, "input_size": 64}


def latents(n: int, seed: int) -> torch.Tensor:
    return torch.randn((n, *SHAPE), generator=torch.Generator().manual_seed(seed)).to(torch.float16)


def test_eight_bits_a_channel_keep_a_latent_within_half_a_step_of_its_scale():
    store, x = LatentStore(10, SHAPE), latents(5, 0)
    store.add(x, torch.arange(5))
    back, labels = store.read(torch.arange(5))
    step = x.float().abs().flatten(2).amax(2) / 127  # a channel's quantisation step
    assert labels.tolist() == [0, 1, 2, 3, 4]
    assert bool(((back - x.float()).abs() <= step[..., None, None] / 2 + 1e-3).all())


def test_on_disk_it_answers_as_in_memory_and_stays_balanced_when_full(tmp_path):
    memory, disk = LatentStore(12, SHAPE, seed=3), DiskLatentStore(tmp_path / "l.db", 12, SHAPE, False, IDENTITY, 3)
    for i in range(6):  # class 0 first, then classes 1 and 2: the store fills, then evicts from the largest
        labels = torch.zeros(5, dtype=torch.long) if i < 2 else torch.tensor([1, 2, 1, 2, 1])
        for store in (memory, disk):
            store.add(latents(5, i), labels)
    assert len(disk) == len(memory) == 12 and disk.arrived == memory.arrived == 30
    assert disk.class_counts() == memory.class_counts() == {0: 4, 1: 4, 2: 4}
    slots = torch.arange(12)
    assert torch.equal(disk.read(slots)[0], memory.read(slots)[0]) and torch.equal(disk.read(slots)[1], memory.read(slots)[1])


def test_on_disk_it_survives_a_restart_goes_back_to_a_checkpoint_and_empties_for_another_lineage(tmp_path):
    path = tmp_path / "l.db"
    store = DiskLatentStore(path, 100, SHAPE, False, IDENTITY)
    store.add(latents(6, 0), torch.tensor([0, 0, 1, 1, 2, 2]))
    saved = store.state_dict()  # a checkpoint here
    store.add(latents(4, 1), torch.tensor([3, 3, 3, 3]))
    store.close()

    again = DiskLatentStore(path, 100, SHAPE, False, IDENTITY)
    assert len(again) == 10 and again.arrived == 10 and again.class_counts()[3] == 4
    again.load_state_dict(saved)  # the restart from the checkpoint: what arrived after it is trained again
    assert len(again) == 6 and again.arrived == 6 and 3 not in again.class_counts()
    assert again.forget_class(1) == 2 and again.class_counts() == {0: 2, 2: 2}
    again.close()

    other = DiskLatentStore(path, 100, SHAPE, False, {**IDENTITY, "cut": 15})
    assert len(other) == 0 and other.arrived == 0


def test_a_corrected_sample_is_relabelled_or_dropped_on_disk_as_in_memory_and_stays_so_after_a_restart(tmp_path):
    path = tmp_path / "l.db"
    memory, disk = LatentStore(100, SHAPE), DiskLatentStore(path, 100, SHAPE, False, IDENTITY)
    for store in (memory, disk):
        store.add(latents(6, 0), torch.tensor([0, 0, 1, 1, 2, 2]), keys=torch.arange(100, 106))
        assert store.correct(101, 2) and store.correct(104, None) and not store.correct(999, 1)
        assert dict(zip(store.keys[:len(store)].tolist(), store.labels[:len(store)].tolist())) == {
            100: 0, 101: 2, 102: 1, 103: 1, 105: 2}
    assert torch.equal(disk.read(torch.arange(5))[0], memory.read(torch.arange(5))[0])  # the same latents stayed
    saved = disk.state_dict()
    disk.close()
    again = DiskLatentStore(path, 100, SHAPE, False, IDENTITY)
    again.load_state_dict(saved)
    assert again.class_counts() == {0: 1, 1: 2, 2: 2} and 104 not in again.keys.tolist()
    assert again.correct(101, 2)  # applied again after a restart: the same end
    assert again.class_counts() == {0: 1, 1: 2, 2: 2}
    again.close()


def test_a_store_written_before_the_keys_opens_and_its_samples_have_none(tmp_path):
    import sqlite3

    path = tmp_path / "l.db"
    DiskLatentStore(path, 100, SHAPE, False, IDENTITY).add(latents(2, 0), torch.tensor([0, 1]))
    with sqlite3.connect(path) as conn:  # the file as it was before the column
        conn.execute("ALTER TABLE latents DROP COLUMN sample_key")
    old = DiskLatentStore(path, 100, SHAPE, False, IDENTITY)
    assert len(old) == 2 and old.keys[:2].tolist() == [-1, -1] and not old.correct(0, 1)
    old.add(latents(1, 1), torch.tensor([1]), keys=torch.tensor([7]))
    assert old.correct(7, 0) and old.class_counts() == {0: 2, 1: 1}


def test_the_size_bound_is_in_megabytes_of_what_a_sample_takes():
    # cut 11 at 160 px: 112x10x10 codes, a fp16 scale for each of 112 channels, a label and an arrival
    assert store_capacity(512, (112, 10, 10), False) == 512 * 2**20 // (11200 + 224 + 16)
    assert store_capacity(0.0001, (112, 10, 10), False) == 1
