"""The replay objective's options (step joint|separate, loss ce|ace|ace-lone) and the NCM classifier, on
real CIFAR-10 images, checked against steps and means written out by hand."""

import copy

import pytest
import torch
from torch.nn import functional as F

from learner import make_learner
from learner.heads.ncm import NearestClassMean, memory_ncm
from learner.methods.objective import ReplayObjective


def two_batches(data):
    """Batch 1: classes 0 and 1; batch 2: classes 2 and 3 (five real images each)."""
    x, y = data.train_x, data.train_y
    first = torch.cat([torch.nonzero(y == c)[:5, 0] for c in (0, 1)])
    second = torch.cat([torch.nonzero(y == c)[:5, 0] for c in (2, 3)])
    return (x[first], y[first]), (x[second], y[second])


def replayed_after_first_batch(method, data, **options):
    """A learner whose memory holds exactly batch 1 (M = b_M = 10, so the step replays all of it)."""
    learner = make_learner(method, num_classes=10, mem_size=10, replay_batch=10, seed=0, **options)
    (x1, y1), batch2 = two_batches(data)
    learner.observe(x1, y1)
    assert len(learner.buffer) == 10
    return learner, batch2


def next_replay(learner, images, labels):
    """B_M of the learner's next step, in its order (float sums depend on it): the same random
    draw, made on a copy."""
    twin = copy.deepcopy(learner)
    slots = twin.retrieve(images, labels, twin.context())
    assert sorted(slots.tolist()) == list(range(10))
    return learner.buffer.images[slots].clone(), learner.buffer.labels[slots].clone()


def state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_same_weights(model, reference):
    got, want = state(model), state(reference)
    assert got.keys() == want.keys()
    for name in want:  # parameters and BatchNorm running statistics
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("loss", ["ce", "ace"])
def test_separate_step_equals_a_hand_written_reference(cifar10_slice, loss):
    """The authors' ER step: two train-mode forward passes (BatchNorm running statistics updated
    by each), one SGD step on the sum of the two mean losses."""
    learner, (x2, y2) = replayed_after_first_batch("er", cifar10_slice, step="separate", loss=loss)
    mem_x, mem_y = next_replay(learner, x2, y2)
    model = copy.deepcopy(learner.model)
    sgd = torch.optim.SGD(model.parameters(), lr=learner.lr)

    logits = model(learner.to_input(x2))
    if loss == "ace":  # only the incoming batch's classes (2 and 3) compete for it
        logits = logits[:, [2, 3]]
        incoming = F.cross_entropy(logits, y2 - 2)
    else:
        incoming = F.cross_entropy(logits, y2)
    (incoming + F.cross_entropy(model(learner.to_input(mem_x)), mem_y)).backward()
    sgd.step()

    learner.observe(x2, y2)
    assert_same_weights(learner.model, model)
    # the two steps differ: the joint one normalises BatchNorm over the 20 samples at once
    joint, _ = replayed_after_first_batch("er", cifar10_slice, step="joint", loss=loss)
    joint.observe(x2, y2)
    assert not torch.allclose(joint.model.head.weight, model.head.weight, atol=1e-4)


def test_joint_ce_step_is_the_mean_cross_entropy_of_the_union(cifar10_slice):
    learner, (x2, y2) = replayed_after_first_batch("er", cifar10_slice)
    mem_x, mem_y = next_replay(learner, x2, y2)
    model = copy.deepcopy(learner.model)
    sgd = torch.optim.SGD(model.parameters(), lr=learner.lr)
    F.cross_entropy(model(learner.to_input(torch.cat([x2, mem_x]))), torch.cat([y2, mem_y])).backward()
    sgd.step()
    learner.observe(x2, y2)
    assert_same_weights(learner.model, model)


def test_step_counts_replayed_samples_of_the_incoming_classes(cifar10_slice):
    learner, (x2, y2) = replayed_after_first_batch("er", cifar10_slice)
    (x1, y1), _ = two_batches(cifar10_slice)
    # incoming: five images of class 0 (in memory) and five of class 2 (not); memory replays all
    # ten samples of batch 1, five of which are class 0
    mixed_x, mixed_y = torch.cat([x1[:5], x2[:5]]), torch.cat([y1[:5], y2[:5]])
    stats = learner.observe(mixed_x, mixed_y)
    assert stats["replayed"] == 10 and stats["replayed_incoming"] == 5
    learner, _ = replayed_after_first_batch("er", cifar10_slice)
    assert learner.observe(x2, y2)["replayed_incoming"] == 0  # classes 2 and 3: none in memory


