"""Probabilities that mean what they say, and "none of these" (learner.heads.calibration), in process on real data:
streaming LDA on Lite0's frozen features learns Split EuroSAT tiles; the temperature fitted on its held-back samples
brings the confidence down to the accuracy without moving an answer, and CIFAR-10 photos score as unknown."""

from __future__ import annotations

import pytest
import torch

from learner.metrics import auroc, expected_calibration_error


@pytest.fixture(scope="module")
def encoded(eurosat_latents, cifar10_slice):
    """Split EuroSAT tiles (120 training, 40 test a class) and 250 CIFAR-10 test photos, as Lite0's cut-11 latents
    at 64 px."""
    data, backbone = eurosat_latents
    far = torch.cat([backbone.encode_with_features(x)[0] for x in cifar10_slice.test_x[::4].split(50)])
    return data, far, backbone


@pytest.fixture(scope="module")
def learned(encoded):
    from learner import make_learner
    from learner.data import task_batches

    data, _, backbone = encoded
    learner = make_learner("slda", data.num_classes, backbone=backbone, seed=0, calibrate=True)
    for task in ([0, 1], [2, 3], [4, 5]):
        for x, y in task_batches(data, task, 10, torch.Generator().manual_seed(0)):
            learner.observe(x, y)
    return learner


def test_the_temperature_brings_confidence_to_accuracy_and_moves_no_answer(encoded, learned):
    data = encoded[0]
    test = torch.isin(data.test_y, torch.arange(6))
    x, y = data.test_x[test], data.test_y[test]
    raw, calibrated = learned._logits(x, 512, True), learned.logits(x)
    assert torch.equal(raw.argmax(1), calibrated.argmax(1))
    calibration = learned.calibration()
    assert calibration.held == len(learned.held_back) == 6 * 11 and calibration.temperature > 1
    before = expected_calibration_error(torch.softmax(raw, 1), y)
    after = expected_calibration_error(torch.softmax(calibrated, 1), y)
    assert after < 0.8 * before and after < 0.04, (before, after)
    assert int((torch.softmax(calibrated, 1).max(1).values > 0.99).sum()) < int((torch.softmax(raw, 1).max(1).values
                                                                                  > 0.99).sum())


def test_photos_of_no_learned_class_are_none_of_these(encoded, learned):
    data, far, _ = encoded
    known = learned.unknown_scores(data.test_x[data.test_y < 6])
    strangers = learned.unknown_scores(far)
    assert auroc(known, strangers) > 0.95
    calibration = learned.calibration()
    false_alarms = float(calibration.unknown(known).float().mean())
    assert false_alarms < 0.15 and float(calibration.unknown(strangers).float().mean()) > 0.5


def test_a_restored_learner_answers_with_the_same_calibration(encoded, learned):
    from learner import make_learner

    data, _, backbone = encoded
    restored = make_learner("slda", data.num_classes, backbone=backbone, seed=0, calibrate=True)
    restored.load_state_dict(learned.state_dict())
    assert restored.calibration().summary() == learned.calibration().summary()
    assert restored.calibration().parts == learned.calibration().parts
    x = data.test_x[:50]
    assert torch.allclose(restored.logits(x), learned.logits(x))


def test_none_of_these_reads_the_stored_latents_channel_means_beside_the_frozen_features(encoded, learned):
    """At cut 11 the stored latent is block 11's input: its channel means keep the textures and colours that the last
    layer's pooling averages away, and tell photos from satellite tiles on their own. The score adds their distance to
    the nearest class's, each part standardised; the latest trained samples keep them, scored out of sample alike."""
    data, far, backbone = encoded
    calibration, recent = learned.calibration(), learned.recent_features
    assert calibration.parts is not None and backbone.channels == recent.channels > 0
    assert all(recent.channel_rows(c).shape == (len(recent.keys(c)), backbone.channels) for c in recent.kept)
    assert calibration.summary()["threshold_samples"] == calibration.held + len(recent)
    known = data.test_x[data.test_y < 6]
    channel = [calibration.channel_distance(backbone.channel_means(x)) for x in (known, far)]
    assert auroc(*channel) > 0.9
    probabilities = torch.softmax(learned.logits(known[:5]), 1).cpu()
    with pytest.raises(ValueError, match="channel means"):
        calibration.unknown_score(probabilities, learned.frozen_features(known[:5]).cpu())


def test_a_state_from_before_the_channel_means_restores_with_the_frozen_distance_alone(encoded, learned):
    """A service restarted from a checkpoint saved before the channel means were kept scores as before (its classes
    have none of them) rather than on half a sum, and starts its latest samples afresh."""
    from learner import make_learner

    data, _, backbone = encoded
    state = learned.state_dict()
    del state["channel_sums"]
    state["recent_features"] = {c: (keys, rows[:, :-backbone.channels]) for c, (keys, rows, _) in
                                state["recent_features"].items()}
    restored = make_learner("slda", data.num_classes, backbone=backbone, seed=0, calibrate=True)
    restored.load_state_dict(state)
    calibration = restored.calibration()
    assert calibration.parts is None and len(restored.recent_features) == 0
    x = data.test_x[:20]
    assert torch.allclose(restored.logits(x), learned.logits(x))
    assert torch.isfinite(restored.unknown_scores(x)).all()


def test_a_forgotten_class_leaves_the_held_back_samples(encoded, learned):
    import copy

    learner = copy.deepcopy(learned)
    held = len(learner.held_back)
    learner.forget_class(0)
    assert 0 not in learner.held_back.samples and len(learner.held_back) < held
    assert learner.calibration().held == len(learner.held_back)
    assert 0 not in learner.recent_features.kept


