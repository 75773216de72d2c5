"""The service on the pretrained backbone (ASER_BACKBONE=lite0), end to end as a real uvicorn process:
camera-sized JPEGs of real photos in, answers from the first few images a class, an ONNX snapshot
that is the whole network and answers as /predict, the memory browser's pictures, forgetting, a
restart that goes on as the data directory was trained, and a clear refusal when the backbone is
mixed."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest
from PIL import Image

from .test_service import Server, b64, status, wait_trained

# scikit-image's real photographs, one class each
PHOTOS = {"cat": "chelsea.png", "coffee": "coffee.png", "rocket": "rocket.jpg", "astronaut": "astronaut.png",
          "motorcycle": "motorcycle_left.png"}
TRAIN_A_CLASS, TEST_A_CLASS = 6, 2


def camera_shots(photo: Image.Image, n: int, seed: int) -> list[bytes]:
    """`n` camera-sized (640x480) JPEGs of one scene: random 4:3 framings covering 70-95% of its
    width, some mirrored, as a phone would take it several times."""
    rng = np.random.default_rng(seed)
    w, h = photo.size
    shots = []
    for _ in range(n):
        cw = int(w * rng.uniform(0.7, 0.95))
        ch = min(h, cw * 3 // 4)
        left, top = int(rng.integers(0, w - cw + 1)), int(rng.integers(0, h - ch + 1))
        shot = photo.crop((left, top, left + cw, top + ch)).resize((640, 480), Image.BILINEAR)
        if rng.random() < 0.5:
            shot = shot.transpose(Image.FLIP_LEFT_RIGHT)
        buf = io.BytesIO()
        shot.save(buf, "JPEG", quality=90)
        shots.append(buf.getvalue())
    return shots


@pytest.fixture(scope="module")
def photos():
    """label -> (training shots, held-out shots)."""
    from skimage import data_dir

    scenes = {}
    for i, (label, name) in enumerate(PHOTOS.items()):
        photo = Image.open(os.path.join(data_dir, name)).convert("RGB")
        shots = camera_shots(photo, TRAIN_A_CLASS + TEST_A_CLASS, seed=i)
        scenes[label] = shots[:TRAIN_A_CLASS], shots[TRAIN_A_CLASS:]
    return scenes


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # streaming LDA serving awake, the service's answer without sleep (the default's sleeps: tests/test_sleep.py)
    s = Server(tmp_path_factory.mktemp("lite0"), backbone="lite0", sleep="false", batch_size=5, mem_size=20,
               snapshot_int8=True, snapshot_int8_min_agreement=0.5).start()
    yield s
    s.stop()


def held_out(photos) -> tuple[list[str], list[bytes]]:
    labels = [label for label, (_, test) in photos.items() for _ in test]
    return labels, [shot for _, test in photos.values() for shot in test]


def predict(server, images: list[bytes], k: int = 1) -> dict:
    r = httpx.post(f"{server.url}/predict", json={"images": [b64(i) for i in images], "k": k}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_fresh_service_answers_camera_photos_after_six_a_class(server, photos):
    """Six 640x480 photos of each of five scenes: the frozen ImageNet features and streaming LDA (its
    class means while a class is young) answer new framings of every scene, where a network from
    scratch on six images a class answers near chance."""
    for label, (train, _) in photos.items():
        files = [("image", (f"{label}{i}.jpg", shot, "image/jpeg")) for i, shot in enumerate(train)]
        r = httpx.post(f"{server.url}/samples", files=files, data={"label": [label] * len(train)}, timeout=60)
        assert r.status_code == 201, r.text
    st = wait_trained(server, len(photos) * TRAIN_A_CLASS, timeout=600)
    assert st["config"]["backbone"] == "lite0" and st["config"]["image_size"] == 160 and st["config"]["head"] == "slda"
    labels, images = held_out(photos)
    answers = [r[0]["label"] for r in predict(server, images)["results"]]
    right = sum(a == b for a, b in zip(answers, labels))
    assert right >= len(labels) - 1, list(zip(labels, answers))


def test_the_onnx_snapshot_is_the_whole_network_and_answers_as_predict(server, photos):
    """uint8 pixels at 160 px in, logits out: the ONNX client, unchanged, reads the camera JPEGs by the
    same input rule and answers as the service does."""
    from clients.onnx_client import OnnxClassifier

    st = wait_trained(server, status(server)["samples_received"], timeout=600)
    r = httpx.post(f"{server.url}/snapshots", timeout=300)
    assert r.status_code == 201, r.text
    clf = OnnxClassifier(httpx.get(f"{server.url}/snapshots/{r.json()['id']}").content)
    assert clf.input_shape == (3, 160, 160) and clf.labels == st["classes"]
    assert clf.metadata["backbone"] == "lite0" and clf.metadata["head"] == "slda"
    assert json.loads(clf.metadata["calibration"]) == st["calibration"]  # the temperature is inside the graph
    _, images = held_out(photos)
    ours = predict(server, images, k=len(photos))
    assert ours["model_version"] == clf.model_version
    for theirs, mine, score in zip(clf.answer([io.BytesIO(i) for i in images], k=len(photos)), ours["results"],
                                   ours["unknown_score"]):
        theirs_by_label = {t["label"]: t["probability"] for t in theirs["top"]}
        assert all(abs(theirs_by_label[t["label"]] - t["probability"]) <= 1e-4 for t in mine), (theirs, mine)
        assert abs(theirs["unknown_score"] - score) <= 1e-3


def test_the_int8_variant_is_smaller_agrees_and_a_replica_serves_it(server, photos, tmp_path):
    """ASER_SNAPSHOT_INT8: onnxruntime's static quantisation calibrated on recent images, its agreement
    with the fp32 graph measured on others; a replica with ASER_REPLICA_INT8 serves it."""
    from clients.onnx_client import OnnxClassifier

    row = httpx.get(f"{server.url}/snapshots/latest").headers["x-snapshot-id"]
    snap = next(s for s in httpx.get(f"{server.url}/snapshots").json()["snapshots"] if str(s["id"]) == row)
    assert snap["int8"] is not None and 0.5 <= snap["int8"]["agreement"] <= 1
    assert snap["int8"]["size_bytes"] < 0.4 * snap["size_bytes"]
    int8 = httpx.get(f"{server.url}/snapshots/{row}", params={"variant": "int8"})
    assert int8.status_code == 200 and len(int8.content) == snap["int8"]["size_bytes"]
    clf = OnnxClassifier(int8.content)
    assert clf.metadata["variant"] == "int8" and clf.labels == snap["classes"] and clf.input_shape == (3, 160, 160)
    _, images = held_out(photos)
    served = [r[0]["label"] for r in predict(server, images)["results"]]
    quantised = [r[0]["label"] for r in clf.predict([io.BytesIO(i) for i in images], k=1)]
    assert sum(a == b for a, b in zip(served, quantised)) >= len(images) - 2

    replica = Server(tmp_path / "replica", module="service.replica", ready_path="/healthz",
                     replica_source=server.url, replica_poll_s=0.5, replica_int8=True).start()
    try:
        deadline = time.time() + 120
        while (st := httpx.get(f"{replica.url}/status").json())["snapshot_id"] is None and time.time() < deadline:
            time.sleep(0.5)
        assert st["variant"] == "int8" and str(st["snapshot_id"]) == row
        answer = httpx.post(f"{replica.url}/predict", json={"images": [b64(i) for i in images], "k": 1}).json()
        assert [r[0]["label"] for r in answer["results"]] == quantised
    finally:
        replica.stop()


def test_the_memory_holds_latents_and_shows_a_picture_a_slot(server, photos):
    wait_trained(server, status(server)["samples_received"], timeout=600)
    memory = httpx.get(f"{server.url}/memory").json()
    assert memory["size"] == 20 and set(memory["per_class"]) == set(photos)
    r = httpx.get(f"{server.url}/memory/0")
    assert r.status_code == 200 and r.headers["content-type"] == "image/png"
    picture = np.asarray(Image.open(io.BytesIO(r.content)))
    assert picture.shape == (32, 32, 3) and picture.std() > 10  # a photo, not an empty slot


def test_forgetting_removes_a_class_latents_and_answers(server, photos):
    r = httpx.delete(f"{server.url}/classes/rocket", timeout=120)
    assert r.status_code == 200, r.text
    memory = httpx.get(f"{server.url}/memory").json()
    assert "rocket" not in memory["per_class"] and memory["size"] == 20 - r.json()["memory_removed"]
    _, rocket_shots = photos["rocket"]
    answers = predict(server, rocket_shots, k=4)["results"]
    assert all(t["label"] != "rocket" for answer in answers for t in answer)


def test_a_restart_goes_on_as_the_directory_was_trained_and_a_mixed_backbone_is_refused(server, photos):
    _, images = held_out(photos)
    before, answers = status(server), predict(server, images, k=2)
    server.stop()  # SIGTERM: the worker checkpoints on the way out
    mixed = {**server.env, "ASER_BACKBONE": "scratch", "ASER_PORT": "0"}
    refused = subprocess.run([sys.executable, "-m", "service"], env=mixed, capture_output=True, text=True, timeout=180)
    assert refused.returncode != 0 and "ASER_BACKBONE" in refused.stderr
    del server.env["ASER_BACKBONE"]
    server.start()  # ASER_BACKBONE unset: the default and the data directory's lineage (lite0), the same model
    after = status(server)
    assert after["config"]["backbone"] == "lite0" and after["samples_trained"] == before["samples_trained"]
    assert predict(server, images, k=2)["results"] == answers["results"]


def test_the_trained_head_takes_over_once_every_class_has_grown(server, photos):
    """ASER_TRAINED_HEAD_FROM=N: streaming LDA answers while a class has fewer than N samples, the trained
    head once every class has N, in /predict and in the snapshot alike; a new class hands back."""
    from clients.onnx_client import OnnxClassifier
    from service.learning.lineage import check_learner
    from service.settings import Settings

    with pytest.raises(ValueError, match="ASER_TRAINED_HEAD_FROM"):
        check_learner(Settings(backbone="scratch", trained_head_from=TRAIN_A_CLASS))
    server.stop()
    server.env["ASER_TRAINED_HEAD_FROM"] = str(TRAIN_A_CLASS)  # every class left has had that many
    server.start()
    st = status(server)
    assert st["serving_head"] == "softmax" and st["config"]["trained_head_from"] == TRAIN_A_CLASS
    r = httpx.post(f"{server.url}/snapshots", timeout=300)
    assert r.status_code == 201, r.text
    clf = OnnxClassifier(httpx.get(f"{server.url}/snapshots/{r.json()['id']}").content)
    assert clf.metadata["head"] == "softmax"
    _, images = held_out(photos)
    ours = predict(server, images, k=1)["results"]
    theirs = clf.predict([io.BytesIO(i) for i in images], k=1)
    assert [t[0]["label"] for t in theirs] == [m[0]["label"] for m in ours]
    assert np.allclose([t[0]["probability"] for t in theirs], [m[0]["probability"] for m in ours], atol=1e-3)

    cat_shot = photos["cat"][1][0]
    r = httpx.post(f"{server.url}/samples", files=[("image", ("kitten.jpg", cat_shot, "image/jpeg"))],
                   data={"label": "kitten"}, timeout=60)
    assert r.status_code == 201, r.text
    assert wait_trained(server, st["samples_received"] + 1, timeout=600)["serving_head"] == "slda"
    del server.env["ASER_TRAINED_HEAD_FROM"]


def test_the_stream_chooses_the_head_and_status_and_the_snapshot_say_which(server, photos):
    """ASER_HEAD=chosen: each head is scored on every batch before its step; /status gives what each
    measured and which answers each class; the snapshot exports that answer and says so. By default measured on
    held-back samples with the pool as the prior; the stream's scores are still reported."""
    from clients.onnx_client import OnnxClassifier
    from service.learning.lineage import check_learner, describe_learner
    from service.settings import Settings

    with pytest.raises(ValueError, match="ASER_HEAD=chosen"):
        check_learner(Settings(backbone="scratch", head="chosen"))
    def choice_of(**settings):
        spec = describe_learner(Settings(backbone="lite0", device="cpu", **settings), None)
        return spec.head_measure if spec.lineage.head == "chosen" else None, spec.head_prior

    assert choice_of(head="chosen") == ("held-back", "pool")
    assert choice_of(head="chosen", head_prior="none") == ("held-back", None)
    assert choice_of(head="chosen", head_measure="stream") == ("stream", None)
    assert choice_of() == ("held-back", "pool")  # the default sleeps: held-back samples choose a sleep's top
    assert choice_of(sleep=False) == (None, None)  # streaming LDA alone: no choice, no prior
    for settings in ({"head": "chosen", "head_measure": "stream"}, {"head": "slda"}):
        with pytest.raises(ValueError, match="ASER_HEAD_PRIOR"):  # a prior of the choice on held-back samples only
            choice_of(**settings, head_prior="mix")
    server.stop()
    server.env.update(ASER_HEAD="chosen")
    server.start()
    received = status(server)["samples_received"]
    for label in ("cat", "coffee"):  # classes the heads know: scored before the step
        train, _ = photos[label]
        files = [("image", (f"{label}-again{i}.jpg", shot, "image/jpeg")) for i, shot in enumerate(train[:5])]
        r = httpx.post(f"{server.url}/samples", files=files, data={"label": [label] * 5}, timeout=60)
        assert r.status_code == 201, r.text
    st = wait_trained(server, received + 10, timeout=600)
    assert st["serving_head"] == "chosen" and st["config"]["head"] == "chosen"
    assert st["config"]["head_measure"] == "held-back" and st["config"]["head_prior"] == "pool"
    measured = st["head_choice"]
    # no class has sent its 20th sample since the restart: nothing held back yet
    assert measured["measure"] == "held-back" and measured["prior"] == "pool"
    assert measured["held_back"] == {"samples": 0, "accuracy": {}}
    # nothing held back to fit it on yet: its weight on the top applies to no class
    assert measured["pool"] == {"weight": 0.5, "temperature": 1.0, "classes": []}
    assert set(measured["window_accuracy"]) == {"slda", "top", "mix", "pool", "served"}
    assert 0 <= measured["window_accuracy"]["slda"] <= 1 and {"cat", "coffee"} <= set(measured["classes"])
    # too few samples to measure a class yet: the prior answers every one, and a pool that weighs the top on no
    # class answers as streaming LDA
    assert all(c["head"] == "pool" and c["top"] is None for c in measured["classes"].values())
    assert measured["window_accuracy"]["served"] == measured["window_accuracy"]["slda"]

    r = httpx.post(f"{server.url}/snapshots", timeout=300)
    assert r.status_code == 201, r.text
    clf = OnnxClassifier(httpx.get(f"{server.url}/snapshots/{r.json()['id']}").content)
    assert clf.metadata["head"] == "chosen"
    assert json.loads(clf.metadata["head_choice"]) == {label: "pool" for label in clf.labels}
    assert json.loads(clf.metadata["head_pool"]) == {"weight": 0.5, "temperature": 1.0, "classes": []}
    _, images = held_out(photos)
    ours = predict(server, images, k=1)["results"]
    theirs = clf.predict([io.BytesIO(i) for i in images], k=1)
    assert [t[0]["label"] for t in theirs] == [m[0]["label"] for m in ours]
    assert np.allclose([t[0]["probability"] for t in theirs], [m[0]["probability"] for m in ours], atol=1e-3)
    del server.env["ASER_HEAD"]
