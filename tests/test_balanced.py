"""The class-balanced memory (`learner.memory.balanced`) on real CIFAR-10 images: balance, CBRS's odds,
the value rules against `knn_shapley` by hand, and the bound on stale features."""

import math

import pytest
import torch

import learner.memory.balanced as balanced
from learner import make_learner
from learner.data import task_batches
from learner.memory.balanced import VICTIM_RULES, ClassBalancedUpdate, refresh_stale
from learner.memory.buffer import ReplayBuffer
from learner.memory.latent import Latent
from learner.memory.policy import StepContext
from learner.memory.shapley import knn_shapley


def colour_features(images: torch.Tensor) -> torch.Tensor:
    """A fixed latent space for policy-level tests: each image's mean colour and its spread."""
    x = images.float() / 255
    return torch.cat([x.mean((2, 3)), x.std((2, 3), correction=0)], 1)


def context(buffer: ReplayBuffer, seed: int = 0, version: int = 0) -> StepContext:
    return StepContext(latent=Latent(colour_features, buffer, version), generator=torch.Generator().manual_seed(seed),
                       model=None, lr=0.1, num_classes=10, to_input=None)


@pytest.mark.parametrize("rule", VICTIM_RULES)
def test_once_full_the_largest_class_never_grows_and_each_task_ends_balanced(rule, cifar10_slice):
    """Five tasks of two classes, 250 real images each, M=100: after every batch once full, the
    largest class holds no more than before; at the end of each task every class seen holds its
    share within one slot."""
    buffer, update = ReplayBuffer(100, (3, 32, 32)), ClassBalancedUpdate(rule, k=3, max_age=0)
    ctx = context(buffer)
    for task in range(5):
        classes = [2 * task, 2 * task + 1]
        for x, y in task_batches(cifar10_slice, classes, 10, torch.Generator().manual_seed(task)):
            before = max(buffer.class_counts().values(), default=0)
            full = buffer.is_full
            ctx.latent = Latent(colour_features, buffer, ctx.latent.version + 1)
            update.update(buffer, x, y, ctx)
            if full:
                assert max(buffer.class_counts().values()) <= before
        counts = buffer.class_counts()
        assert sorted(counts) == list(range(2 * task + 2)) and sum(counts.values()) == 100
        assert max(counts.values()) - min(counts.values()) <= 1, counts
    assert update.seen == {c: 250 for c in range(10)} and buffer.n_seen == 2500


def test_a_largest_class_enters_with_reservoir_odds(cifar10_slice):
    """One class alone: CBRS is reservoir sampling within it, so sample t enters w.p. M/t. Over 200
    repetitions of the 11th sample into a memory of 10, the count of entries is Binomial(200, 10/11):
    its 99.9% range."""
    x = cifar10_slice.train_x[:11]
    y = torch.zeros(11, dtype=torch.long)
    entered = 0
    for seed in range(200):
        buffer, update = ReplayBuffer(10, (3, 32, 32)), ClassBalancedUpdate("random")
        update.update(buffer, x, y, context(buffer, seed))
        entered += int((buffer.images == x[10]).flatten(1).all(1).any())
    p = 10 / 11
    sd = math.sqrt(200 * p * (1 - p))
    assert abs(entered - 200 * p) < 3.3 * sd, entered