def test_trained_samples_are_scored_against_their_class_mean_without_them(learned):
    """The threshold also reads the latest trained samples of each class, each scored as if it had never trained:
    its distance to its class's mean with it taken out of streaming LDA's sums, exactly; in sample it would look
    nearer than it is (and the threshold too low)."""
    import copy
    from dataclasses import replace

    from learner.heads.calibration import unit_means

    recent, head = learned.recent_features, learned.stream_head
    assert sorted(recent.kept) == list(range(6))  # under its budget, every sample streaming LDA took in
    assert all(len(recent.keys(c)) == int(head.counts[c]) <= recent.per_class for c in recent.kept)
    scores = recent.distances(head.sums, head.counts, unit_means(head.sums, head.counts, learned.num_classes))
    rows = [(c, f.float()) for c in recent.kept for f in recent.features(c)]
    calibration = learned.calibration()
    in_sample = calibration.distance(torch.stack([f for _, f in rows]))
    assert float(in_sample.mean()) < float(scores.mean())
    position = int((scores - in_sample).argmax())  # one whose own class is its nearest
    label, features = rows[position][0], rows[position][1][None]
    without = copy.deepcopy(head)
    without.remove(features, torch.tensor([label]))
    out_of_sample = replace(calibration, means=unit_means(without.sums, without.counts, learned.num_classes))
    assert float(out_of_sample.distance(features)) == pytest.approx(float(scores[position]), abs=1e-4)
    assert float(in_sample[position]) < float(scores[position])
    assert calibration.threshold is not None
    assert calibration.summary()["threshold_samples"] == calibration.held + len(recent)


def test_a_relabelled_sample_leaves_the_class_it_was_kept_under():
    from learner.heads.recent_features import RecentFeatures

    recent = RecentFeatures(total=6, min_per_class=1)
    recent.keep(torch.eye(3).repeat(2, 1), torch.tensor([0, 1, 2, 0, 1, 2]), torch.arange(6))
    recent.drop(4)
    recent.drop(-1)  # no key was given: nothing to tell apart
    assert recent.keys(1) == [1] and len(recent) == 5
    assert torch.equal(recent.features(1), torch.eye(3)[1:2].half())


def test_the_latest_samples_of_a_class_survive_a_new_class_and_a_restart_in_order():
    from learner.heads.recent_features import RecentFeatures

    recent = RecentFeatures(total=6, min_per_class=1)
    rows = torch.arange(10.0)[:, None].repeat(1, 2)
    recent.keep(rows[:5], torch.zeros(5, dtype=torch.long), torch.arange(5))  # a ring of 6: nothing goes
    recent.keep(rows[5:9], torch.tensor([0, 0, 1, 1]), torch.arange(5, 9))  # a second class: 3 each, the latest
    assert recent.keys(0) == [4, 5, 6] and recent.keys(1) == [7, 8]
    recent.keep(rows[9:], torch.tensor([0]), torch.tensor([9]))  # around the ring
    assert recent.keys(0) == [5, 6, 9] and recent.features(0)[:, 0].tolist() == [5.0, 6.0, 9.0]
    again = RecentFeatures(total=6, min_per_class=1)
    again.load_state_dict(recent.state_dict())
    assert again.keys(0) == [5, 6, 9] and torch.equal(again.features(0), recent.features(0))
    again.keep(rows[:1], torch.tensor([1]), torch.tensor([0]))
    assert again.keys(1) == [7, 8, 0] and len(again) == 6


def test_with_nothing_held_back_the_prior_keeps_the_first_answers_humble(encoded):
    """Eight tiles a class: nothing is held back yet, the prior's temperature answers, and no photo of the
    test set gets a probability of 1."""
    from learner import make_learner
    from learner.heads.calibration import FIRST_PRIOR_TEMPERATURE

    data, _, backbone = encoded
    learner = make_learner("slda", data.num_classes, backbone=backbone, seed=0, calibrate=True)
    for c in range(3):
        learner.observe(data.train_x[data.train_y == c][:8], torch.full((8,), c))
    calibration = learner.calibration()
    assert calibration.held == 0 and calibration.threshold is None
    assert calibration.temperature == pytest.approx(FIRST_PRIOR_TEMPERATURE, rel=0.05)
    probabilities = torch.softmax(learner.logits(data.test_x[data.test_y < 3]), 1)
    assert float(probabilities.max()) < 1.0


def test_a_new_class_restarts_the_floor_so_that_no_answer_is_sure_while_it_is_young(encoded, learned):
    """Laplace's rule counted from the newest class's first sample: the stream has just shown that its world is not
    closed, so ten tiles into a new class no answer passes 1 - 1/12 of the spread, however sure the old classes are."""
    import copy

    data = encoded[0]
    learner = copy.deepcopy(learned)
    assert learner.calibration().floor < 0.005  # 240 samples since class 5 came
    learner.observe(data.train_x[data.train_y == 6][:10], torch.full((10,), 6))
    calibration = learner.calibration()
    assert calibration.floor == pytest.approx(1 / (10 + 2))
    probabilities = torch.softmax(learner.logits(data.test_x[data.test_y < 7]), 1)
    assert float(probabilities.max()) <= 1 - calibration.floor * 6 / 7 + 1e-5 < 0.93
    again = copy.deepcopy(learned)
    again.load_state_dict(learner.state_dict())  # the count goes on from the state
    assert again.calibration().floor == pytest.approx(calibration.floor)
