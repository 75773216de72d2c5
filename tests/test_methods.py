"""Every method on a slice of the real CIFAR-10 stream: it learns, and the fast paths are exact."""

import pytest
import torch

from learner import METHODS, make_learner
from learner.data import task_batches, task_test_set
from learner.methods.registry import REPLAY_METHODS, STREAM_HEAD_METHODS, lean_method
from learner.networks.backbone import PretrainedBackbone

STREAM_METHODS = [m for m in METHODS if not m.startswith("iid")]


def train_task(learner, data, classes, seed=0):
    learner.begin_task(classes)
    for x, y in task_batches(data, classes, 10, torch.Generator().manual_seed(seed)):
        learner.observe(x, y)
    learner.end_task()


def accuracy(learner, data, classes):
    x, y = task_test_set(data, classes)
    return float((learner.predict(x) == y).float().mean())


@pytest.mark.parametrize("method", STREAM_METHODS)
def test_method_learns_the_first_task(method, cifar10_more):
    """During one pass over task 1 (airplane vs automobile, 1000 images), test accuracy on its
    200 test images, averaged over checkpoints every 10 steps of the second half (a single
    snapshot at lr 0.1 swings with the last batches), is above 56%: clearly above the 50% of a
    guess between the two (one 200-image snapshot has a standard deviation of 3.5%). Over
    seeds 0-2 every method measured 0.60-0.75 here; CI's CPU, whose float sums differ, gave
    cb-aser 0.577 on seed 0."""
    # the streaming heads read frozen features: they learn on the pretrained backbone
    options = {"backbone": PretrainedBackbone(input_size=64)} if method in STREAM_HEAD_METHODS else {}
    if method == "gss":  # 3 memory batches' gradients a step, not the paper's 10: the same code, a third of CI's time
        options["gss_batches"] = 3
    learner = make_learner(method, num_classes=10, mem_size=200, seed=0, **options)
    learner.begin_task([0, 1])
    checkpoints = []
    for x, y in task_batches(cifar10_more, [0, 1], 10, torch.Generator().manual_seed(0)):
        learner.observe(x, y)
        if learner.steps > 50 and learner.steps % 10 == 0:
            checkpoints.append(accuracy(learner, cifar10_more, [0, 1]))
    assert learner.steps == 100 and len(checkpoints) == 5
    assert sum(checkpoints) / len(checkpoints) > 0.56, checkpoints
    if hasattr(learner, "buffer"):
        assert len(learner.buffer) == 200 and set(learner.buffer.class_counts()) == {0, 1}


@pytest.mark.parametrize("method", ["iid-online"])
def test_iid_online_learns_all_classes(method, cifar10_slice):
    learner = make_learner(method, num_classes=10, seed=0)
    everything = list(range(10))
    for x, y in task_batches(cifar10_slice, everything, 10, torch.Generator().manual_seed(0)):
        learner.observe(x, y)
    assert accuracy(learner, cifar10_slice, everything) > 0.13  # chance 0.10; 3 sigma over 1000 images


def test_replay_keeps_old_classes_in_memory_and_prediction(cifar10_slice):
    learner = make_learner("aser-mu", num_classes=10, mem_size=100, seed=0)
    for classes in ([0, 1], [2, 3]):
        train_task(learner, cifar10_slice, classes)
    counts = learner.buffer.class_counts()
    assert set(counts) == {0, 1, 2, 3} and sum(counts.values()) == 100
    x, _ = task_test_set(cifar10_slice, [0, 1])
    assert torch.isin(learner.predict(x), torch.tensor([0, 1])).float().mean() > 0.1  # not all forgotten


