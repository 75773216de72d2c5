"""Contracts of the replay buffer and of each update and retrieval policy."""

import pytest
import torch

from learner import make_learner
from learner.memory.buffer import ReplayBuffer
from learner.memory.latent import Latent
from learner.memory.policy import StepContext
from learner.memory.retrieval import (
    ASVRetrieval,
    DistRetrieval,
    MIRRetrieval,
    OldClassesBy,
    RandomRetrieval,
    WithinClassesBy,
)
from learner.memory.sampling import class_balanced_sample
from learner.memory.shapley import knn_shapley
from learner.memory.update import KNNShapleyUpdate, ReservoirUpdate


def point_extract(images):
    """A stand-in f_ext for hand-made examples: the latent point is the pixel values."""
    return images.flatten(1).float()


def context(buffer, seed=0, num_classes=3, version=0, eligible=None, model=None):
    return StepContext(latent=Latent(point_extract, buffer, version), generator=torch.Generator().manual_seed(seed),
                       model=model, lr=0.1, num_classes=num_classes, to_input=lambda x: x.float() / 255,
                       eligible=eligible)


def points(values):
    """1-D latent points as uint8 'images' of shape [n, 1, 1, 1]."""
    return torch.tensor(values, dtype=torch.uint8).view(-1, 1, 1, 1)


def filled_buffer(values, labels, capacity=None):
    buf = ReplayBuffer(capacity or len(values), (1, 1, 1))
    buf.append(points(values), torch.tensor(labels))
    buf.n_seen = 10 * buf.capacity  # the stream has already gone past the memory size
    return buf


# --- buffer and sampling ----------------------------------------------------------------
def test_buffer_append_stops_at_capacity():
    buf = ReplayBuffer(3, (1, 1, 1))
    slots = buf.append(points([1, 2, 3, 4, 5]), torch.tensor([0, 0, 1, 1, 2]))
    assert slots.tolist() == [0, 1, 2] and len(buf) == 3 and buf.is_full
    assert buf.class_counts() == {0: 2, 1: 1}


def test_class_balanced_sample_takes_per_class_from_every_class():
    labels = torch.tensor([0] * 10 + [1] * 3 + [2] * 1)
    g = torch.Generator().manual_seed(0)
    picked = class_balanced_sample(labels, torch.arange(14), 2, g)
    assert torch.bincount(labels[picked]).tolist() == [2, 2, 1]
    assert picked.unique().numel() == picked.numel()


def test_buffer_state_round_trip():
    buf = filled_buffer([1, 2, 3], [0, 1, 1], capacity=5)
    other = ReplayBuffer(5, (1, 1, 1))
    other.load_state_dict(buf.state_dict())
    assert len(other) == 3 and other.n_seen == buf.n_seen
    assert torch.equal(other.images[:3], buf.images[:3]) and torch.equal(other.labels[:3], buf.labels[:3])


# --- update policies --------------------------------------------------------------------
def test_reservoir_keeps_each_sample_with_probability_m_over_n():
    n_stream, capacity, trials = 50, 10, 3000
    kept = torch.zeros(n_stream)
    g = torch.Generator().manual_seed(0)
    for _ in range(trials):
        buf = ReplayBuffer(capacity, (1, 1, 1))
        ctx = type("Ctx", (), {"generator": g})()
        for start in range(0, n_stream, 5):
            ids = torch.arange(start, start + 5)
            ReservoirUpdate().update(buf, torch.zeros(5, 1, 1, 1, dtype=torch.uint8), ids, ctx)
        assert len(buf) == capacity and buf.n_seen == n_stream
        kept[buf.labels] += 1
    freq = kept / trials
    sigma = (0.2 * 0.8 / trials) ** 0.5
    assert (freq - capacity / n_stream).abs().max() < 5 * sigma
    assert kept.sum() == capacity * trials


