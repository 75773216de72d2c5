"""DELETE /classes/{label} on a real uvicorn server with real CIFAR-10 images: nothing of the
class is left (log rows, memory rows and slots, head output, snapshot labels), also after a
SIGKILL right after the call; the label sent again is a new class."""

import json
import sqlite3

import httpx
import onnx
import pytest

from clients.api import ServiceClient
from clients.bench.live.local_service import real_jpegs

from .conftest import CIFAR10_ZIP
from .test_online import wait_trained
from .test_service import Server

CLASSES = ["airplane", "frog", "cat"]


def rows(server, sql, *args):
    with sqlite3.connect(f"file:{server.data_dir / 'aser.db'}?mode=ro", uri=True) as conn:
        return conn.execute(sql, args).fetchall()


def assert_forgotten(server, client, label, test_images):
    (class_id,) = rows(server, "SELECT id FROM classes WHERE name = ? AND forgotten IS NOT NULL", label)[0]
    assert rows(server, "SELECT COUNT(*) FROM samples WHERE class_id = ?", class_id) == [(0,)]
    assert rows(server, "SELECT COUNT(*) FROM buffer WHERE class_id = ?", class_id) == [(0,)]
    st = client.status()
    assert label not in st["classes"] and label not in st["buffer"] and label not in st["online"]["per_class"]
    memory = httpx.get(server.url + "/memory").json()
    assert label not in memory["per_class"] and all(s["label"] != label for s in memory["slots"])
    answers = client.predict(test_images, k=5)["results"]
    assert all(r["label"] != label for top in answers for r in top)
    assert all(label not in p["memory"] and label not in p["per_class"]
               for p in httpx.get(server.url + "/history").json())
    for snap in client.snapshots():
        assert label not in snap["classes"]
        model = onnx.load_from_string(client.download_snapshot(snap["id"]))
        labels = json.loads({p.key: p.value for p in model.metadata_props}["labels"])
        assert labels == snap["classes"] and label not in labels


def wait_idle(client, timeout=120):
    """Until every acknowledged sample is trained (samples_trained counts the lineage, forgotten
    samples included, so the log position tells instead)."""
    import time

    deadline = time.time() + timeout
    while (st := client.status())["trained_upto"] < st["samples_received"] or st["backlog"]:
        assert time.time() < deadline, st
        time.sleep(0.2)


@pytest.fixture()
def server(tmp_path):
    s = Server(tmp_path / "svc", method="er", mem_size=60, checkpoint_every_steps=5, snapshot_every_steps=4,
               history_every_steps=3).start()
    yield s
    s.stop()


def test_forgetting_a_class_leaves_nothing_of_it_even_after_a_kill(server):
    samples = real_jpegs(CIFAR10_ZIP, 300, classes=CLASSES)
    test_images = [data for _, data in real_jpegs(CIFAR10_ZIP, 30, split="test", classes=CLASSES)]
    with ServiceClient(server.url) as client:
        client.stream_samples(samples)
        wait_trained(client, 300)
        client.create_snapshot()
        assert any("frog" in s["classes"] for s in client.snapshots())

        answer = httpx.delete(server.url + "/classes/frog").json()
        assert answer["label"] == "frog" and answer["samples_removed"] == 100 and answer["memory_removed"] > 0
        assert_forgotten(server, client, "frog", test_images)
        assert httpx.delete(server.url + "/classes/frog").status_code == 404  # already gone
        assert httpx.delete(server.url + "/classes/unicorn").json()["error"] == "not_found"

        # a SIGKILL right after the answer: the restart must not bring the class back
        assert httpx.delete(server.url + "/classes/cat").status_code == 200
        server.kill()
        server.start()
        assert_forgotten(server, client, "cat", test_images)
        assert_forgotten(server, client, "frog", test_images)
        assert client.status()["classes"] == ["airplane"]

        # frog sent again: a new class, learned from scratch, exported again
        client.stream_samples(real_jpegs(CIFAR10_ZIP, 40, classes=["frog", "airplane"]))
        wait_idle(client)
        st = client.status()
        assert st["classes"] == ["airplane", "frog"]
        ids = rows(server, "SELECT id, forgotten IS NULL FROM classes WHERE name = 'frog' ORDER BY id")
        assert len(ids) == 2 and ids[0][1] == 0 and ids[1][1] == 1 and ids[1][0] > ids[0][0]


def test_a_checkpoint_from_before_the_forgetting_restores_without_the_class(tmp_path, cifar10_slice):
    """The crash window between the forgetting's commit and the next checkpoint: the checkpoint
    on disk still has the class's slots in its file's metadata; its memory rows are gone."""
    import torch

    from learner import make_learner
    from learner.data import task_batches
    from service.storage.checkpoints import CheckpointStore
    from service.storage.db import Database
    from service.storage.store import IngestLog, NewSample

    db = Database(tmp_path / "aser.db")
    log, checkpoints = IngestLog(db, (3, 32, 32)), CheckpointStore(db, tmp_path / "checkpoints")
    log.append([NewSample(label, b"\0" * 3072) for label in ("a", "b", "c")], max_classes=10)
    learner = make_learner("er", num_classes=3, mem_size=40, seed=0)
    for x, y in task_batches(cifar10_slice, [0, 1, 2], 10, torch.Generator().manual_seed(0)):
        learner.observe(x, y)
        if learner.steps == 8:
            break
    checkpoints.save(learner, trained_upto=3)
    kept = learner.buffer.labels[:40] != 1

    forgotten = log.forget("b", also=checkpoints.forget_rows)
    assert (forgotten.class_id, forgotten.samples_removed) == (1, 1) and log.classes() == ["a", None, "c"]
    restored = make_learner("er", num_classes=3, mem_size=40, seed=0)
    assert checkpoints.restore(restored)[0] == 3
    assert torch.equal(restored.buffer.labels[: len(restored.buffer)], learner.buffer.labels[:40][kept])
    assert torch.equal(restored.buffer.entered[: len(restored.buffer)], learner.buffer.entered[:40][kept])
    assert restored.forget_class(1) == 0 and 1 not in restored.predict(learner.buffer.images[:40]).tolist()
    # the label is free again: it comes back as a new class
    log.append([NewSample("b", b"\1" * 3072)], max_classes=10)
    assert log.classes() == ["a", None, "c", "b"]
    db.close()
