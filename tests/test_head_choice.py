"""The stream chooses which head answers (`learner.heads.head_choice`, ASER_HEAD=chosen): each candidate head is
scored on every incoming batch before the learner trains on it, and the served answer takes each class
from its head, alike in the learner, in the service's predictor and in the ONNX snapshot, and after a
resume. Real weights, real CIFAR-10 images."""

from __future__ import annotations

import copy

import numpy as np
import onnxruntime as ort
import pytest
import torch

from learner import make_learner
from learner.heads.head_choice import CANDIDATES, HeadChoice, candidates, compose, fit_pool, pooled
from learner.heads.held_back import HeldBack, paired_search
from learner.networks.backbone import PretrainedBackbone
from service.learning.serving import Predictor
from service.storage.snapshots import PixelsToLogits, export_onnx


def chosen_learner(cut: int = 12, seed: int = 0):
    backbone = PretrainedBackbone(input_size=64, cut=cut)
    return make_learner("cb-sv-duel", 4, mem_size=30, loss="ace", ema_decay=0.99, backbone=backbone, seed=seed,
                        lr=0.01, serving_head="slda", choose_head=True)


@pytest.fixture(scope="module")
def stream(cifar10_slice):
    """Twelve batches of ten CIFAR-10 training images over four classes, and 40 test images of them."""
    keep = torch.nonzero(cifar10_slice.train_y < 4).flatten()
    pick = keep[torch.randperm(keep.numel(), generator=torch.Generator().manual_seed(1))[:120]]
    x, y = cifar10_slice.train_x[pick], cifar10_slice.train_y[pick]
    test = cifar10_slice.test_x[torch.nonzero(cifar10_slice.test_y < 4).flatten()[:40]]
    # at the input size, as the service's input rule gives images to the learner and to a snapshot
    test = torch.nn.functional.interpolate(test.float(), size=64, mode="bilinear").round().to(torch.uint8)
    return list(zip(x.split(10), y.split(10))), test


def test_each_head_answers_every_batch_before_the_learner_trains_on_it(stream):
    batches, _ = stream
    learner = chosen_learner()
    learner.observe(*batches[0])  # classes no head has seen: nothing to score
    assert all(not by_class for by_class in learner.head_choice.hits.values())
    for x, y in batches[1:4]:
        before = copy.deepcopy(learner)  # the learner about to step
        expected = before.head_probabilities(*before.encode_incoming(x))
        seen = torch.isin(y, torch.tensor(before.stream_head.classes()))
        hits_before = {h: {c: list(d) for c, d in by_class.items()} for h, by_class in learner.head_choice.hits.items()}
        learner.observe(x, y)
        for head in CANDIDATES:
            right = (expected[head].argmax(1) == y)[seen].tolist()
            for label in y[seen].unique().tolist():
                new = list(learner.head_choice.hits[head][label])[len(hits_before[head].get(label, [])):]
                assert new == [r for r, l in zip(right, y[seen].tolist()) if l == label]


def test_each_class_is_answered_by_its_head_in_the_learner_the_predictor_and_the_snapshot(stream, tmp_path):
    batches, test = stream
    learner = chosen_learner()
    for x, y in batches:
        learner.observe(x, y)
    learner.head_choice.chosen = {0: "top", 1: "mix", 2: "pool"}  # as a stream that measured those better would have
    learner.head_choice.pool = (0.8, 2.0)  # as a fit on held-back samples would have set it ...
    learner.head_choice.pool_classes = [2, 3]  # ... weighing the top on the classes measured then
    choice = learner.head_choice.choice(learner.num_classes)
    assert choice.tolist() == [CANDIDATES.index(h) for h in ("top", "mix", "pool", "slda")]

    probabilities = learner.head_probabilities(*learner.encode_incoming(test))
    expected = compose(torch.stack([probabilities[h] for h in CANDIDATES]), choice)
    assert torch.allclose(expected.sum(1), torch.ones(len(test)), atol=1e-5)
    assert torch.allclose(torch.softmax(learner.logits(test), 1), expected, atol=1e-5)

    predictor = Predictor.from_learner(learner, ["a", "b", "c", "d"], trained_upto=0)
    assert predictor.head_name == "chosen" and predictor.choice_summary["classes"][0]["head"] == "top"
    assert torch.allclose(predictor.probabilities(test), expected, atol=1e-4)

    weight, bias, served_choice = learner.served_choice()
    net = PixelsToLogits(learner.serving_model, [0, 1, 2, 3], learner.served_head(), backbone=learner.backbone,
                         stream_head=(weight, bias), choice=served_choice.tolist(),
                         pool=learner.head_choice.pool_of(learner.num_classes))
    path = tmp_path / "chosen.onnx"
    export_onnx(net, ["a", "b", "c", "d"], path, {"head": "chosen"})
    logits = ort.InferenceSession(str(path)).run(None, {"pixels": test.numpy()})[0]
    assert np.allclose(torch.softmax(torch.from_numpy(logits), 1).numpy(), expected.numpy(), atol=1e-3)