@pytest.mark.parametrize("method", ["aser", "aser-mu", "dist-mu"])
def test_feature_cache_changes_no_choice(method, cifar10_slice, monkeypatch):
    """The cached latent features give the same scores, choices and weights as recomputing
    every feature at every use (fp32, up to float rounding)."""
    def run(cache: bool):
        learner = make_learner(method, num_classes=10, mem_size=40, seed=3)
        if not cache:
            monkeypatch.setattr(learner.buffer, "cached_mask", lambda slots, version, max_age=0: torch.zeros_like(slots, dtype=torch.bool))
        forwarded = 0
        original = learner.extract

        def counting(images, batch_size=512):
            nonlocal forwarded
            forwarded += images.shape[0]
            return original(images, batch_size)

        learner.extract = counting
        x_all = cifar10_slice.train_x[:300]
        y_all = cifar10_slice.train_y[torch.randperm(300, generator=torch.Generator().manual_seed(0))] % 4
        for i in range(0, 300, 10):
            learner.observe(x_all[i:i + 10], y_all[i:i + 10])
        return learner, forwarded

    cached, n_cached = run(True)
    fresh, n_fresh = run(False)
    assert torch.equal(cached.buffer.labels, fresh.buffer.labels)
    assert torch.equal(cached.buffer.images, fresh.buffer.images)
    for a, b in zip(cached.model.parameters(), fresh.model.parameters()):
        assert torch.allclose(a, b, atol=1e-5)
    assert n_cached < n_fresh  # and it did save forward passes


def test_head_grows_for_unseen_labels():
    learner = make_learner("aser-mu", num_classes=1, mem_size=30, per_class=3, image_shape=(3, 32, 32))
    g = torch.Generator().manual_seed(0)
    learner.observe(torch.randint(0, 255, (10, 3, 32, 32), dtype=torch.uint8, generator=g), torch.zeros(10, dtype=torch.long))
    assert learner.num_classes == 1
    learner.observe(torch.randint(0, 255, (10, 3, 32, 32), dtype=torch.uint8, generator=g), torch.tensor([0, 4] * 5))
    assert learner.num_classes == 5 and learner.logits(torch.zeros(2, 3, 32, 32, dtype=torch.uint8)).shape == (2, 5)


def test_observe_rejects_wrong_shapes():
    learner = make_learner("er", num_classes=10)
    with pytest.raises(ValueError, match="uint8"):
        learner.observe(torch.zeros(2, 3, 32, 32), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError):
        learner.observe(torch.zeros(2, 1, 32, 32, dtype=torch.uint8), torch.zeros(2, dtype=torch.long))


@pytest.mark.parametrize("method", ["aser-mu", "gss", "agem", "ewc"])
def test_state_dict_round_trip_continues_identically(method, cifar10_slice):
    """A learner restored from a checkpoint takes the same next steps as the original."""
    x, y = cifar10_slice.train_x[:80], cifar10_slice.train_y[:80] % 3
    a = make_learner(method, num_classes=3, mem_size=30, seed=1)
    for i in range(0, 40, 10):
        a.observe(x[i:i + 10], y[i:i + 10])
    a.end_task()
    b = make_learner(method, num_classes=3, mem_size=30, seed=99)
    b.load_state_dict(a.state_dict())
    for i in range(40, 80, 10):
        a.observe(x[i:i + 10], y[i:i + 10])
        b.observe(x[i:i + 10], y[i:i + 10])
    for p, q in zip(a.model.parameters(), b.model.parameters()):
        assert torch.allclose(p, q, atol=1e-5)
    if hasattr(a, "buffer"):
        assert torch.equal(a.buffer.labels, b.buffer.labels)


@pytest.mark.parametrize("method", sorted(REPLAY_METHODS))
def test_a_methods_lean_form_is_the_method_its_lean_steps_are_priced_as(method):
    # the real-time protocol prices a lean step as lean_method(method)'s step: the policies must be its
    learner = make_learner(method, 10, mem_size=50)
    update, retrieval = REPLAY_METHODS[lean_method(method)]
    assert (learner.lean_update.name, learner.lean_retrieval.name) == (update, retrieval)
    costly = {"knn-sv", "asv", "asv-mu", "dist", "dist-mu", "mir", "cb-value", "cb-duel", "cb-compete", "cb-diverse"}
    assert not {update, retrieval} & costly and (lean_method(method) == method) == (not set(REPLAY_METHODS[method]) & costly)
