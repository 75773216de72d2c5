"""Wrong labels, found by ASER's values and corrected (learner.memory.shapley.leave_one_out_values,
`ReplayLearner.suspects`, `ContinualLearner.correct_sample`), in process on real data: Split EuroSAT tiles as
Lite0's cut-11 latents, a fifth of their labels flipped to another class of the stream, into ASER's class-balanced
memory with streaming LDA serving (the service's default, at a small scale)."""

from __future__ import annotations

import pytest
import torch

from learner import make_learner
from learner.data import task_batches

CLASSES = [0, 1, 2, 3]


def stream(data, flip_share: float, seed: int = 0):
    """The four classes' training tiles in batches of 10, each with its key (its position in the stream) and a
    share of the labels flipped to another of the four classes; yields (x, y given, y true, keys)."""
    flips = torch.Generator().manual_seed(100 + seed)
    position = 0
    for x, y in task_batches(data, CLASSES, 10, torch.Generator().manual_seed(seed)):
        given = y.clone()
        flip = torch.rand(len(y), generator=flips) < flip_share
        shift = torch.randint(1, len(CLASSES), (len(y),), generator=flips)
        given[flip] = (y[flip] + shift[flip]) % len(CLASSES)
        yield x, given, y, torch.arange(position, position + len(y))
        position += len(y)


def learner_for(backbone):
    """ASER's memory valuing in the frozen features (the default's space: at its cut the top is the linear head
    alone), streaming LDA serving; the top above cut 11 steps once only, which these tests do not read."""
    return make_learner("cb-sv-duel", len(CLASSES), mem_size=200, backbone=backbone, serving_head="slda",
                        seed=0, lr=0.01, train_every=10**6, frozen_values=True)


@pytest.fixture(scope="module")
def noisy(eurosat_latents):
    """A learner that has seen the stream with a fifth of its labels flipped, and each sample's true label."""
    data, backbone = eurosat_latents
    learner, truth, given = learner_for(backbone), {}, {}
    for x, y, true, keys in stream(data, 0.2):
        learner.observe(x, y, keys=keys)
        truth.update(zip(keys.tolist(), true.tolist()))
        given.update(zip(keys.tolist(), y.tolist()))
    return learner, truth, given


def test_the_memory_knows_which_sample_each_slot_holds(noisy):
    learner, truth, given = noisy
    buf = learner.buffer
    keys = buf.keys[:len(buf)].tolist()
    assert -1 not in keys and len(set(keys)) == len(keys) == len(buf)
    assert [given[k] for k in keys] == buf.labels[:len(buf)].tolist()  # the label each slot holds is its sample's


def test_the_most_suspected_samples_are_mostly_the_flipped_ones(noisy):
    learner, truth, given = noisy
    slots, scores = learner.suspects()
    keys = learner.buffer.keys[slots].tolist()
    wrong = torch.tensor([truth[k] != given[k] for k in keys])
    assert wrong.float().mean() > 0.05  # the memory holds flipped samples to find
    top = wrong[:20].float().mean()
    assert top >= 0.6 and top > 3 * wrong.float().mean()  # far above the share a random pick finds
    assert scores[wrong].mean() < 0 < scores[~wrong].mean()
    assert torch.equal(scores, scores.sort().values)  # most suspected first


def test_a_relabel_leaves_the_statistics_as_if_the_label_had_come_right(eurosat_latents):
    """Relabelled, one flipped sample's features leave its given class and join its true one: streaming LDA's
    statistics equal those of the same stream with that label right; forgotten, those of the stream without it."""
    data, backbone = eurosat_latents
    batches = list(stream(data, 0.2))
    x, y, true, keys = next(b for b in batches if (b[1] != b[2]).any())
    at = int(torch.nonzero(y != true)[0])
    key, wrong, right = int(keys[at]), int(y[at]), int(true[at])
    fixed = [(bx, torch.where(bk == key, right, by), bk) for bx, by, _, bk in batches]
    without = [(bx[bk != key], by[bk != key], bk[bk != key]) for bx, by, _, bk in batches]
    learners = [learner_for(backbone) for _ in range(4)]
    for learner, run in zip(learners, ([(b[0], b[1], b[3]) for b in batches],) * 2 + (fixed, without)):
        for bx, by, bk in run:
            learner.observe(bx, by, keys=bk)
    relabelled, forgotten, right_all_along, never_came = learners
    stored = backbone.encode(x[at:at + 1])  # the caller's copy, where the memory has not kept it
    assert relabelled.correct_sample(key, wrong, right, stored).found
    assert forgotten.correct_sample(key, wrong, None, stored).found
    for corrected, reference in ((relabelled, right_all_along), (forgotten, never_came)):
        ours, theirs = corrected.stream_head.state_dict(), reference.stream_head.state_dict()
        assert all(torch.allclose(ours[k], theirs[k], atol=1e-6) for k in theirs)
    assert forgotten.buffer.slot_of(key) is None
    slot = relabelled.buffer.slot_of(key)
    assert slot is None or int(relabelled.buffer.labels[slot]) == right