def test_a_choice_that_reads_no_top_answers_alike_without_the_tops_pass(stream, tmp_path):
    """While every class is streaming LDA's (before the top is measured better anywhere), the predictor and the
    snapshot leave the top's pass out, to the learner's answers; once a class reads the top, both pass through it."""
    batches, test = stream
    learner = chosen_learner()
    for x, y in batches:
        learner.observe(x, y)
    classes = ["a", "b", "c", "d"]

    def snapshot(name: str) -> tuple[np.ndarray, int]:
        weight, bias, served_choice = learner.served_choice()
        path = tmp_path / f"{name}.onnx"
        export_onnx(PixelsToLogits(learner.serving_model, [0, 1, 2, 3], learner.served_head(),
                                   backbone=learner.backbone, stream_head=(weight, bias),
                                   choice=served_choice.tolist(), pool=learner.head_choice.pool_of(4)),
                    classes, path, {"head": "chosen"})
        logits = ort.InferenceSession(str(path)).run(None, {"pixels": test.numpy()})[0]
        return torch.softmax(torch.from_numpy(logits), 1).numpy(), path.stat().st_size

    sizes = {}
    for reads in (False, True):
        if reads:
            learner.head_choice.chosen = {1: "top"}
        expected = torch.softmax(learner.logits(test), 1)
        predictor = Predictor.from_learner(learner, classes, trained_upto=0)
        assert predictor.reads_top == reads == learner.head_choice.reads_top(4)
        assert torch.allclose(predictor.probabilities(test), expected, atol=1e-5)
        answers, sizes[reads] = snapshot(str(reads))
        assert np.allclose(answers, expected.numpy(), atol=1e-4)
    assert sizes[True] > sizes[False] + 1_000_000, sizes  # the top's stages and head are in the graph only then


def test_a_resumed_learner_keeps_the_measured_choice_and_answers_alike(stream):
    batches, test = stream
    learner = chosen_learner()
    for x, y in batches[:8]:
        learner.observe(x, y)
    learner.head_choice.chosen[2] = "top"
    resumed = chosen_learner()
    resumed.load_state_dict(learner.state_dict())
    assert resumed.head_choice.state_dict() == learner.head_choice.state_dict()
    for x, y in batches[8:]:
        learner.observe(x, y)
        resumed.observe(x, y)
    assert resumed.head_choice.state_dict() == learner.head_choice.state_dict()
    assert torch.equal(resumed.logits(test), learner.logits(test))


def test_a_measured_choice_needs_the_streaming_head():
    with pytest.raises(ValueError, match="choose_head"):
        make_learner("cb-sv-duel", 4, backbone=PretrainedBackbone(input_size=64), choose_head=True)


def held_back_learner(seed: int = 0, **options):
    """The measured choice on held-back samples, holding from each class's 2nd sample every 2nd, 4 at most."""
    learner = make_learner("cb-sv-duel", 4, mem_size=30, loss="ace", ema_decay=0.99, backbone=PretrainedBackbone(
        input_size=64, cut=12), seed=seed, lr=0.01, serving_head="slda", choose_head="held-back", **options)
    learner.head_choice.held = HeldBack(hold_from=2, every=2, per_class=4, min_held=2)
    learner.head_choice.measure_every = 3
    return learner