@pytest.mark.parametrize("make", [ReservoirUpdate, lambda: KNNShapleyUpdate(k=3, per_class=2, n_candidates=6)])
def test_updates_keep_capacity_and_count_samples(make):
    buf = ReplayBuffer(12, (1, 1, 1))
    policy = make()
    g = torch.Generator().manual_seed(1)
    for step in range(10):
        ctx = context(buf, seed=step, num_classes=4, version=step)
        ctx.generator = g
        policy.update(buf, points(torch.randint(0, 255, (7,), generator=g).tolist()),
                      torch.randint(0, 4, (7,), generator=g), ctx)
        assert len(buf) == min(12, 7 * (step + 1)) and buf.n_seen == 7 * (step + 1)


def test_knn_sv_update_replaces_by_the_papers_rule():
    """Recompute the KNN-SVs for the same random draws and check that exactly the incoming
    samples ranking above memory candidates replaced exactly the ones ranking below."""
    g = torch.Generator().manual_seed(4)
    values = torch.randint(0, 255, (20,), generator=g)
    labels = torch.randint(0, 3, (20,), generator=g)
    buf = filled_buffer(values.tolist(), labels.tolist())
    before_images, before_labels = buf.images.clone(), buf.labels.clone()
    incoming, incoming_y = points([40, 41, 200, 3, 90]), torch.tensor([0, 1, 2, 2, 1])
    policy = KNNShapleyUpdate(k=3, per_class=2, n_candidates=8)
    ctx = context(buf, seed=9, num_classes=3)
    replay = torch.Generator().set_state(ctx.generator.get_state())
    policy.update(buf, incoming, incoming_y, ctx)

    # the same draws, by hand
    filled = torch.arange(20)
    eval_slots = class_balanced_sample(before_labels, filled, 2, replay)
    rest = filled[~torch.isin(filled, eval_slots)]
    cand = rest[torch.randperm(rest.numel(), generator=replay)[:8]]
    u = torch.rand((), generator=replay).item() / 3
    share = torch.bincount(before_labels, minlength=3).float()[incoming_y] / 20
    minority = share < u
    f = before_images.flatten(1).float()
    inc_f = incoming.flatten(1).float()
    sv = knn_shapley(torch.cat([f[eval_slots], inc_f[minority]]), torch.cat([before_labels[eval_slots], incoming_y[minority]]),
                     torch.cat([f[cand], inc_f]), torch.cat([before_labels[cand], incoming_y]), 3).mean(0)
    mem_sv, inc_sv = sv[:8], sv[8:]
    n_in = int((torch.sort(sv, descending=True, stable=True).indices[:8] >= 8).sum())
    changed = (buf.images != before_images).flatten(1).any(1) | (buf.labels != before_labels)
    assert int(changed.sum()) <= n_in
    assert ctx.stats["replaced"] == n_in
    evicted = torch.nonzero(changed).flatten()
    # every evicted memory sample was a candidate whose value is below every admitted sample's
    assert torch.isin(evicted, cand).all()
    if n_in:
        admitted = torch.sort(inc_sv, descending=True, stable=True).values[:n_in]
        evicted_sv = mem_sv[torch.isin(cand, evicted)]
        assert evicted_sv.numel() == 0 or evicted_sv.max() <= admitted.min()
    assert len(buf) == 20


def test_knn_sv_update_admits_a_class_new_to_the_memory():
    buf = filled_buffer([10, 11, 12, 13, 30, 31, 32, 33], [0, 0, 0, 0, 1, 1, 1, 1])
    policy = KNNShapleyUpdate(k=3, per_class=2, n_candidates=4)
    policy.update(buf, points([100, 101, 102, 103]), torch.tensor([2, 2, 2, 2]), context(buf, num_classes=3))
    assert buf.class_counts().get(2, 0) > 0 and len(buf) == 8