def test_the_sleep_store_rehearses_a_corrected_sample_under_its_new_label_or_not_at_all(eurosat_latents):
    """Every sample the learner trained on sits in the sleep's latent store under its key: a relabel reaches it even
    when neither the memory nor the caller has the sample any more, a forgotten one leaves it, and a round trip of
    the store keeps the keys."""
    from learner.methods.sleep import SleepConfig

    data, backbone = eurosat_latents
    learner = make_learner("cb-sv-duel", len(CLASSES), mem_size=50, backbone=backbone, serving_head="slda", seed=0,
                           lr=0.01, train_every=0, sleep=SleepConfig(store_capacity=10_000))
    given = {}
    for x, y, _, keys in stream(data, 0.2):
        learner.observe(x, y, keys=keys)
        given.update(zip(keys.tolist(), y.tolist()))
    store = learner.sleeper.store
    assert sorted(store.keys[:len(store)].tolist()) == sorted(given)  # every sample, each once
    outside = [k for k in given if learner.buffer.slot_of(k) is None]
    relabelled, forgotten = outside[:2]
    new = (given[relabelled] + 1) % len(CLASSES)
    learner.sleeper.mark = learner.sleeper.store.arrived  # as after a sleep: nothing new
    assert learner.sleeper.new_samples == 0 and learner.sleeper.budget() == 0
    assert learner.correct_sample(relabelled, given[relabelled], new).in_sleep_store  # no pixels given
    assert learner.correct_sample(forgotten, given[forgotten], None).in_sleep_store
    # the relabel is new to the top: the next sleep has a budget for it though nothing arrived; the drop is not
    assert learner.sleeper.new_samples == 1 and learner.sleeper.budget() == learner.sleeper.config.epochs
    slot_of = {k: i for i, k in enumerate(store.keys[:len(store)].tolist())}
    assert int(store.labels[slot_of[relabelled]]) == new and forgotten not in slot_of
    expected = {**given, relabelled: new}
    del expected[forgotten]
    assert dict(zip(store.keys[:len(store)].tolist(), store.labels[:len(store)].tolist())) == expected
    again = make_learner("cb-sv-duel", len(CLASSES), mem_size=50, backbone=backbone, serving_head="slda", seed=0,
                         lr=0.01, train_every=0, sleep=SleepConfig(store_capacity=10_000))
    again.load_state_dict(learner.state_dict())
    assert torch.equal(again.sleeper.store.keys[:len(store)], store.keys[:len(store)])
    assert again.sleeper.new_samples == 1
    assert not again.correct_sample(forgotten, given[forgotten], None).in_sleep_store  # gone: nothing to do


def test_a_sample_found_nowhere_changes_nothing(noisy):
    learner, _, _ = noisy
    before = learner.stream_head.state_dict()
    assert not learner.correct_sample(10**9, 0, 1).found
    assert all(torch.equal(before[k], v) for k, v in learner.stream_head.state_dict().items())


def test_the_keys_survive_a_restore(noisy, eurosat_latents):
    learner, _, _ = noisy
    again = learner_for(eurosat_latents[1])
    again.load_state_dict(learner.state_dict())
    assert torch.equal(again.buffer.keys[:len(again.buffer)], learner.buffer.keys[:len(learner.buffer)])


def test_the_suspect_rule_flags_wrong_labels_far_more_often_than_right_ones(noisy, eurosat_latents):
    learner, _, _ = noisy
    data, _ = eurosat_latents
    test = torch.isin(data.test_y, torch.tensor(CLASSES))
    x, y = data.test_x[test], data.test_y[test]
    frozen = learner.frozen_features(x).float()
    right = learner.incoming_suspects(frozen, y).float().mean()
    wrong = learner.incoming_suspects(frozen, (y + 1) % len(CLASSES)).float().mean()
    assert wrong > 0.45 and right < 0.15 and wrong > 5 * right  # measured: 0.62 and 0.04