def test_held_back_samples_train_no_head_and_the_choice_is_made_on_them(stream):
    batches, _ = stream
    learner = held_back_learner()
    offered = torch.bincount(torch.cat([y for _, y in batches]), minlength=4)
    for x, y in batches:
        learner.observe(x, y)
    held = learner.head_choice.held
    stored, features, labels = held.stacked()
    assert torch.bincount(labels, minlength=4).tolist() == [4, 4, 4, 4]
    # neither streaming LDA, nor the memory, nor the step saw them; the learner counts them as seen
    assert learner.stream_head.counts[:4].tolist() == (offered - 4).tolist()
    assert learner.buffer.n_seen == int(offered.sum()) - 16 and learner.samples_seen == int(offered.sum())
    memory = learner.buffer.images[:learner.buffer.size].flatten(1)
    assert not any(torch.equal(row, s) for s in stored.flatten(1).to(memory.dtype) for row in memory)
    # the choice on them reports each candidate's accuracy and the served answer's, as they answer them
    probabilities = learner.head_probabilities(stored, features)
    learner.head_choice.choose_on_held(probabilities, labels)
    assert learner.head_choice.pool == fit_pool(probabilities["slda"], probabilities["top"], labels)
    assert learner.head_choice.pool_classes == [0, 1, 2, 3]  # every class measured: the weight on each
    probabilities = candidates(probabilities["slda"], probabilities["top"], learner.head_choice.pool_of(4))
    stacked = torch.stack([probabilities[h] for h in CANDIDATES])
    answers = {**probabilities, "served": compose(stacked, learner.head_choice.choice(4))}
    summary = learner.head_choice.summary()
    assert summary["measure"] == "held-back" and summary["held_back"]["samples"] == 16
    assert summary["held_back"]["accuracy"] == {h: round(float((p.argmax(1) == labels).float().mean()), 4)
                                                for h, p in answers.items()}
    # a resumed learner holds the same samples and keeps the choice
    twin = held_back_learner()
    twin.load_state_dict(copy.deepcopy(learner.state_dict()))
    assert twin.head_choice.chosen == learner.head_choice.chosen and twin.head_choice.pool == learner.head_choice.pool
    assert torch.equal(twin.head_choice.held.stacked()[0], stored) and twin.head_choice.held.seen == held.seen


def test_a_restart_under_another_head_keeps_the_held_back_samples_and_probabilities_sum_to_one(stream):
    """A directory trained under the measured choice, restarted to hand serving to the trained top
    (ASER_TRAINED_HEAD_FROM): its held-back samples go on (the same classes, the same count since the newest, so the
    same floor) and its probabilities sum to one; with no class known to spread over, the floor goes to every one."""
    from learner.heads.calibration import Calibration

    batches, test = stream
    learner = held_back_learner(calibrate=True)
    for x, y in batches:
        learner.observe(x, y)
    handing = make_learner("cb-sv-duel", 4, mem_size=30, loss="ace", ema_decay=0.99, backbone=PretrainedBackbone(
        input_size=64, cut=12), seed=0, lr=0.01, serving_head="slda", trained_head_from=1, calibrate=True)
    handing.load_state_dict(copy.deepcopy(learner.state_dict()))
    assert not handing.streams and handing.head_choice is None
    assert handing.held_back.seen == learner.head_choice.held.seen and len(handing.held_back) == 16
    assert handing.calibration().floor == learner.calibration().floor and handing.calibration().held == 16
    assert torch.allclose(handing.logits(test).exp().sum(1), torch.ones(len(test)))
    nothing_offered = Calibration(floor=0.5, live=torch.zeros(4, dtype=torch.bool))
    assert torch.allclose(nothing_offered.probabilities(torch.randn(3, 4)).sum(1), torch.ones(3))


def test_the_pool_leans_on_the_head_whose_probabilities_earn_the_likelihood():
    labels = torch.tensor([0, 1] * 50)
    right, wrong = torch.nn.functional.one_hot(labels, 2).float(), torch.nn.functional.one_hot(1 - labels, 2).float()

    def sure(hits):  # overconfident: 0.99 on its answer
        return hits * 0.98 + 0.01

    def soft(hits):  # 0.7 on its answer
        return hits * 0.4 + 0.3

    # streaming LDA sure and wrong on a fifth, the top softly right on all: the pool leans on the top
    slda = sure(torch.cat([wrong[:20], right[20:]]))
    weight, _ = fit_pool(slda, soft(right), labels)
    assert weight >= 0.7
    assert (candidates(slda, soft(right), (weight, 1.0))["pool"].argmax(1) == labels).all()
    # the top a coin toss: the pool leans on streaming LDA
    coin = torch.full((100, 2), 0.5) + 0.1 * torch.randn(100, 1, generator=torch.Generator().manual_seed(0)) * \
        torch.tensor([1.0, -1.0])
    assert fit_pool(soft(right), coin, labels)[0] <= 0.3


