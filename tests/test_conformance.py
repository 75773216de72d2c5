"""One contract every learner keeps, in the habit of river's estimator checks: every method of
`learner.methods.registry`, plain and with the stronger learner's options (ACE + augmentation + 2 iterations
+ a moving average that teaches by distillation and is served with BatchNorm statistics recomputed
on the memory), on real CIFAR-10 images; the stronger augmentation on a memory of each kind; the
pretrained backbone (`learner.networks.backbone`) under memories of each kind, a trainable top above a cut
serving streaming LDA, and 8-bit pooled latents (the streaming-head methods run on it alone).

- a seed reproduces it bit for bit;
- a state round trip (`state_dict` -> a fresh learner -> `load_state_dict`) continues bit for bit,
  through the same serialisation a checkpoint uses;
- a lean step and a pass-through (full and lean) run and are counted;
- forgetting a class leaves nothing of it: not in the memory, not in what the memory policy keeps,
  never predicted, and the memory refills with the other classes.

That each method learns a first task above chance on real images is
`tests/test_methods.py::test_method_learns_the_first_task`, over the same list of methods.
"""

import io
from functools import lru_cache

import pytest
import torch

from learner import METHODS, make_learner
from learner.methods.registry import REPLAY_METHODS, STREAM_HEAD_METHODS
from learner.networks.backbone import PretrainedBackbone
from learner.networks.lite0 import POOLED

STREAM_METHODS = [m for m in METHODS if not m.startswith("iid")]
OPTIONS = {
    "plain": {},
    "options": {"loss": "ace", "augment": True, "iterations": 2, "ema_decay": 0.99, "distill": 1.0,
                "serving_bn": "memory"},
    "strong": {"loss": "ace", "augment": "strong", "ema_decay": 0.99},
    # the pretrained backbone: (cut, latent bits) at 64 px
    "lite0": {"loss": "ace", "iterations": 2, "ema_decay": 0.99, "serving_head": "slda", "lr": 0.01,
              "backbone": (15, 16)},
    "lite0-8bit": {"loss": "ace", "serving_bias": True, "backbone": (POOLED, 8)},
    # Adam's step: its moments are state a round trip must carry
    "adam": {"optimizer": "adam", "lr": 0.001},
    "lite0-adam": {"loss": "ace", "ema_decay": 0.99, "serving_head": "slda", "optimizer": "adam", "lr": 0.001,
                   "backbone": (15, 16)},
    # the top's head reads standardised features: running statistics a round trip must carry
    "lite0-std": {"loss": "ace", "ema_decay": 0.99, "serving_head": "slda", "lr": 0.01, "backbone": (15, 16, True)},
}
CASES = [(m, o) for m in STREAM_METHODS for o in ("plain", "options") if o == "plain" or m in REPLAY_METHODS]
CASES += [(m, "strong") for m in ("er", "sv-upd", "cb-sv-duel")]
CASES += [(m, "lite0") for m in ("cb-sv-duel", "er", "aser-mu")] + [("cb-sv-duel", "lite0-8bit")]
CASES += [(m, "adam") for m in ("er", "cb-sv-duel", "agem", "ewc")] + [("cb-sv-duel", "lite0-adam")]
CASES += [("cb-sv-duel", "lite0-std")]


@lru_cache(maxsize=None)
def backbone(cut: int, bits: int, standardize: bool = False) -> PretrainedBackbone:
    # its frozen part never trains: shared
    return PretrainedBackbone(input_size=64, cut=cut, latent_bits=bits, standardize=standardize)


def build(method: str, options: str, seed: int = 0):
    # a small memory and a short feature age bound, so that the memory fills and the cache goes stale
    kwargs = dict(OPTIONS[options])
    spec = kwargs.pop("backbone", (POOLED, 16) if method in STREAM_HEAD_METHODS else None)
    if spec is not None:
        kwargs["backbone"] = backbone(*spec)
    return make_learner(method, num_classes=4, mem_size=16, seed=seed, feature_max_age=2, **kwargs)


@pytest.fixture(scope="module")
def stream(cifar10_slice):
    """70 real images of 4 classes, in shuffled batches of 10."""
    keep = torch.nonzero(cifar10_slice.train_y < 4).flatten()
    order = keep[torch.randperm(keep.numel(), generator=torch.Generator().manual_seed(0))][:70]
    x, y = cifar10_slice.train_x[order], cifar10_slice.train_y[order]
    return [(x[i:i + 10], y[i:i + 10]) for i in range(0, 70, 10)]


def feed(learner, batches):
    for x, y in batches:
        learner.observe(x, y)