def ruled_learner(backbone):
    from learner.methods.sleep import SleepConfig

    return make_learner("cb-sv-duel", len(CLASSES), mem_size=200, backbone=backbone, serving_head="slda", seed=0,
                        lr=0.01, train_every=0, frozen_values=True, suspect_rule=True,
                        sleep=SleepConfig(source="both", store_capacity=2000))


@pytest.fixture(scope="module")
def ruled(eurosat_latents):
    """A learner under the suspect rule that has seen the noisy stream, with a sleep that rehearses from its memory
    and its latent store alike, and each sample by key: (its pixels, the label given, the true one)."""
    data, backbone = eurosat_latents
    learner = ruled_learner(backbone)
    samples = {}
    for x, y, true, keys in stream(data, 0.2):
        learner.observe(x, y, keys=keys)
        samples.update({int(k): (x[i:i + 1], int(y[i]), int(true[i])) for i, k in enumerate(keys)})
    assert learner.kept_out and learner.suspects_kept_out == len(learner.kept_out)
    return learner, samples


def test_a_resumed_learner_still_counts_what_the_rule_kept_out(ruled, eurosat_latents):
    """The count of samples kept out goes on from a checkpoint (a resumed benchmark run reported only its own)."""
    learner, _ = ruled
    resumed = ruled_learner(eurosat_latents[1])
    resumed.load_state_dict(learner.state_dict())
    assert resumed.suspects_kept_out == learner.suspects_kept_out > 0 and resumed.kept_out == learner.kept_out


def test_a_sample_the_rule_kept_out_comes_in_when_relabelled(ruled, eurosat_latents):
    """The suspect rule keeps a sample out of streaming LDA and remembers its key: relabelled, it joins its new class
    (nothing is taken from the old one, which never had it); forgotten, nothing moves."""
    learner, samples = ruled
    backbone = eurosat_latents[1]
    flipped_out = [k for k in sorted(learner.kept_out) if samples[k][1] != samples[k][2]]
    key = next(k for k in flipped_out if learner.buffer.slot_of(k) is None)
    x, given, true = samples[key]
    counts = learner.stream_head.counts.clone()
    assert learner.correct_sample(key, given, true, backbone.encode(x)).stream_head
    moved = learner.stream_head.counts - counts
    assert moved[true] == 1 and moved.abs().sum() == 1 and key not in learner.kept_out
    learner.solved_head()  # the statistics still solve


def test_a_kept_out_sample_a_person_confirms_joins_its_class(ruled, eurosat_latents):
    """A false alarm of the rule (its label right), confirmed: it joins the class it was given, and is no suspect."""
    learner, samples = ruled
    key = next(k for k in sorted(learner.kept_out) if samples[k][1] == samples[k][2]
               and learner.buffer.slot_of(k) is None)
    x, given, _ = samples[key]
    counts = learner.stream_head.counts.clone()
    assert learner.correct_sample(key, given, given, eurosat_latents[1].encode(x)).stream_head
    moved = learner.stream_head.counts - counts
    assert moved[given] == 1 and moved.abs().sum() == 1
    assert key not in learner.kept_out and key in learner.confirmed


def test_suspects_are_neither_replayed_nor_rehearsed_in_a_sleep(ruled):
    """Replay retrieves only slots whose sample the rule did not keep out; a sleep draws neither such a memory slot
    nor such a latent of its store."""
    learner, _ = ruled
    buffer, store = learner.buffer, learner.sleeper.store
    out = torch.tensor(sorted(learner.kept_out))
    remembered = torch.isin(buffer.keys[:len(buffer)], out)
    assert remembered.any() and torch.isin(store.keys[:len(store)], out).any()  # there are suspects to keep out
    eligible = learner.context().eligible_slots(buffer).cpu()
    assert len(eligible) == int((~remembered).sum()) and not torch.isin(buffer.keys[eligible], out).any()
    read, drawn = store.read, []
    store.read = lambda slots: (drawn.append(slots), read(slots))[1]
    suspect_rows = buffer.images[:len(buffer)][remembered].flatten(1)
    latents, _ = learner.sleeper._draw(learner, 400, torch.zeros(len(store), dtype=torch.bool))
    store.read = read
    from_memory = latents[:200].flatten(1)
    assert not (from_memory[:, None] == suspect_rows[None]).all(-1).any()
    assert not torch.isin(store.keys[torch.cat(drawn)], out).any()
    assert learner.sleep(budget=320).updates == 320  # and a sleep runs on what is trusted
