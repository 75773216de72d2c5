"""The pretrained edge backbone (EfficientNet-Lite0's ImageNet weights): the weights answer like an
ImageNet classifier, the frozen part never trains, the memory holds the frozen part's latents, the
streaming heads are exact, and a learner on it resumes bit for bit and forgets a class whole.
Real weights (the package's file), real CIFAR-10 and Mini-ImageNet images."""

from __future__ import annotations

import io
import json
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from clients.bench.benchmark import main
from learner import make_learner
from learner.heads.streaming_lda import YOUNG_CLASS, StreamingLDA, make_head
from learner.networks.backbone import PretrainedBackbone
from learner.networks.lite0 import POOLED, load_lite0

from .conftest import CIFAR10_ZIP, MINI_ZIP, ROOT

# ImageNet-1k's class ids in index order, from timm (timm/data/_info/imagenet_synsets.txt); sorted wnids
SYNSETS = (ROOT / "tests" / "data" / "imagenet_synsets.txt").read_text().split()


def mini_imagenet_sample(per_class: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first `per_class` images of each Mini-ImageNet class, labelled with ImageNet's index."""
    images, labels = [], []
    with zipfile.ZipFile(MINI_ZIP) as z:
        names = z.namelist()
        for wnid in z.read("mini-imagenet/classes.txt").decode().split():
            for name in sorted(n for n in names if n.startswith(f"mini-imagenet/{wnid}/"))[:per_class]:
                image = Image.open(io.BytesIO(z.read(name))).convert("RGB")
                images.append(np.asarray(image).transpose(2, 0, 1))
                labels.append(SYNSETS.index(wnid))
    return torch.from_numpy(np.stack(images)), torch.tensor(labels)


def test_the_imagenet_weights_answer_like_an_imagenet_classifier():
    # measured: 48% top-1 on 2 images a class at 224 px; chance is 0.1%, a wrong key map or scaling
    # gives near chance
    images, labels = mini_imagenet_sample(per_class=1)
    net = load_lite0(input_size=224)
    with torch.no_grad():
        predicted = torch.cat([net(chunk) for chunk in images.split(25)]).argmax(1)
    assert (predicted == labels).float().mean() >= 0.30


@pytest.mark.parametrize("size", [32, 97, 160])
def test_the_latent_shape_by_arithmetic_is_the_forwards(size):
    frozen = load_lite0(input_size=size)
    pixels = torch.zeros(1, 3, size, size, dtype=torch.uint8)
    with torch.no_grad():
        for cut in range(POOLED + 1):
            assert frozen.latent_shape(cut) == tuple(frozen.lower(pixels, cut).shape[1:]), cut


@pytest.mark.parametrize("cut", [11, POOLED])
def test_onnxruntime_runs_the_frozen_part_as_pytorch_does_on_real_photos(cut):
    # the learner's frozen part runs in onnxruntime (learner.networks.frozen_runtime); PyTorch's eager forward is the reference
    images, _ = mini_imagenet_sample(per_class=1)
    backbone = PretrainedBackbone(input_size=160, cut=cut)
    stored, features = backbone.encode_with_features(images)
    with torch.no_grad():
        reference = backbone.frozen.lower(images, cut)
        reference_features = backbone.frozen.upper(reference.half().float(), cut)
    assert stored.dtype == torch.float16 and stored.shape == reference.shape
    # within fp16's rounding of the latent (a relative 2^-11) plus the kernels' float32 differences
    assert torch.allclose(stored.float(), reference, rtol=2e-3, atol=2e-3)
    assert torch.allclose(features, reference_features, rtol=2e-3, atol=2e-3)
    assert torch.allclose(backbone.frozen_features(stored), features, rtol=1e-4, atol=1e-4)
    # the frozen network's ImageNet answers stay the same on every photo
    assert torch.equal(backbone.frozen.classifier(features).argmax(1),
                       backbone.frozen.classifier(reference_features).argmax(1))


def test_the_frozen_graphs_are_exported_in_a_child_once_and_then_read_from_the_file_cache(tmp_path, monkeypatch):
    """The exporter (torch.onnx, onnx, the trace's garbage: 40 MB kept at 160 px) stays out of the learner's process:
    a child exports, the file cache keeps the graph for the next process, and a damaged file (cut short, or a block
zeroed) is exported again."""
    from learner.networks.frozen_runtime import FrozenGraphs, graph_cache_dir

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    images, _ = mini_imagenet_sample(per_class=1)
    frozen = load_lite0(input_size=64)
    with torch.no_grad():
        reference = frozen.lower(images, 11)
    latent, _ = FrozenGraphs(frozen, 11).lower(images, features=False)
    assert torch.allclose(latent, reference, rtol=1e-3, atol=1e-3)
    (cached,) = graph_cache_dir().glob("*.onnx")
    graph = cached.read_bytes()
    assert cached.parent == tmp_path / "aser" / "graphs" and len(graph) > 1_000_000
    assert FrozenGraphs(frozen, 11).lower(images[:5], features=False)[0].equal(latent[:5])  # from the file
    cached.write_bytes(graph[:1000])
    assert torch.equal(FrozenGraphs(frozen, 11).lower(images[:5], features=False)[0], latent[:5])
    assert cached.read_bytes() == graph  # exported again: the same bytes
    middle = len(graph) // 2  # a block of weights zeroed: it still parses and would answer wrong; its sha256 differs
    cached.write_bytes(graph[:middle] + bytes(4096) + graph[middle + 4096:])
    assert torch.equal(FrozenGraphs(frozen, 11).lower(images[:5], features=False)[0], latent[:5])
    assert cached.read_bytes() == graph


def test_before_a_sleep_the_pixels_session_gives_back_its_largest_runs_buffers_and_answers_alike():
    """The pixels' session keeps an arena sized by its largest run (10 photos at 160 px); a sleep runs no pixels and
    wants the memory for its batches: `release_buffers` shrinks the arena, and the next runs answer as before."""
    from learner.networks.frozen_runtime import trim_heap

    images = mini_imagenet_sample(per_class=1)[0][:10]
    backbone = PretrainedBackbone(input_size=160, cut=11)
    stored, features = backbone.encode_with_features(images)
    backbone.encode_with_features(images)

    def resident_mb() -> float:
        status = Path("/proc/self/status").read_text()
        return int(next(line for line in status.splitlines() if line.startswith("VmRSS")).split()[1]) / 1024

    trim_heap()  # what the C heap holds free goes anyway: the arena's buffers are what is measured
    before = resident_mb()
    backbone.release_buffers()
    assert before - resident_mb() > 15  # 32 MB on this machine (docs/results/sleep.md)
    again, again_features = backbone.encode_with_features(images)
    assert torch.equal(again, stored) and torch.equal(again_features, features)


@pytest.fixture(scope="module")
def stream(cifar10_slice):
    """Ten batches of ten CIFAR-10 training images over four classes."""
    keep = torch.nonzero(cifar10_slice.train_y < 4).flatten()
    pick = keep[torch.randperm(keep.numel(), generator=torch.Generator().manual_seed(0))[:100]]
    x, y = cifar10_slice.train_x[pick], cifar10_slice.train_y[pick]
    return list(zip(x.split(10), y.split(10)))


def lite0_learner(cut: int, method: str = "cb-sv-duel", seed: int = 0, **options):
    backbone = PretrainedBackbone(input_size=64, cut=cut)
    return make_learner(method, 4, mem_size=30, loss="ace", iterations=2, ema_decay=0.99, backbone=backbone,
                        seed=seed, lr=0.01, **options)


def test_the_frozen_part_never_changes_and_the_memory_holds_its_latents(stream):
    learner = lite0_learner(cut=14)
    frozen_before = {k: v.clone() for k, v in learner.backbone.frozen.state_dict().items()}
    top_before = {k: v.clone() for k, v in learner.model.state_dict().items()}
    for x, y in stream:
        learner.observe(x, y)
    assert all(torch.equal(v, learner.backbone.frozen.state_dict()[k]) for k, v in frozen_before.items())
    assert not all(torch.equal(v, learner.model.state_dict()[k]) for k, v in top_before.items())
    # the pretrained BatchNorm statistics stay: only scale and shift train in the top
    bn = [k for k in top_before if "running_" in k]
    assert bn and all(torch.equal(top_before[k], learner.model.state_dict()[k]) for k in bn)

    buffer = learner.buffer
    assert len(buffer) == 30 and buffer.images.dtype == torch.float16
    assert tuple(buffer.images.shape[1:]) == (192, 2, 2)  # block 14's input at 64 px
    with torch.no_grad():  # batch by batch as the stream came (a convolution's last bits may depend on the batch)
        fresh = torch.cat([learner.backbone.encode(x) for x, _ in stream])
    # each stored latent is the fresh forward of one of the stream's images
    match = [(fresh == buffer.images[i]).flatten(1).all(1).nonzero().numel() for i in range(len(buffer))]
    assert all(m >= 1 for m in match)


def test_a_learner_on_the_pretrained_backbone_resumes_bit_for_bit(stream):
    learner = lite0_learner(cut=15, serving_head="slda")
    for x, y in stream[:5]:
        learner.observe(x, y)
    resumed = lite0_learner(cut=15, serving_head="slda")
    resumed.load_state_dict(learner.state_dict())
    for x, y in stream[5:]:
        learner.observe(x, y)
        resumed.observe(x, y)
    test = torch.cat([x for x, _ in stream[:3]])
    assert torch.equal(learner.logits(test), resumed.logits(test))
    assert torch.equal(learner.logits(test, serving=False), resumed.logits(test, serving=False))
    assert torch.equal(learner.buffer.images, resumed.buffer.images)


def test_a_standardised_top_feeds_its_head_the_trained_features_at_zero_mean_and_unit_variance(stream):
    # weights held still (lr 0): the running statistics are then exactly those of every batch trained on
    backbone = PretrainedBackbone(input_size=64, cut=15, standardize=True)
    learner = make_learner("finetune", 4, backbone=backbone, lr=0.0)
    for x, y in stream[:5]:
        learner.observe(x, y)
    trained = learner.encode(torch.cat([x for x, _ in stream[:5]]))
    features = learner.extract(trained)
    plain = make_learner("finetune", 4, backbone=PretrainedBackbone(input_size=64, cut=15), lr=0.0)
    raw = plain.extract(trained)
    assert raw.mean(0).abs().max() > 0.1  # the pooled features themselves are far from it
    assert features.mean(0).abs().max() < 1e-3
    varied = raw.var(0, unbiased=False) > 1e-3  # a feature (almost) never on keeps the epsilon's share
    assert (features.var(0, unbiased=False)[varied] - 1).abs().max() < 1e-2
    with pytest.raises(ValueError, match="pooled cut"):
        PretrainedBackbone(input_size=64, cut=POOLED, standardize=True)


def test_a_state_from_the_other_backbone_is_refused_naming_the_setting(stream):
    scratch = make_learner("cb-sv-duel", 4, mem_size=30)
    with pytest.raises(ValueError, match="backbone"):
        lite0_learner(cut=POOLED).load_state_dict(scratch.state_dict())
    with pytest.raises(ValueError, match="backbone"):
        scratch.load_state_dict(lite0_learner(cut=POOLED).state_dict())


def test_forget_removes_the_class_latents_and_its_streaming_statistics(stream):
    learner = lite0_learner(cut=POOLED, serving_head="ncm")
    for x, y in stream:
        learner.observe(x, y)
    assert 2 in learner.buffer.class_counts()
    removed = learner.forget_class(2)
    assert removed > 0 and 2 not in learner.buffer.class_counts()
    assert 2 not in learner.stream_head.classes()
    assert (learner.predict(torch.cat([x for x, _ in stream])) != 2).all()


def test_streaming_lda_is_the_batch_lda_whatever_the_order():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(300, 6, generator=g, dtype=torch.float64), torch.randint(0, 5, (300,), generator=g)
    x[:, 0] += 2 * y  # a class signal along one axis
    forward, backward = StreamingLDA(6), StreamingLDA(6)
    for i in range(0, 300, 7):
        forward.update(x[i:i + 7], y[i:i + 7])
    for i in reversed(range(0, 300, 13)):
        backward.update(x[i:i + 13], y[i:i + 13])
    # the batch computation: the pooled within-class covariance
    means = torch.stack([x[y == c].mean(0) for c in range(5)])
    centred = x - means[y]
    covariance = centred.T @ centred / 300
    assert torch.allclose(forward.covariance(), covariance, atol=1e-10)
    assert torch.allclose(backward.covariance(), covariance, atol=1e-10)
    a, b = forward.head(), backward.head()
    assert torch.allclose(a.weight, b.weight, atol=1e-4) and torch.equal(a.class_ids, b.class_ids)
    expected = torch.linalg.solve(covariance + 1e-4 * torch.eye(6, dtype=torch.float64), means.T).T
    assert torch.allclose(a.weight.double(), expected, rtol=1e-4, atol=1e-4)


def test_the_benchmark_runs_the_pretrained_backbone_and_records_anytime_accuracy(tmp_path, cache_dir):
    out = tmp_path / "slda.json"
    assert main(["run", "--dataset", "cifar10", "--data", str(CIFAR10_ZIP), "--train-per-class", "20",
                 "--test-per-class", "10", "--method", "slda", "--backbone", "lite0", "--input-size", "64",
                 "--threads", "1", "--quiet", "--cache-dir", str(cache_dir), "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result["anytime"]) == {"10"} and len(result["anytime_by_task"]["10"]) == 5
    assert result["anytime_by_task"]["10"][0] > 50  # two classes from ten images each: better than a coin
    end, at_10 = result["calibration"]["end"], result["calibration"]["anytime"]["10"]
    assert end["wrong"] == round(100 * (1 - result["average_accuracy"] / 100))  # 100 test images, 10 a class
    assert 0 <= end["ece"] <= 1 and 0 <= end["brier"] <= 2 and end["wrong_above_0.99"] <= end["wrong"]
    assert set(at_10) == {"ece", "brier", "mean_confidence", "wrong", "wrong_above_0.99"}
    by_task = result["calibration"]["anytime_ece_by_task"]["10"]  # the first task's apart: nothing held back yet
    assert len(by_task) == 5 and sum(by_task) / 5 == pytest.approx(at_10["ece"], abs=1e-4)
    assert result["frozen_forward_cpu_seconds"] > 0 and result["settings"]["backbone"]["cut"] == POOLED
    table = tmp_path / "table.md"
    assert main(["table", str(tmp_path), "--out", str(table)]) == 0
    assert "slda (20/class, lite0 64px cut 17)" in table.read_text() and "anytime @10" in table.read_text()


def test_the_benchmark_runs_on_a_photo_set_at_the_input_size(camera_photos, tmp_path, cache_dir):
    out = tmp_path / "photos.json"
    assert main(["run", "--dataset", "photos", "--data", str(camera_photos[0]), "--method", "slda", "--backbone",
                 "lite0", "--input-size", "64", "--threads", "1", "--quiet", "--cache-dir", str(cache_dir),
                 "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["dataset"] == "photos" and len(result["accuracy_matrix"]) == 2  # two classes a task: [0, 1], [2]
    assert result["settings"]["train_samples"] == 15 and result["settings"]["backbone"]["input_size"] == 64


def test_the_served_streaming_heads_debias_a_young_class_and_lda_waits_for_it():
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(400, 8, generator=g, dtype=torch.float64), torch.randint(0, 3, (400,), generator=g)
    means = torch.stack([x[y == c].mean(0) for c in range(3)])
    centred = x - means[y]
    ncm = make_head("ncm", 8)
    ncm.update(x, y)
    assert abs(ncm.within_variance() - float((centred ** 2).sum(1).mean())) < 1e-9  # tr(S_w), from sums alone
    head = ncm.head()  # b_c = -(|mu_c|^2 - tr(S_w) / n_c) / 2
    expected = -((means ** 2).sum(1) - ncm.within_variance() / torch.bincount(y).double()) / 2
    assert torch.allclose(head.bias.double(), expected, atol=1e-5)

    lda = make_head("slda", 8)
    lda.update(x, y)
    lda.update(x[:YOUNG_CLASS - 1] + 5, torch.full((YOUNG_CLASS - 1,), 3))  # a fourth class, still young
    young = lda.head()
    assert torch.allclose(young.weight, lda.means()[1].float())  # the class means answer while a class is young
    lda.update(x[:1] + 5, torch.tensor([3]))
    grown = lda.head()
    assert not torch.allclose(grown.weight, lda.means()[1].float()) and grown.class_ids.tolist() == [0, 1, 2, 3]


def test_the_streaming_head_serves_while_a_class_is_young_and_the_trained_head_after(stream):
    # one trajectory, three servers: always streaming LDA, always the trained head, and the hand-over
    labels = torch.cat([y for _, y in stream])
    mature = int(torch.bincount(labels).min())  # every class has this many once the stream is in
    handing = lite0_learner(cut=15, serving_head="slda", trained_head_from=mature)
    streaming, trained = lite0_learner(cut=15, serving_head="slda"), lite0_learner(cut=15)
    test = torch.cat([x for x, _ in stream[:3]])
    for x, y in stream:
        for learner in (handing, streaming, trained):
            learner.observe(x, y)
        if handing.streams:
            assert torch.equal(handing.logits(test), streaming.logits(test))
    assert not handing.streams and handing.stream_head.youngest() == mature
    assert torch.equal(handing.logits(test), trained.logits(test))
    assert torch.equal(handing.served_head()[0], trained.served_head()[0])
    # a new class is young again: streaming LDA answers it until it has grown, or it is forgotten
    for learner in (handing, streaming):
        learner.observe(stream[0][0][:2], torch.tensor([4, 4]))
    assert handing.streams and torch.equal(handing.logits(test), streaming.logits(test))
    handing.forget_class(4)
    assert not handing.streams
    with pytest.raises(ValueError, match="serving_head"):
        lite0_learner(cut=15, trained_head_from=10)