def weights(learner):
    return [t.detach().clone() for t in learner.serving_model.state_dict().values()]


def assert_same(a, b):
    for p, q in zip(weights(a), weights(b), strict=True):
        assert torch.equal(p, q)
    if hasattr(a, "buffer"):
        assert torch.equal(a.buffer.labels, b.buffer.labels) and torch.equal(a.buffer.images, b.buffer.images)


@pytest.mark.parametrize("method,options", CASES)
def test_a_seed_reproduces_it_and_a_state_round_trip_continues_bit_for_bit(method, options, stream):
    a, b = build(method, options), build(method, options)
    feed(a, stream[:3])
    feed(b, stream[:3])
    assert_same(a, b)
    a.end_task()
    saved = io.BytesIO()
    torch.save(a.state_dict(), saved)  # as a checkpoint serialises it
    c = build(method, options, seed=99)
    c.load_state_dict(torch.load(io.BytesIO(saved.getvalue()), weights_only=True))
    feed(a, stream[3:5])
    feed(c, stream[3:5])
    assert_same(a, c)


@pytest.mark.parametrize("method,options", CASES)
def test_lean_steps_pass_through_and_forgetting(method, options, stream, cifar10_slice):
    learner = build(method, options)
    feed(learner, stream[:2])
    learner.observe(*stream[2], lean=True)
    learner.pass_through(*stream[3], batch_size=10)
    learner.pass_through(*stream[4], batch_size=10, lean=True)
    assert (learner.steps, learner.lean_steps, learner.samples_seen, learner.samples_skipped) == (3, 1, 30, 20)

    learner.forget_class(2)
    # a label sent again after its forgetting comes as a new class id (the service's rule)
    feed(learner, [(x[y != 2], y[y != 2]) for x, y in stream[5:7]])
    if hasattr(learner, "buffer"):
        kept = getattr(learner.update_policy, "seen", {})
        assert 2 not in learner.buffer.class_counts() and 2 not in kept
        assert learner.buffer.is_full  # the other classes refilled it
    test = cifar10_slice.test_x[cifar10_slice.test_y == 2][:50]
    assert 2 not in learner.predict(test).tolist()
    learner.refresh_serving()  # a publication: with serving_bn="memory", a corrected copy serves
    assert 2 not in learner.predict(test).tolist()


# the option lives in the common step: a memory of each kind, none, a streaming head with a top, a streaming head alone
EVERY_CASES = [("er", "plain"), ("agem", "plain"), ("ewc", "plain"), ("cb-sv-duel", "lite0"), ("slda", "plain")]


@pytest.mark.parametrize("method,options", EVERY_CASES)
def test_a_step_every_k_batches_and_every_batch_reaches_the_memory(method, options, stream):
    learner = build(method, options)
    learner.train_every = 3
    memory = getattr(learner, "buffer", None)
    stepped = []
    for i, (x, y) in enumerate(stream):
        version, offered = learner.version, memory.n_seen if memory is not None else 0
        stats = learner.observe(x, y)
        if learner.version != version:
            stepped.append(i)
        elif i % 3:
            assert stats == {}
        if memory is not None:  # the batches without a step update the memory too
            assert memory.n_seen > offered
    assert stepped == ([0, 3, 6] if method not in STREAM_HEAD_METHODS else [])
    assert (learner.steps, learner.samples_seen, learner.samples_skipped) == (7, 70, 0)
    if learner.stream_head is not None:
        assert int(learner.stream_head.counts.sum()) == 70


def test_train_every_needs_a_positive_count():
    with pytest.raises(ValueError, match="train_every"):
        make_learner("er", num_classes=4, mem_size=16, train_every=0)


def test_a_grown_head_keeps_the_moments_of_what_stayed(stream):
    learner = make_learner("er", num_classes=2, mem_size=16, optimizer="adam", lr=0.001)
    x, y = stream[0]
    learner.observe(x[y < 2], y[y < 2])
    before = {name: learner.optimizer.state[p]["exp_avg"].clone() for name, p in learner.model.named_parameters()}
    learner.ensure_classes(4)  # a new class: the head's rows grow, its parameters are new tensors
    after = {name: learner.optimizer.state.get(p) for name, p in learner.model.named_parameters()}
    grown = {name for name in after if name.startswith("head.")}
    assert grown and all(after[name] is None for name in grown)
    assert all(torch.equal(after[name]["exp_avg"], before[name]) for name in after if name not in grown)


def test_an_unknown_optimizer_is_refused():
    with pytest.raises(ValueError, match="optimizer"):
        make_learner("er", num_classes=4, mem_size=16, optimizer="lamb")