def hand_values(feats, labels, perm, k):
    """Each slot's KNN-SV, summed over the other half of a random split, computed directly."""
    n = feats.shape[0]
    a, b = perm[: n // 2], perm[n // 2:]
    values = torch.zeros(n)
    for cand, ev in ((a, b), (b, a)):
        values[cand] = knn_shapley(feats[ev], labels[ev], feats[cand], labels[cand], k).sum(0)
    return values


@pytest.mark.parametrize("rule", ["value", "duel"])
def test_the_value_rules_evict_the_lowest_valued_candidate(rule, cifar10_slice):
    """A memory of 12 real images: class 0 holds 7 (the largest), class 1 holds 5; an incoming
    sample of class 1 evicts a member of class 0: the one of lowest KNN-SV (value), or the lower of
    two random members (duel), as computed by hand with the same random draws."""
    x = torch.cat([cifar10_slice.train_x[cifar10_slice.train_y == c][:n] for c, n in ((0, 7), (1, 6))])
    y = torch.tensor([0] * 7 + [1] * 6)
    buffer = ReplayBuffer(12, (3, 32, 32))
    buffer.write(torch.arange(12), x[:12], y[:12])
    ctx = context(buffer, seed=5)
    mirror = torch.Generator().set_state(ctx.generator.get_state())
    ClassBalancedUpdate(rule, k=3, max_age=0).update(buffer, x[12:], y[12:], ctx)

    torch.randint(1, (1,), generator=mirror)  # the victim class among the tied largest (one here)
    members = torch.arange(7)
    if rule == "duel":
        members = members[torch.randperm(7, generator=mirror)[:2]]
    values = hand_values(colour_features(x[:12]), y[:12], torch.randperm(12, generator=mirror), k=3)
    victim = int(members[values[members].argmin()])
    assert torch.equal(buffer.images[victim], x[12]) and buffer.labels[victim] == 1
    assert buffer.class_counts() == {0: 6, 1: 6}


def test_compete_keeps_a_sample_of_a_largest_class_out_unless_it_is_worth_more(cifar10_slice):
    """A balanced full memory: an incoming sample of a largest class enters only if its KNN-SV (the
    mean of its values in the two halves) exceeds its class's lowest; checked by hand."""
    x0 = cifar10_slice.train_x[cifar10_slice.train_y == 0][:7]
    x1 = cifar10_slice.train_x[cifar10_slice.train_y == 1][:6]
    x, y = torch.cat([x0[:6], x1]), torch.tensor([0] * 6 + [1] * 6)
    buffer = ReplayBuffer(12, (3, 32, 32))
    buffer.write(torch.arange(12), x, y)
    ctx = context(buffer, seed=2)
    mirror = torch.Generator().set_state(ctx.generator.get_state())
    ClassBalancedUpdate("compete", k=3, max_age=0).update(buffer, x0[6:], torch.tensor([0]), ctx)

    perm = torch.randperm(12, generator=mirror)
    feats, new = colour_features(x), colour_features(x0[6:])
    memory, incoming = torch.zeros(12), []
    for cand, ev in ((perm[:6], perm[6:]), (perm[6:], perm[:6])):
        v = knn_shapley(feats[ev], y[ev], torch.cat([feats[cand], new]), torch.cat([y[cand], torch.tensor([0])]), 3).sum(0)
        memory[cand], _ = v[:6], incoming.append(v[6])
    enters = (incoming[0] + incoming[1]) / 2 > memory[:6].min()
    stored = (buffer.images == x0[6]).flatten(1).all(1).any()
    assert bool(stored) == bool(enters)
    if enters:
        assert not (buffer.images == x0[int(memory[:6].argmin())]).flatten(1).all(1).any()


def test_diverse_evicts_the_more_redundant_of_the_closest_pair():
    buffer = ReplayBuffer(5, (3, 1, 1))
    # class 0: slots 0 and 1 are the closest pair; slot 1 has the nearer second neighbour (slot 2)
    colours = torch.tensor([[0, 0, 0], [2, 0, 0], [6, 0, 0], [40, 0, 0], [200, 200, 200]], dtype=torch.uint8)
    buffer.write(torch.arange(5), colours.view(5, 3, 1, 1), torch.tensor([0, 0, 0, 0, 1]))
    ctx = context(buffer)
    ClassBalancedUpdate("diverse").update(buffer, torch.full((1, 3, 1, 1), 250, dtype=torch.uint8), torch.tensor([1]), ctx)
    assert buffer.labels.tolist() == [0, 1, 0, 0, 1] and buffer.images[1].flatten().tolist() == [250, 250, 250]


@pytest.mark.parametrize("max_age", [0, 6])
def test_no_value_is_computed_on_features_older_than_the_bound(max_age, cifar10_slice, monkeypatch):
    """A real learner (the duel rule, 2 iterations a batch): at every valuation, every memory slot's
    features come from weights at most `max_age` optimizer steps old, and with max_age > 0 most
    valuations reuse cached features."""
    learner = make_learner("cb-sv-duel", num_classes=4, mem_size=30, seed=0, iterations=2, feature_max_age=max_age)
    ages, recomputed = [], []
    original = balanced.refresh_stale

    def watched(buffer, latent, age_bound):
        before = buffer.feature_version[: buffer.size].clone()
        feats = original(buffer, latent, age_bound)
        ages.append(int((latent.version - buffer.feature_version[: buffer.size]).max()))
        recomputed.append(int((buffer.feature_version[: buffer.size] != before).sum()))
        return feats

    monkeypatch.setattr(balanced, "refresh_stale", watched)
    keep = torch.nonzero(cifar10_slice.train_y < 4).flatten()[:400]
    x, y = cifar10_slice.train_x[keep], cifar10_slice.train_y[keep]
    order = torch.randperm(400, generator=torch.Generator().manual_seed(1))
    for i in range(0, 400, 10):
        learner.observe(x[order[i:i + 10]], y[order[i:i + 10]])
    assert len(ages) > 20 and max(ages) <= max_age
    if max_age:
        assert sum(recomputed) < 0.5 * 30 * len(recomputed)


def test_asv_on_the_balanced_memory_scores_features_within_the_bound(cifar10_slice, monkeypatch):
    """cb-aser (ASV retrieval on the duel memory, 2 iterations a batch): every memory feature it
    scores comes from weights at most `feature_max_age` optimizer steps old, and with a bound of 6
    it forwards far fewer images than with fresh features (0). The paper's ASER ignores the bound."""
    import learner.memory.latent as latent

    ages = []
    original = latent.Latent.of

    def watched(self, slots, images=None, max_age=0):
        out = original(self, slots, images, max_age)
        ages.append(int((self.version - self.buffer.feature_version[slots]).max()))
        return out

    monkeypatch.setattr(latent.Latent, "of", watched)
    keep = torch.nonzero(cifar10_slice.train_y < 4).flatten()[:200]
    x, y = cifar10_slice.train_x[keep], cifar10_slice.train_y[keep]
    order = torch.randperm(200, generator=torch.Generator().manual_seed(1))

    def run(method, age):
        learner = make_learner(method, num_classes=4, mem_size=30, seed=0, iterations=2, feature_max_age=age)
        extract, forwarded = learner.extract, [0]

        def counting(images, batch_size=512):
            forwarded[0] += len(images)
            return extract(images, batch_size)

        learner.extract = counting
        ages.clear()
        for i in range(0, 200, 10):
            learner.observe(x[order[i:i + 10]], y[order[i:i + 10]])
        return forwarded[0], list(ages)

    fresh, fresh_ages = run("cb-aser", 0)
    bounded, bounded_ages = run("cb-aser", 6)
    assert len(fresh_ages) > 25 and max(fresh_ages) == 0 and max(bounded_ages) <= 6
    assert bounded < 0.6 * fresh
    assert make_learner("aser", num_classes=4, mem_size=30, feature_max_age=6).retrieval_policy.max_age == 0


def test_forgetting_drops_the_class_count_and_an_old_state_loads(cifar10_slice):
    learner = make_learner("cb-sv-duel", num_classes=4, mem_size=20, seed=0)
    pick = torch.randperm(cifar10_slice.train_y.numel(), generator=torch.Generator().manual_seed(0))[:60]
    x, y = cifar10_slice.train_x[pick], cifar10_slice.train_y[pick] % 3
    for i in range(0, 60, 10):
        learner.observe(x[i:i + 10], y[i:i + 10])
    assert sum(learner.update_policy.seen.values()) == 60
    learner.forget_class(1)
    assert 1 not in learner.update_policy.seen and 1 not in learner.buffer.class_counts()
    assert learner.lean_update.seen is learner.update_policy.seen  # one count, whichever form runs
    state = learner.state_dict()
    state["update"] = {}  # a checkpoint written before the balanced memory kept counts
    restored = make_learner("cb-sv-duel", num_classes=4, mem_size=20, seed=0)
    restored.load_state_dict(state)
    assert restored.update_policy.seen == {} and len(restored.buffer) == len(learner.buffer)


def test_refresh_stale_recomputes_only_what_is_missing_or_too_old():
    buffer = ReplayBuffer(4, (3, 1, 1))
    buffer.write(torch.arange(4), torch.arange(12, dtype=torch.uint8).view(4, 3, 1, 1), torch.zeros(4, dtype=torch.long))
    refresh_stale(buffer, Latent(colour_features, buffer, 10), max_age=3)
    buffer.feature_version[1] = 6  # computed 4 steps before version 10
    buffer.write(torch.tensor([2]), torch.zeros(1, 3, 1, 1, dtype=torch.uint8), torch.tensor([1]))  # a new sample
    refresh_stale(buffer, Latent(colour_features, buffer, 10), max_age=3)
    assert buffer.feature_version.tolist() == [10, 10, 10, 10]
    assert torch.equal(buffer.features[2], colour_features(torch.zeros(1, 3, 1, 1, dtype=torch.uint8))[0])