def test_gss_keeps_capacity():
    learner = make_learner("gss", num_classes=3, mem_size=15, image_shape=(3, 32, 32), gss_batches=3)
    g = torch.Generator().manual_seed(0)
    for _ in range(6):
        learner.observe(torch.randint(0, 255, (5, 3, 32, 32), dtype=torch.uint8, generator=g),
                        torch.randint(0, 3, (5,), generator=g))
        assert len(learner.buffer) <= 15
    assert len(learner.buffer) == 15 and learner.buffer.n_seen == 30
    assert learner.update_policy.scores.shape == (15,)


# --- retrieval policies -----------------------------------------------------------------
def test_asv_scores_follow_equations_5_and_6_on_a_hand_made_example():
    # K=1, 1-D latent space. Candidates c0 (x=10, class 0), c1 (x=30, class 1); S_sub e0 (12, 0),
    # e1 (32, 1); incoming b0 (25, class 0).
    # s_e0 = [1, 0], s_e1 = [0, 1]; for b0 the nearer c1 has another label: s_b0 = [1/2, -1/2].
    cand_f, cand_y = torch.tensor([[10.0], [30.0]]), torch.tensor([0, 1])
    ev_f, ev_y = torch.tensor([[12.0], [32.0]]), torch.tensor([0, 1])
    b_f, b_y = torch.tensor([[25.0]]), torch.tensor([0])
    asv = ASVRetrieval(k=1, per_class=1, mean=False).score(cand_f, cand_y, ev_f, ev_y, b_f, b_y)
    asv_mu = ASVRetrieval(k=1, per_class=1, mean=True).score(cand_f, cand_y, ev_f, ev_y, b_f, b_y)
    assert asv.tolist() == [1 - 0.5, 1 + 0.5]  # max over S_sub - min over B_n
    assert asv_mu.tolist() == [0.5 - 0.5, 0.5 + 0.5]  # mean over S_sub - mean over B_n
    dist = DistRetrieval(per_class=1, mean=False).score(cand_f, cand_y, ev_f, ev_y, b_f, b_y)
    assert dist.tolist() == [-(2 + 15), -(2 + 5)]


@pytest.mark.parametrize("policy", [RandomRetrieval(), ASVRetrieval(3, 3, True), ASVRetrieval(3, 3, False),
                                    DistRetrieval(3, True), DistRetrieval(3, False),
                                    OldClassesBy(ASVRetrieval(3, 3, True)), WithinClassesBy(ASVRetrieval(3, 3, True))])
def test_retrieval_never_returns_more_than_asked(policy):
    g = torch.Generator().manual_seed(2)
    buf = filled_buffer(torch.randint(0, 255, (30,), generator=g).tolist(), torch.randint(0, 4, (30,), generator=g).tolist())
    for n in (0, 1, 5, 10, 40):
        slots = policy.retrieve(buf, points([1, 2, 3]), torch.tensor([0, 1, 3]), n, context(buf, num_classes=4))
        assert slots.numel() <= n and slots.unique().numel() == slots.numel()
        assert ((slots >= 0) & (slots < len(buf))).all()


def test_asv_retrieval_picks_the_top_scores_of_its_candidates():
    g = torch.Generator().manual_seed(3)
    buf = filled_buffer(torch.randint(0, 255, (40,), generator=g).tolist(), torch.randint(0, 4, (40,), generator=g).tolist())
    policy = ASVRetrieval(k=3, per_class=4, mean=True)
    ctx = context(buf, num_classes=4)
    slots = policy.retrieve(buf, points([50, 60]), torch.tensor([0, 1]), 5, ctx)
    scores = ctx.stats["retrieval_scores"]
    assert slots.numel() == 5
    assert torch.sort(scores, descending=True).values[4] <= scores.max()
    assert len(torch.sort(scores, descending=True).values) == 16  # 4 candidates from each of 4 classes


