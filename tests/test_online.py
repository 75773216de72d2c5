"""Online (test-then-train) accuracy, the history and the memory API, on a real uvicorn server
streaming real CIFAR-10 images."""

import io

import httpx
import pytest
from PIL import Image

from clients.api import ServiceClient
from clients.bench.live.local_service import real_jpegs

from .conftest import CIFAR10_ZIP
from .test_service import Server

N_PER_CLASS = 300


def two_classes(n=N_PER_CLASS):
    """n real training JPEGs of airplanes and of frogs, interleaved: (label, bytes)."""
    return real_jpegs(CIFAR10_ZIP, 2 * n, classes=["airplane", "frog"])


def wait_trained(client, n, timeout=300):
    import time

    deadline = time.time() + timeout
    while time.time() < deadline:
        st = client.status()
        if st["samples_trained"] >= n and st["serving_current"]:
            return st
        time.sleep(0.2)
    raise AssertionError(f"trained {st['samples_trained']} of {n} samples in {timeout}s")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """An ER service that has trained on 600 airplane/frog images, history every 5 steps. However far behind a
    loaded machine leaves the worker, every step is a full one (lean steps once left the last 200 at 0.59) and the
    served copy, which scores each batch before its step, is corrected after every step: with the default 50
    (the stream ahead of the worker, it is never idle to catch up), CI scored the last 200 with a copy up to 50
    steps old, 0.575; corrected every step they scored 0.88-0.895 here, loaded."""
    server = Server(tmp_path_factory.mktemp("online"), method="er", mem_size=100, history_every_steps=5,
                    online_window=200, checkpoint_every_steps=7, lean_when_behind=False,
                    serving_refresh_steps=1).start()
    client = ServiceClient(server.url)
    samples = two_classes()
    client.stream_samples(samples)
    st = wait_trained(client, len(samples))
    yield server, client, st
    client.close()
    server.stop()


def test_online_accuracy_rises_above_chance_and_per_class_adds_up(trained):
    _, client, st = trained
    online = st["online"]
    # everything before the first step is new to the head, and so is a class's first sample
    # after it if the first batch lacked that class (batches of 10, classes interleaved)
    assert 2 <= online["new_class_samples"] <= 20
    assert online["samples_scored"] + online["new_class_samples"] == 2 * N_PER_CLASS
    assert set(online["per_class"]) == {"airplane", "frog"}
    per_class = online["per_class"].values()
    assert sum(c["samples"] for c in per_class) == online["samples_scored"]
    correct = sum(round(c["accuracy"] * c["samples"]) for c in per_class)
    assert correct == round(online["accuracy"] * online["samples_scored"])
    # two classes: chance is 50%; airplane vs frog is learned within a few hundred images
    assert online["window_accuracy"] > 0.6, online
    assert online["window"] == 200

    metrics = client.metrics()
    assert 'aser_online_class_accuracy{class_label="frog"}' in metrics
    assert f"aser_online_window_accuracy {online['window_accuracy']}" in metrics


def test_history_is_a_forward_series_that_survives_a_restart(trained):
    server, client, st = trained
    points = httpx.get(f"{server.url}/history").json()
    assert [p["steps"] for p in points] == list(range(5, st["steps"] + 1, 5))
    assert all(a["samples_trained"] < b["samples_trained"] for a, b in zip(points, points[1:]))
    last = points[-1]
    assert set(last["memory"]) == {"airplane", "frog"} and sum(last["memory"].values()) == 100
    assert last["received"] == 2 * N_PER_CLASS and last["step_ms"] > 0 and last["loss"] > 0
    # interleaved classes: ER's random replay draws mostly the classes of the incoming batch
    shares = [p["replayed_incoming_share"] for p in points]
    assert all(0 <= s <= 100 for s in shares) and sum(shares) / len(shares) > 75
    page = httpx.get(f"{server.url}/history", params={"since": points[2]["samples_trained"], "limit": 3}).json()
    assert page == points[3:6]
    assert httpx.get(f"{server.url}/history", params={"limit": 0}).status_code == 422

    server.kill()  # the last checkpoint (every 7 steps) is older than the last point
    server.start()
    assert httpx.get(f"{server.url}/history").json() == points
    restarted = client.status()["online"]
    assert restarted["samples_scored"] <= st["online"]["samples_scored"]
    # more samples: the series goes on from where it was, never behind
    client.stream_samples(two_classes(N_PER_CLASS + 50)[2 * N_PER_CLASS:])
    wait_trained(client, 2 * N_PER_CLASS + 100)
    after = httpx.get(f"{server.url}/history").json()
    assert after[: len(points)] == points and len(after) > len(points)
    assert all(a["samples_trained"] < b["samples_trained"] for a, b in zip(after, after[1:]))


def test_a_history_of_an_earlier_version_gains_the_replay_share(tmp_path):
    """A database written before the replay share existed: its points read back without it, and
    new points carry it."""
    import sqlite3

    from service.learning.online import History, HistoryPoint
    from service.storage.db import Database

    old = sqlite3.connect(tmp_path / "aser.db")
    old.execute("CREATE TABLE history (samples_trained INTEGER PRIMARY KEY, steps INTEGER NOT NULL, at REAL NOT NULL,"
                " accuracy REAL, window_accuracy REAL, new_class_samples INTEGER NOT NULL, loss REAL, step_ms REAL NOT"
                " NULL, received INTEGER NOT NULL, backlog INTEGER NOT NULL, per_class TEXT NOT NULL, memory TEXT NOT NULL)")
    old.execute("INSERT INTO history VALUES (10, 1, 0.0, NULL, NULL, 10, 2.3, 5.0, 10, 0, '{}', '{\"frog\": 10}')")
    old.commit()
    old.close()
    history = History(Database(tmp_path / "aser.db"))
    point = HistoryPoint(samples_trained=20, steps=2, at=1.0, accuracy=0.5, window_accuracy=0.5, new_class_samples=10,
                         loss=2.0, step_ms=5.0, received=20, backlog=0, per_class={}, memory={"frog": 20},
                         replayed_incoming_share=40.0)
    assert history.add(point)
    before, after = history.since(0, 10)
    assert before.replayed_incoming_share is None and before.memory == {"frog": 10} and after == point


def test_memory_lists_its_slots_and_serves_their_images(trained):
    server, client, _ = trained
    memory = httpx.get(f"{server.url}/memory").json()
    assert memory["capacity"] == 100 and memory["size"] == 100
    assert sum(memory["per_class"].values()) == 100 and set(memory["per_class"]) == {"airplane", "frog"}
    slots = memory["slots"]
    assert [s["slot"] for s in slots] == list(range(100))
    assert all(0 <= s["entered"] <= client.status()["samples_trained"] for s in slots)
    png = httpx.get(f"{server.url}/memory/{slots[0]['slot']}")
    assert png.status_code == 200 and png.headers["content-type"] == "image/png"
    image = Image.open(io.BytesIO(png.content))
    assert image.size == (32, 32) and image.mode == "RGB"
    for bad in ("100", "-1", "x", "99999999999999999999999"):
        r = httpx.get(f"{server.url}/memory/{bad}")
        assert r.status_code in (404, 422) and "error" in r.json(), bad
