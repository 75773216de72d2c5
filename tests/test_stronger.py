"""The stronger learner's options on real CIFAR-10 images: augmentation (crop + flip, and the
stronger policy), repeated rehearsal, the moving-average serving weights, the average as a
distillation teacher, BatchNorm statistics recomputed on the memory, and runs that resume with all
of them."""

import pytest
import torch
from torch.nn import functional as F

from clients.bench.benchmark import build_parser
from clients.bench.stream.protocol import run_once
from learner import make_learner
from learner.data import load_dataset
from learner.methods.augment import BatchAugment, StrongAugment
from learner.methods.objective import ReplayObjective, distillation
from learner.networks.reduced_resnet import scale_pixels

from .conftest import CIFAR10_ZIP
from .test_resume import comparable, run_args


def mixed(data, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """n training images of every class, shuffled (the slice is in class order)."""
    order = torch.randperm(data.train_y.numel(), generator=torch.Generator().manual_seed(0))[:n]
    return data.train_x[order], data.train_y[order]


def crops_of(image: torch.Tensor, padding: int) -> list[torch.Tensor]:
    """Every crop of the zero-padded image, and its mirror."""
    _, h, w = image.shape
    padded = F.pad(image, (padding,) * 4)
    crops = [padded[:, y:y + h, x:x + w] for y in range(2 * padding + 1) for x in range(2 * padding + 1)]
    return crops + [c.flip(-1) for c in crops]


def test_augmentation_crops_and_flips_keeps_shapes_and_is_reproducible(cifar10_slice):
    images = cifar10_slice.train_x[:64]
    out = BatchAugment(padding=4, seed=7)(images)
    assert out.shape == images.shape and out.dtype == torch.uint8
    assert torch.equal(BatchAugment(padding=4, seed=7)(images), out)
    assert not torch.equal(BatchAugment(padding=4, seed=8)(images), out)
    for original, augmented in zip(images[:16], out[:16]):  # each output is one crop of its own image
        assert any(torch.equal(augmented, c) for c in crops_of(original, 4))
    flipped = sum(not any(torch.equal(a, c) for c in crops_of(o, 4)[:81]) for o, a in zip(images, out))
    assert 10 < flipped < 54  # about half are mirrored


def test_strong_augmentation_keeps_shapes_and_is_reproducible_from_its_seed(cifar10_slice):
    images = cifar10_slice.train_x[:64]
    out = StrongAugment(seed=3)(images)
    assert out.shape == images.shape and out.dtype == torch.uint8
    assert torch.equal(StrongAugment(seed=3)(images), out)
    assert not torch.equal(StrongAugment(seed=4)(images), out)
    changed = [not torch.equal(a, o) for a, o in zip(out, images)]
    assert sum(changed) == 64  # a crop of area below 1 (or a resampled whole) changes every image
    gray = sum(bool((a[0] == a[1]).all() and (a[1] == a[2]).all()) for a in out)
    assert 3 <= gray <= 26  # grayscale with probability 0.2 (binomial 64, 0.2: mean 12.8, sd 3.2)
    # the identity policy (whole image, no jitter, no grayscale) gives the image or its mirror back
    identity = StrongAugment(scale=(1.0, 1.0), ratio=(1.0, 1.0), jitter=0.0, gray_p=0.0, seed=0)(images)
    for a, o in zip(identity, images):
        assert (a.int() - o.int()).abs().max() <= 1 or (a.int() - o.flip(-1).int()).abs().max() <= 1


def test_the_memory_keeps_images_as_they_came_under_strong_augmentation(cifar10_slice):
    learner = make_learner("cb-sv-duel", 10, mem_size=200, loss="ace", augment="strong", seed=0)
    x, y = cifar10_slice.train_x[:100], cifar10_slice.train_y[:100]
    for i in range(0, 100, 10):
        learner.observe(x[i:i + 10], y[i:i + 10])
    kept = {(int(label), bytes(img.numpy())) for img, label in zip(learner.buffer.images[:100], learner.buffer.labels[:100])}
    assert kept == {(int(label), bytes(img.numpy())) for img, label in zip(x, y)}


def test_distillation_is_zero_when_student_and_teacher_agree_and_teaches_only_the_student(cifar10_slice):
    learner = make_learner("er", 10, mem_size=50, loss="ace", ema_decay=0.99, distill=2.0, seed=0)
    x, y = cifar10_slice.train_x[:20], cifar10_slice.train_y[:20]
    learner.observe(x[:10], y[:10])  # one step: the student moved, the average barely
    student = learner.forward_logits(x)
    assert distillation(student, student.detach()).item() == pytest.approx(0.0, abs=1e-6)
    # learner.teacher_logits is the average's eval-mode output; its weights get no gradient
    with_kd = learner.objective(learner.forward_logits, x[10:], y[10:], x[:10], y[:10], learner.teacher_logits)
    without = ReplayObjective("ace")(learner.forward_logits, x[10:], y[10:], x[:10], y[:10])
    with torch.no_grad():
        teacher = learner.averaged_model(scale_pixels(torch.cat([x[10:], x[:10]]))).float()
    assert distillation(learner.forward_logits(torch.cat([x[10:], x[:10]])), teacher).item() > 0
    learner.optimizer.zero_grad()
    with_kd.backward()
    assert all(p.grad is None for p in learner.averaged_model.parameters())
    assert all(p.grad is not None for p in learner.model.parameters() if p.requires_grad)
    assert with_kd.item() > without.item()  # the same batch, the same cross-entropy, plus the teacher's term
    with pytest.raises(ValueError, match="teacher"):
        learner.objective(learner.forward_logits, x[10:], y[10:], x[:10], y[:10])
    with pytest.raises(ValueError, match="--ema"):
        make_learner("er", 10, distill=1.0)


def test_recomputed_statistics_equal_a_hand_computed_pass_over_the_memory(cifar10_slice):
    learner = make_learner("er", 10, mem_size=200, loss="ace", ema_decay=0.9, serving_bn="memory", seed=0)
    x, y = mixed(cifar10_slice, 300)
    for i in range(0, 300, 10):
        learner.observe(x[i:i + 10], y[i:i + 10])
    assert learner.serving_model is learner.averaged_model  # nothing recomputed yet
    averaged = {k: v.clone() for k, v in learner.averaged_model.state_dict().items()}
    learner.refresh_serving()
    served = learner.serving_model
    assert served is not learner.averaged_model
    memory = scale_pixels(learner.buffer.images[:len(learner.buffer)])
    with torch.no_grad():  # the first BatchNorm's input over the whole memory (200 images: one chunk)
        first = learner.averaged_model.conv1(memory)
    assert torch.allclose(served.bn1.running_mean, first.mean((0, 2, 3)), atol=1e-5)
    assert torch.allclose(served.bn1.running_var, first.transpose(0, 1).flatten(1).var(1), rtol=1e-4)
    assert not torch.allclose(served.bn1.running_mean, averaged["bn1.running_mean"], atol=1e-3)
    for name, value in learner.averaged_model.state_dict().items():  # the average itself is untouched
        assert torch.equal(value, averaged[name])
    for name, value in served.state_dict().items():  # and the weights served are the average's
        if "running" not in name and "num_batches" not in name:
            assert torch.equal(value, averaged[name])
    test = cifar10_slice.test_x[:200]
    with learner.serving_from(bn="average"):
        assert learner.serving_model is learner.averaged_model
        by_average = learner.logits(test)
    assert learner.serving_model is served and not torch.allclose(learner.logits(test), by_average, atol=1e-2)


def test_the_logit_bias_is_the_one_fitted_on_the_memorys_logits(cifar10_slice):
    from learner.heads.bias_correction import fit_logit_bias

    learner = make_learner("er", 10, mem_size=200, loss="ace", ema_decay=0.9, serving_bias=True, seed=0)
    x, y = mixed(cifar10_slice, 300)
    for i in range(0, 300, 10):
        learner.observe(x[i:i + 10], y[i:i + 10])
    memory, labels = learner.buffer.images[:200], learner.buffer.labels[:200]
    before = learner.logits(memory)  # the average, uncorrected (no refresh yet)
    learner.refresh_serving()
    served = learner.serving_model
    assert served is not learner.averaged_model
    expected = learner.averaged_model.head.bias + fit_logit_bias(before, labels, 10)
    assert torch.allclose(served.head.bias, expected, atol=1e-4)
    for name, value in served.state_dict().items():  # nothing else differs from the average
        if name != "head.bias":
            assert torch.equal(value, learner.averaged_model.state_dict()[name])

    def balanced_accuracy(logits):
        right = logits.argmax(1) == labels
        return torch.stack([right[labels == c].float().mean() for c in labels.unique()]).mean()

    assert balanced_accuracy(learner.logits(memory)) >= balanced_accuracy(before)


@pytest.mark.parametrize("serving", [{}, {"serving_bn": "memory", "serving_bias": True}])
def test_an_evaluation_answers_on_shared_features_as_each_correction_does_alone(cifar10_slice, serving):
    """The benchmark's evaluation takes one feature pass for the head, the NCM and the other bias:
    each answers exactly as a whole pass of its own over the images."""
    from clients.bench.stream.protocol import evaluate
    from learner.data import task_test_set
    from learner.heads.ncm import memory_ncm

    learner = make_learner("er", 10, mem_size=200, loss="ace", ema_decay=0.9, seed=0, **serving)
    x, y = mixed(cifar10_slice, 300)
    for i in range(0, 300, 10):
        learner.observe(x[i:i + 10], y[i:i + 10])
    tasks = [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
    got = evaluate(learner, cifar10_slice, tasks)

    sets = [task_test_set(cifar10_slice, classes) for classes in tasks]

    def accuracy(predict):
        return [100.0 * float((predict(xs).cpu() == ys).float().mean()) for xs, ys in sets]

    ncm = memory_ncm(learner)
    assert got["head"] == accuracy(learner.predict)
    assert got["ncm"] == accuracy(lambda xs: ncm.predict(learner.serving_features(xs)))
    other_bias = "bias_none" if learner.serving_bias else "bias_memory"
    with learner.serving_from(bias=not learner.serving_bias):
        assert got[other_bias] == accuracy(learner.predict)
        assert got[other_bias] != got["head"]  # the bias changes answers: the check can tell the two apart
    assert got["trained"] == accuracy(lambda xs: learner.predict(xs, serving=False))


@pytest.mark.parametrize("correction", [{"serving_bn": "memory"}, {"serving_bias": True}])
def test_an_onnx_snapshot_carries_the_corrections(cifar10_slice, tmp_path, correction):
    from clients.onnx_client import OnnxClassifier
    from service.storage.snapshots import PixelsToLogits, export_onnx

    learner = make_learner("er", 10, mem_size=200, loss="ace", ema_decay=0.9, seed=0, **correction)
    x, y = mixed(cifar10_slice, 300)
    for i in range(0, 300, 10):
        learner.observe(x[i:i + 10], y[i:i + 10])
    learner.refresh_serving()
    export_onnx(PixelsToLogits(learner.serving_model, list(range(10))), cifar10_slice.class_names,
                tmp_path / "bn.onnx", {"model_version": learner.version})
    images = cifar10_slice.test_x[::8]
    theirs = torch.from_numpy(OnnxClassifier(tmp_path / "bn.onnx").logits(images.numpy()))
    assert torch.allclose(theirs, learner.logits(images), atol=1e-3)
    with learner.serving_from(bn="average", bias=False):
        assert not torch.allclose(theirs, learner.logits(images), atol=1e-2)


def test_the_memory_stores_the_incoming_images_as_they_came(cifar10_slice):
    learner = make_learner("er", 10, mem_size=200, loss="ace", augment=True, iterations=2, seed=0)
    x, y = cifar10_slice.train_x[:100], cifar10_slice.train_y[:100]
    for i in range(0, 100, 10):
        learner.observe(x[i:i + 10], y[i:i + 10])
    assert len(learner.buffer) == 100
    assert torch.equal(learner.buffer.images[:100], x) and torch.equal(learner.buffer.labels[:100], y)


class CountingRetrieval:
    """Wraps a retrieval policy and records the slots of each draw."""

    def __init__(self, inner):
        self.inner, self.name, self.draws = inner, inner.name, []

    def retrieve(self, buffer, images, labels, n, ctx):
        slots = self.inner.retrieve(buffer, images, labels, n, ctx)
        self.draws.append(slots.tolist())
        return slots


@pytest.mark.parametrize("method", ["er", "aser-mu"])
def test_repeated_rehearsal_takes_n_steps_with_n_draws(cifar10_slice, method):
    learner = make_learner(method, 10, mem_size=100, loss="ace", iterations=3, seed=1)
    learner.retrieval_policy = counting = CountingRetrieval(learner.retrieval_policy)
    x, y = cifar10_slice.train_x, cifar10_slice.train_y
    for i in range(0, 300, 10):  # the memory fills, then each batch is rehearsed three times
        learner.observe(x[i:i + 10], y[i:i + 10])
    before, draws = learner.version, len(counting.draws)
    stats = learner.observe(x[300:310], y[300:310])
    assert learner.version - before == 3 and len(counting.draws) - draws == 3 and stats["replayed"] == 30
    assert len({tuple(d) for d in counting.draws[-3:]}) > 1  # fresh draws, not one batch three times
    assert learner.steps == 31  # steps count incoming batches


class CountingExtract:
    """Wraps a learner's feature pass and counts the images it sees."""

    def __init__(self, learner):
        self.inner, self.images = learner.extract, 0
        learner.extract = self

    def __call__(self, images, *args, **kwargs):
        self.images += len(images)
        return self.inner(images, *args, **kwargs)


@pytest.mark.parametrize("method", ["er", "aser-mu", "sv-upd"])
def test_a_lean_step_is_one_step_of_the_lean_form_and_is_counted(cifar10_slice, method):
    # ASER's memory policies give way to the reservoir and random draws: no feature pass, ER's cost
    learner = make_learner(method, 10, mem_size=100, loss="ace", iterations=3, augment=True, seed=1)
    if method != "er":
        assert (learner.lean_update.name, learner.lean_retrieval.name) == ("reservoir", "random")
    learner.lean_retrieval = counting = CountingRetrieval(learner.lean_retrieval)
    x, y = cifar10_slice.train_x, cifar10_slice.train_y
    for i in range(0, 300, 10):
        learner.observe(x[i:i + 10], y[i:i + 10])
    features = CountingExtract(learner)
    before, augment, seen = learner.version, learner.augment.state_dict()["generator"], learner.buffer.n_seen
    stats = learner.observe(x[300:310], y[300:310], lean=True)
    assert learner.version - before == 1 and len(counting.draws) == 1 and stats["replayed"] == 10
    assert torch.equal(learner.augment.state_dict()["generator"], augment)  # no crop or flip drawn
    assert features.images == 0 and learner.buffer.n_seen == seen + 10  # the memory saw them, unscored
    assert learner.lean_steps == 1 and learner.steps == 31
    restored = make_learner(method, 10, mem_size=100, loss="ace", iterations=3, augment=True, seed=1)
    restored.load_state_dict(learner.state_dict())
    assert restored.lean_steps == 1
    learner.observe(x[310:320], y[310:320])  # the next step takes its full form again
    assert learner.version - before == 4 and learner.lean_steps == 1 and len(counting.draws) == 1
    assert (features.images > 0) == (method != "er")  # ASER's policies score in the latent space again


def test_skipped_samples_reach_asers_memory_through_the_reservoir_when_lean(cifar10_slice):
    learner = make_learner("sv-upd", 10, mem_size=50, loss="ace", seed=3)
    x, y = cifar10_slice.train_x, cifar10_slice.train_y
    for i in range(0, 100, 10):
        learner.observe(x[i:i + 10], y[i:i + 10])
    features, memory = CountingExtract(learner), learner.buffer.images.clone()
    learner.pass_through(x[100:400], y[100:400], 10, lean=True)
    assert features.images == 0 and learner.buffer.n_seen == 400 and learner.samples_skipped == 300
    replaced = (learner.buffer.images != memory).flatten(1).any(1).sum().item()
    assert 10 < replaced < 50  # reservoir: each of the 300 kept w.p. 50/n, about 30 slots in all
    learner.pass_through(x[400:410], y[400:410], 10)
    assert features.images > 0  # not lean: KNN-SV scores them


def test_the_ema_weights_are_the_hand_computed_average(cifar10_slice):
    decay = 0.9
    learner = make_learner("er", 10, mem_size=50, ema_decay=decay, seed=2)
    average = {k: v.clone() for k, v in learner.model.state_dict().items()}
    x, y = cifar10_slice.train_x, cifar10_slice.train_y
    for t, i in enumerate(range(0, 160, 10), start=1):  # the warm-up: d_t = min(decay, (1 + t) / (10 + t))
        learner.observe(x[i:i + 10], y[i:i + 10])
        w = 1 - min(decay, (1 + t) / (10 + t))
        for k, v in learner.model.state_dict().items():
            average[k] = (1 - w) * average[k] + w * v if v.is_floating_point() else v.clone()
    ema = learner.ema.model.state_dict()
    assert all(torch.allclose(ema[k].float(), average[k].float(), atol=1e-6) for k in average)
    assert not torch.allclose(ema["conv1.weight"], learner.model.state_dict()["conv1.weight"])
    probe = cifar10_slice.test_x[:20]  # predictions come from the average, the memory's features do not
    served = learner.ema.model.eval()(learner.to_input(probe))
    assert torch.allclose(learner.logits(probe), served, atol=1e-4)
    assert not torch.allclose(learner.extract(probe), learner.serving_features(probe), atol=1e-4)


def test_an_average_saved_before_the_warm_up_goes_on_as_a_moving_one(cifar10_slice):
    """States written before the average's warm-up hold its weights alone (checkpoints, resumable
    runs): they load as they were, and the average goes on at its decay."""
    from learner.heads.ema import WARMED_UP

    learner = make_learner("er", 10, mem_size=50, ema_decay=0.9, seed=2)
    learner.observe(cifar10_slice.train_x[:10], cifar10_slice.train_y[:10])
    state = learner.state_dict()
    old = {**state, "ema": state["ema"]["weights"]}
    again = make_learner("er", 10, mem_size=50, ema_decay=0.9, seed=2)
    again.load_state_dict(old)
    assert again.ema.updates == WARMED_UP and learner.ema.updates == 1
    assert all(torch.equal(a, b) for a, b in zip(again.ema.model.state_dict().values(),
                                                  learner.ema.model.state_dict().values()))


def test_the_average_follows_a_growing_head_and_a_forgotten_class(cifar10_slice):
    learner = make_learner("er", 2, mem_size=50, ema_decay=0.5, seed=3)
    x, y = cifar10_slice.train_x[::25][:20], torch.arange(20) % 4  # classes 2 and 3 grow the head
    learner.observe(x[:10], y[:10])
    assert learner.ema.model.head.out_features == learner.num_classes == 4
    learner.forget_class(1)
    learner.observe(x[10:20], y[10:20])
    assert (learner.logits(x[:20]).softmax(1)[:, 1] == 0).all()


@pytest.mark.parametrize("method,augment", [("er", []), ("sv-upd", []), ("cb-sv-duel", ["strong", "--distill", "1",
                                                                                        "--serving-bn", "memory"])])
def test_a_run_with_every_option_resumes_to_the_uninterrupted_result(tmp_path, cache_dir, method, augment):
    # 50 training images a class (the slice's 100 halved: CI's time), 5 tasks
    extra = ("--loss", "ace", "--augment", *augment, "--iterations", "2", "--ema", "0.9", "--train-per-class", "50")
    args = build_parser().parse_args(["run", *run_args(cache_dir, method, *extra)])
    data = load_dataset("cifar10", CIFAR10_ZIP, 50, 20, cache_dir)
    checkpoint = tmp_path / "run.resume.pt"
    whole = run_once(args, data, 1, progress=False, checkpoint=checkpoint)
    resumed = run_once(args, data, 1, progress=False, checkpoint=checkpoint)
    assert comparable(resumed) == comparable(whole) and resumed["resumed_after_pass"] == [4]
    assert whole["settings"]["augment"] == (augment[0] if augment else True) and whole["settings"]["iterations"] == 2 and whole["settings"]["ema"] == 0.9
    assert whole["steps"] == 50  # incoming batches: 500 samples of 10
    # the serving (average) head and the trained weights' own head, evaluated side by side
    assert len(whole["accuracy_matrix_trained"]) == 5 and whole["accuracy_matrix_trained"] != whole["accuracy_matrix"]
    assert resumed["accuracy_matrix_trained"] == whole["accuracy_matrix_trained"]
    # and the serving head under the other BatchNorm statistics, paired on the same run
    other = "accuracy_matrix_bn_average" if augment else "accuracy_matrix_bn_memory"
    assert len(whole[other]) == 5 and resumed[other] == whole[other]


def test_an_onnx_snapshot_with_the_ncm_head_predicts_as_the_learners_ncm(cifar10_slice, tmp_path):
    """The memory's class means as a layer of the graph: onnxruntime's predictions are the
    learner's nearest-class-mean predictions, on real CIFAR-10 test images."""
    from clients.onnx_client import OnnxClassifier
    from learner.data import task_batches
    from learner.heads.ncm import memory_ncm, ncm_head
    from service.storage.snapshots import PixelsToLogits, export_onnx

    data = cifar10_slice
    learner = make_learner("er", num_classes=10, mem_size=200, loss="ace", ema_decay=0.9, seed=0)
    for i, (x, y) in enumerate(task_batches(data, list(range(6)), 10, torch.Generator().manual_seed(0))):
        learner.observe(x, y)
        if i == 60:
            break
    present = sorted(learner.buffer.class_counts())
    net = PixelsToLogits(learner.serving_model, list(range(10)), ncm_head(learner), normalize=True)
    export_onnx(net, data.class_names, tmp_path / "ncm.onnx", {"model_version": learner.version, "head": "ncm"})
    onnx = OnnxClassifier(tmp_path / "ncm.onnx")
    assert onnx.metadata["head"] == "ncm"
    images = data.test_x[::5]
    theirs = onnx.logits(images.numpy()).argmax(1)
    ours = memory_ncm(learner).predict(learner.serving_features(images)).numpy()
    assert (theirs == ours).mean() > 0.99 and set(theirs.tolist()) <= set(present)


@pytest.mark.parametrize("options", [{"head": "ncm", "ncm_refresh_steps": 2},
                                    {"serving_bn": "memory", "serving_bias": True, "serving_refresh_steps": 2,
                                     "ema": 0.9}])
def test_the_service_and_its_snapshot_answer_alike(tmp_path, options):
    """The NCM head, or BatchNorm statistics and a logit bias from the memory: /predict and the
    ONNX snapshot (what replicas serve) answer alike on real images."""
    import io

    import httpx
    import numpy as np

    from clients.onnx_client import OnnxClassifier

    from .test_online import two_classes
    from .test_service import Server, b64, wait_trained

    server = Server(tmp_path / "svc", method="er", **options).start()
    try:
        samples = two_classes(30)
        body = {"samples": [{"label": label, "image": b64(img)} for label, img in samples]}
        assert httpx.post(f"{server.url}/samples", json=body).status_code == 201
        wait_trained(server, len(samples))
        probe = [img for _, img in two_classes(40)[-20:]]
        for _ in range(5):  # compared at one model version: an idle correction may publish between the two calls
            served = httpx.post(f"{server.url}/predict", json={"images": [b64(i) for i in probe], "k": 2}).json()
            snap = httpx.post(f"{server.url}/snapshots").json()
            if snap["model_version"] == served["model_version"]:
                break
        assert snap["model_version"] == served["model_version"]
        onnx = OnnxClassifier(httpx.get(f"{server.url}/snapshots/{snap['id']}").content)
        config = httpx.get(f"{server.url}/status").json()["config"]
        assert onnx.metadata["head"] == config["head"] == options.get("head", "softmax")
        assert config["serving_bn"] == options.get("serving_bn", "average")
        assert config["serving_bias"] is options.get("serving_bias", True)  # a JSON boolean, not 1.0
        assert config["augment"] is True and config["iterations"] == 2 and config["mem_size"] == 50
        assert config["replay_batch"] == 10  # unset, on a CPU (20 on a GPU: tests/test_gpu.py)
        for ours, theirs in zip(onnx.predict([io.BytesIO(i) for i in probe], k=2), served["results"]):
            mine, served_p = ({t["label"]: t["probability"] for t in answer} for answer in (ours, theirs))
            assert mine.keys() == served_p.keys()
            assert np.allclose([mine[label] for label in served_p], list(served_p.values()), atol=1e-4)
            # the order is the answer's wherever the two probabilities are apart by more than the runtimes' gap;
            # two classes within it (a tie, in float32 on two runtimes) may come in either order
            if abs(theirs[0]["probability"] - theirs[1]["probability"]) > 2e-4:
                assert [t["label"] for t in ours] == [t["label"] for t in theirs]
    finally:
        server.stop()


def test_a_data_directory_keeps_its_lineage_under_the_new_options(tmp_path):
    """Made by ER-ACE alone (the options off, as before they existed): it goes on with a
    moving-average head (serving only) and with the options left unset (its lineage's), and refuses
    to train its lineage on with more iterations, naming the setting."""
    import httpx

    from .test_online import two_classes
    from .test_service import Server, b64, wait_trained

    data_dir = tmp_path / "svc"
    server = Server(data_dir, method="er", augment="false", iterations=1, ema=0).start()
    samples = two_classes(10)
    httpx.post(f"{server.url}/samples", json={"samples": [{"label": lab, "image": b64(img)} for lab, img in samples]})
    wait_trained(server, len(samples))
    server.stop()
    averaged = Server(data_dir, method="er", ema=0.99).start()
    try:
        st = httpx.get(f"{averaged.url}/status").json()
        assert st["samples_trained"] == len(samples)
        assert "augment" not in st["config"] and "iterations" not in st["config"] and st["config"]["ema_decay"] == 0.99
    finally:
        averaged.stop()
    with pytest.raises(RuntimeError, match="ASER_ITERATIONS"):
        Server(data_dir, method="er", iterations=2).start()


def test_a_data_directory_of_the_previous_default_goes_on_serving_the_average(tmp_path):
    """Made by sv-upd + ACE serving its trained weights (the default before the average earned its
    place) and the default until issue 36's rule 4 (sv-upd + ACE + the average): the current default, nothing set,
    goes on with its lineage (sv-upd, one iteration, no augmentation) and serves the average."""
    import httpx

    from .test_online import two_classes
    from .test_service import Server, b64, wait_trained

    data_dir = tmp_path / "svc"
    server = Server(data_dir, method="sv-upd", ema=0).start()
    samples = two_classes(10)
    httpx.post(f"{server.url}/samples", json={"samples": [{"label": lab, "image": b64(img)} for lab, img in samples]})
    wait_trained(server, len(samples))
    assert "ema_decay" not in httpx.get(f"{server.url}/status").json()["config"]
    server.stop()
    default = Server(data_dir).start()
    try:
        st = httpx.get(f"{default.url}/status").json()
        assert st["method"] == "sv-upd" and st["samples_trained"] == len(samples)
        assert st["config"]["ema_decay"] == 0.99 and "augment" not in st["config"]
        assert st["lag"]["lean_when_behind"] is True  # the default's lean steps behind the stream
    finally:
        default.stop()