def test_asv_on_the_old_classes_replays_the_incoming_ones_as_random_retrieval_draws_them():
    """The incoming classes' slots are random retrieval's draw with the same generator; the rest
    are ASV_mu's choice among the other classes."""
    g = torch.Generator().manual_seed(4)
    buf = filled_buffer(torch.randint(0, 255, (40,), generator=g).tolist(), (torch.arange(40) % 4).tolist())
    batch, batch_y = points([50, 60, 70]), torch.tensor([0, 0, 1])
    for seed in range(5):
        slots = OldClassesBy(ASVRetrieval(3, 4, True)).retrieve(buf, batch, batch_y, 10, context(buf, seed, 4))
        drawn = RandomRetrieval().retrieve(buf, batch, batch_y, 10, context(buf, seed, 4))
        incoming = lambda s: s[buf.labels[s] <= 1]  # noqa: E731
        assert slots.numel() == 10 and slots.unique().numel() == 10
        assert incoming(slots).tolist() == incoming(drawn).tolist()


def test_asv_within_classes_replays_random_retrievals_class_counts_and_each_classs_top_scores():
    g = torch.Generator().manual_seed(5)
    buf = filled_buffer(torch.randint(0, 255, (40,), generator=g).tolist(), (torch.arange(40) % 4).tolist())
    batch, batch_y = points([50, 60, 70]), torch.tensor([0, 0, 1])
    for seed in range(5):
        ctx = context(buf, seed, 4)
        slots = WithinClassesBy(ASVRetrieval(3, 4, True)).retrieve(buf, batch, batch_y, 10, ctx)
        drawn = RandomRetrieval().retrieve(buf, batch, batch_y, 10, context(buf, seed, 4))
        after_draw = torch.Generator().manual_seed(seed)  # the policy's draws in its order: the classes, then
        torch.randperm(40, generator=after_draw)  # the candidates its scores are of
        cand = class_balanced_sample(buf.labels, torch.arange(40), 4, after_draw)
        scores = ctx.stats["retrieval_scores"]
        assert slots.unique().numel() == 10 and scores.numel() == cand.numel() == 16
        assert torch.equal(buf.labels[slots].bincount(minlength=4), buf.labels[drawn].bincount(minlength=4))
        for c in range(4):
            k = int((buf.labels[slots] == c).sum())
            of_c = buf.labels[cand] == c
            top = min(k, int(of_c.sum()))  # a class drawn more often than it has candidates: all of them go
            if top:
                kth = torch.sort(scores[of_c], descending=True).values[top - 1]
                assert int((of_c & torch.isin(cand, slots)).sum()) == top
                assert scores[of_c & torch.isin(cand, slots)].min() >= kth


def test_excluding_the_current_task_never_replays_it():
    learner = make_learner("aser-mu", num_classes=4, mem_size=40, image_shape=(3, 32, 32), exclude_current_task=True,
                           n_candidates=40)
    g = torch.Generator().manual_seed(0)
    learner.buffer.append(torch.randint(0, 255, (40, 3, 32, 32), dtype=torch.uint8, generator=g), torch.arange(40) % 4)
    learner.buffer.n_seen = 400
    learner.begin_task([2, 3])
    ctx = learner.context()
    for _ in range(5):
        slots = learner.retrieve(torch.zeros(10, 3, 32, 32, dtype=torch.uint8), torch.full((10,), 2), ctx)
        assert slots.numel() == 10 and not torch.isin(learner.buffer.labels[slots], torch.tensor([2, 3])).any()


def test_mir_returns_the_most_interfered_subset():
    learner = make_learner("mir", num_classes=3, mem_size=30, image_shape=(3, 32, 32), mir_subsample=12)
    g = torch.Generator().manual_seed(0)
    learner.buffer.append(torch.randint(0, 255, (30, 3, 32, 32), dtype=torch.uint8, generator=g), torch.arange(30) % 3)
    ctx = learner.context()
    slots = MIRRetrieval(n_subsample=12).retrieve(learner.buffer, torch.randint(0, 255, (10, 3, 32, 32), dtype=torch.uint8,
                                                  generator=g), torch.zeros(10, dtype=torch.long), 4, ctx)
    assert slots.numel() == 4 and slots.unique().numel() == 4