def head_gradient(learner, objective, images, labels, replay_x, replay_y):
    learner.model.zero_grad(set_to_none=True)
    objective(learner.forward_logits, images, labels, replay_x, replay_y).backward()
    return learner.model.head.weight.grad


@pytest.mark.parametrize("step", ["joint", "separate"])
def test_ace_gives_absent_classes_no_gradient_from_the_incoming_batch(cifar10_slice, step):
    learner, (x2, y2) = replayed_after_first_batch("er", cifar10_slice)
    none = torch.empty(0, *x2.shape[1:], dtype=torch.uint8), torch.empty(0, dtype=torch.long)
    absent = [c for c in range(10) if c not in (2, 3)]

    ace = head_gradient(learner, ReplayObjective("ace", step), x2, y2, *none)
    assert torch.count_nonzero(ace[absent]) == 0 and ace[[2, 3]].abs().sum() > 0
    ce = head_gradient(learner, ReplayObjective("ce", step), x2, y2, *none)
    assert ce[absent].abs().sum() > 0  # plain cross-entropy pushes every other class's logit down

    # with a replayed batch of classes 0 and 1, the replay term (over all classes) reaches them
    mem_x, mem_y = learner.buffer.images[:10], learner.buffer.labels[:10]
    mixed = head_gradient(learner, ReplayObjective("ace", step), x2, y2, mem_x, mem_y)
    assert mixed[[0, 1]].abs().sum() > 0


@pytest.mark.parametrize("step", ["joint", "separate"])
def test_ace_lone_learns_a_batch_of_one_class_against_every_class(cifar10_slice, step):
    """ACE gives an incoming batch of one class no loss (its logit against itself); ace-lone gives it
    plain cross-entropy's, and a batch of several classes ACE's."""
    learner, (x2, y2) = replayed_after_first_batch("er", cifar10_slice)
    none = torch.empty(0, *x2.shape[1:], dtype=torch.uint8), torch.empty(0, dtype=torch.long)
    lone_x, lone_y = x2[y2 == 2], y2[y2 == 2]
    assert lone_y.numel() == 5

    ace = head_gradient(learner, ReplayObjective("ace", step), lone_x, lone_y, *none)
    assert torch.count_nonzero(ace) == 0
    lone = head_gradient(learner, ReplayObjective("ace-lone", step), lone_x, lone_y, *none).clone()
    ce = head_gradient(learner, ReplayObjective("ce", step), lone_x, lone_y, *none)
    torch.testing.assert_close(lone, ce)
    assert lone[0].abs().sum() > 0  # class 0 (absent) is pushed down

    mixed_lone = head_gradient(learner, ReplayObjective("ace-lone", step), x2, y2, *none).clone()
    torch.testing.assert_close(mixed_lone, head_gradient(learner, ReplayObjective("ace", step), x2, y2, *none))


def test_objective_options_are_checked():
    with pytest.raises(ValueError, match="unknown loss"):
        ReplayObjective("focal")
    with pytest.raises(ValueError, match="unknown step"):
        ReplayObjective(step="twice")
    with pytest.raises(ValueError, match="replay methods"):
        make_learner("ewc", num_classes=10, loss="ace")


def test_ncm_uses_normalised_features_on_a_hand_made_example():
    # class 0: [10, 0] and [0, 1] -> unit vectors [1, 0], [0, 1] -> unit mean [1, 1] / sqrt 2
    # class 1: [0, 2]             -> unit mean [0, 1]
    memory = torch.tensor([[10.0, 0.0], [0.0, 1.0], [0.0, 2.0]])
    ncm = NearestClassMean.fit(memory, torch.tensor([0, 0, 1]))
    torch.testing.assert_close(ncm.means, torch.tensor([[2 ** -0.5, 2 ** -0.5], [0.0, 1.0]]))
    # [0.6, 1]: cosine 0.97 with class 0's mean, 0.86 with class 1's; with the raw mean of class 0
    # ([5, 0.5], dominated by the long vector) it would go to class 1
    assert ncm.predict(torch.tensor([[0.6, 1.0], [0.2, 1.0], [5.0, 0.0]])).tolist() == [0, 1, 0]


def test_memory_ncm_predicts_only_memory_classes(cifar10_slice):
    learner, _ = replayed_after_first_batch("aser-mu", cifar10_slice)
    ncm = memory_ncm(learner)
    assert ncm.classes.tolist() == [0, 1] and ncm.means.shape == (2, 160)
    torch.testing.assert_close(ncm.means.norm(dim=1), torch.ones(2))
    predicted = ncm.predict(learner.extract(cifar10_slice.test_x[:50]))
    assert set(predicted.tolist()) <= {0, 1}
    assert memory_ncm(make_learner("ewc", num_classes=10)) is None