def test_the_pool_weighs_the_top_only_on_measured_classes_so_a_young_one_keeps_streaming_ldas_answer():
    choice = HeadChoice(measure="held-back", prior="pool")
    choice.held = HeldBack(hold_from=1, every=1, per_class=20, min_held=10)
    labels = torch.tensor([0] * 10 + [1] * 10 + [2] * 3)  # class 2 young: 3 held samples, below the 10 to measure
    choice.held.samples = {c: [(torch.zeros(1), torch.zeros(1))] * int((labels == c).sum()) for c in range(3)}
    one_hot = torch.nn.functional.one_hot(labels, 3).float()
    slda = one_hot * 0.5 + 0.5 / 3  # softly right, but wrong on a fifth of the measured classes' samples
    slda[[0, 1, 10, 11]] = slda[[10, 11, 0, 1]]
    top = torch.cat([one_hot[:20] * 0.9 + 0.05, torch.full((3, 3), 1 / 3)])  # surely right; class 2 unlearned
    choice.choose_on_held({"slda": slda, "top": top}, labels)
    assert choice.pool_classes == [0, 1] and choice.pool[0] > 0.5  # the top earns the likelihood where measured
    weights, temperature = choice.pool_of(3)
    assert torch.equal(weights, torch.tensor([choice.pool[0]] * 2 + [0.0])) and choice.head_of(2) == "pool"
    # a sample of class 2, streaming LDA right, the top never trained on it: weighed on every class the pool
    # follows the top's veto; weighed on the measured ones, streaming LDA's answer stands
    slda, top = torch.tensor([[0.1, 0.1, 0.8]]), torch.tensor([[0.5, 0.5 - 1e-6, 1e-6]])
    assert candidates(slda, top, choice.pool)["pool"].argmax(1).item() == 0
    assert choice.compose(candidates(slda, top, (weights, temperature))).argmax(1).item() == 2
    pool, w = pooled(slda, top, weights, temperature)[0], weights[0]  # class 2's term: streaming LDA's alone
    assert torch.isclose(pool[2] / pool[0], (0.8 / (0.1 ** (1 - w) * 0.5 ** w)) ** temperature, rtol=1e-4)
    choice.forget(0)  # a forgotten class is weighed no more
    assert choice.pool_classes == [1] and choice.pool_of(3)[0].tolist() == [0.0, weights[1].item(), 0.0]


def test_a_pool_over_no_learned_class_fits_nothing_and_one_over_them_sets_the_served_scale_at_any_weight():
    """Before a sleep has taught the top a class the pool is streaming LDA's answer and fits no temperature (that is
    calibration's, under streaming LDA's prior); once it weighs the top's classes, its fitted temperature has set the
    served scale, even where the samples give the top no weight."""
    choice = HeadChoice(measure="held-back", prior="pool")
    choice.held = HeldBack(hold_from=1, every=1, per_class=20, min_held=10)
    labels = torch.tensor([0] * 10 + [1] * 10)
    choice.held.samples = {c: [(torch.zeros(1), torch.zeros(1))] * 10 for c in range(2)}
    slda = torch.nn.functional.one_hot(labels, 2).float() * 0.6 + 0.2  # right on all, at 0.8
    top = torch.nn.functional.one_hot(1 - labels, 2).float() * 0.9 + 0.05  # surely wrong on all
    choice.top_classes = set()  # a sleeping learner before its first sleep
    choice.choose_on_held({"slda": slda, "top": top}, labels)
    assert choice.pool == (0.0, 1.0) and not choice.serves_fitted_pool(2)
    choice.top_classes = {0, 1}
    choice.choose_on_held({"slda": slda, "top": top}, labels)
    assert choice.pool[0] == 0.0 and choice.pool[1] > 1.0  # no weight on the top; streaming LDA's answers sharpened
    assert choice.serves_fitted_pool(2) and not choice.reads_top(2)


def test_the_top_alone_answers_no_class_while_one_is_young():
    # classes 0 and 1 measured, class 2 offered but not yet: on the held samples the top, which gives class 2
    # nothing, is right where streaming LDA loses samples to class 2 (no prior: the search takes the first best head)
    choice = HeadChoice(measure="held-back")
    choice.held = HeldBack(hold_from=1, every=1, per_class=20, min_held=10)
    labels = torch.tensor([0] * 10 + [1] * 10)
    choice.held.samples = {c: [(torch.zeros(1), torch.zeros(1))] * 10 for c in range(2)}
    choice.held.seen = {0: 200, 1: 200}  # no class young: the samples move the classes to the top
    slda = torch.nn.functional.one_hot(labels, 3).float() * 0.6 + 0.1
    slda[:8] = torch.tensor([0.3, 0.1, 0.6])  # streaming LDA gives 8 of class 0's to the young class
    top = torch.nn.functional.one_hot(labels, 3).float() * 0.9 + 0.05
    top[:, 2] = 1e-6
    top = top / top.sum(1, keepdim=True)
    probabilities = {"slda": slda, "top": top}
    choice.choose_on_held(probabilities, labels)
    assert choice.head_of(0) == "top"
    choice.held.seen[2] = 5  # class 2 arrives: the top gives its classes back at the next measure
    choice.choose_on_held(probabilities, labels)
    assert choice.held.young() == [2] and "top" not in choice.chosen.values()
    assert (choice.compose(candidates(slda, top, choice.pool_of(3)))[:10].argmax(1) == 0).all()


def test_a_class_arriving_between_measures_takes_its_classes_from_the_top_at_once(stream):
    # a service answers with the choice of the last measure: the top, which does not know a class that has just
    # arrived, must not keep old classes until the next mark
    batches, _ = stream
    learner = held_back_learner()
    learner.head_choice.measure_every = 1000  # no mark after the first step: only an arrival measures
    for x, y in batches[:10]:
        learner.observe(x[y < 3], y[y < 3])
    assert learner.head_choice.held.measured() == [0, 1, 2] and not learner.head_choice.held.young()
    learner.head_choice.chosen = {c: "top" for c in range(3)}  # as a search with no class young may leave them
    x, y = batches[10]
    learner.observe(x[y < 3], y[y < 3])
    assert set(learner.head_choice.chosen.values()) == {"top"}  # no arrival, no mark: the choice stands
    x, y = batches[11]
    assert (y == 3).any()
    learner.observe(x, y)
    assert learner.head_choice.held.young() == [3] and "top" not in learner.head_choice.chosen.values()


def test_the_paired_search_moves_a_class_on_evidence_and_not_on_noise():
    labels = torch.tensor([0] * 20 + [1] * 20)
    zero, one = torch.tensor([0.9, 0.1]), torch.tensor([0.1, 0.9])
    slda = torch.stack([zero] * 20 + [one] * 20)  # right on every sample
    top = torch.stack([zero] * 40)  # wrong on class 1
    mix = torch.stack([zero] * 20 + [one] * 19 + [zero])  # one sample worse than streaming LDA
    start = torch.tensor([1, 1])  # both classes with the top
    moved = paired_search(torch.stack([slda, top, mix]), labels, start, [0, 1], compose)
    assert moved.tolist() != [1, 1] and float((compose(torch.stack([slda, top, mix]), moved).argmax(1) == labels)
                                             .float().mean()) >= 39 / 40
    # streaming LDA answering, the mean one sample behind: nothing moves
    assert paired_search(torch.stack([slda, top, mix]), labels, torch.tensor([0, 0]), [0, 1], compose).tolist() == [0, 0]
    # a class not yet measured never moves
    assert paired_search(torch.stack([slda, top, mix]), labels, start, [0], compose)[1] == 1


def test_a_prior_takes_each_measured_class_unless_its_samples_show_it_worse():
    labels = torch.tensor([0] * 20 + [1] * 20 + [2] * 20)
    zero, one, two = torch.eye(3) * 0.8 + 0.1 / 1.5
    slda = torch.stack([zero] * 20 + [one] * 20 + [two] * 20)  # right on every sample
    top = torch.stack([zero] * 60)  # wrong on classes 1 and 2
    worse = torch.tensor([0.5, 0.47, 0.03])  # the mean's answer to class 2's last sample: wrong
    mix = torch.stack([zero] * 20 + [one] * 20 + [two] * 19 + [worse])  # as right on classes 0 and 1, not 2
    stacked, start = torch.stack([slda, top, mix]), torch.tensor([0, 0, 0])
    # without a prior a tie moves nothing; with the mean as the prior every class it is as right on goes to it,
    # and one it is measured worse on (class 2: the last sample) and one not yet measured (class 1) stay
    assert paired_search(stacked, labels, start, [0, 2], compose).tolist() == [0, 0, 0]
    prior = CANDIDATES.index("mix")
    assert paired_search(stacked, labels, start, [0, 2], compose, preferred=prior).tolist() == [prior, 0, 0]
    with pytest.raises(ValueError, match="held-back"):
        make_learner("cb-sv-duel", 4, backbone=PretrainedBackbone(input_size=64), serving_head="slda",
                     choose_head=True, head_prior="mix")
