"""The service as a real uvicorn process on a loopback port, with a temporary data directory."""

from __future__ import annotations

import base64
import io
import json
import os
import subprocess
import sys
import time

import httpx
import pytest
from PIL import Image

import service
from clients.bench.live.local_service import LocalService

from .conftest import ROOT


class Server(LocalService):
    """The service (or the replica) on a free loopback port, with small test defaults: the from-scratch
    backbone on 32x32 pixels, whose steps cost a CI machine least (the service's behaviour does not depend
    on the backbone; tests/test_service_pretrained.py and scripts/test-deploy.sh run the default one)."""

    def __init__(self, data_dir, module="service", ready_path="/readyz", **env):
        python_path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))  # keep what is there
        super().__init__(data_dir, {"ASER_MAX_BATCH_WAIT_S": "0.3", "ASER_MEM_SIZE": "50", "PYTHONPATH": python_path,
                                    "ASER_BACKBONE": "scratch",
                                    **{f"ASER_{k.upper()}": str(v) for k, v in env.items()}},
                         module=module, ready_path=ready_path)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("svc")).start()
    yield s
    s.stop()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def status(server):
    return httpx.get(f"{server.url}/status").json()


def wait_trained(server, n, timeout=180):
    """Until n samples are trained on and the served model carries the corrections of that step."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        st = status(server)
        if st["samples_trained"] >= n and st["serving_current"]:
            return st
        time.sleep(0.2)
    raise AssertionError(f"only {status(server)['samples_trained']} of {n} trained")


def png(size=(32, 32), mode="RGB", fmt="PNG"):
    buf = io.BytesIO()
    Image.new(mode, size).save(buf, fmt)
    return buf.getvalue()


def test_ingest_train_and_predict(server, jpegs):
    r = httpx.post(f"{server.url}/samples", json={"samples": [{"label": lab, "image": b64(img)} for lab, img in jpegs[:30]]})
    assert r.status_code == 201 and r.json()["accepted"] == 30
    files = [("image", (f"{i}.jpg", img, "image/jpeg")) for i, (_, img) in enumerate(jpegs[30:])]
    r = httpx.post(f"{server.url}/samples", files=files, data={"label": [lab for lab, _ in jpegs[30:]]})
    assert r.status_code == 201 and r.json()["accepted"] == 10
    r = httpx.post(f"{server.url}/samples", json={"label": "frog", "image": b64(jpegs[-1][1])})
    assert r.status_code == 201 and r.json()["last_seq"] == 41
    st = wait_trained(server, 41)
    assert st["classes"] == ["airplane", "frog"] and st["samples_received"] == 41 and st["backlog"] == 0
    assert st["buffer_size"] == 41 and set(st["buffer"]) == {"airplane", "frog"}

    image = base64.urlsafe_b64encode(jpegs[0][1]).decode().rstrip("=")
    r = httpx.get(f"{server.url}/predict", params={"image": image, "k": 5})
    assert r.status_code == 200
    top = r.json()["top"]
    assert {t["label"] for t in top} == {"airplane", "frog"} and abs(sum(t["probability"] for t in top) - 1) < 1e-4
    assert r.json()["model_version"] >= 1
    r = httpx.post(f"{server.url}/predict", json={"images": [b64(img) for _, img in jpegs[:4]], "k": 1})
    assert r.status_code == 200 and len(r.json()["results"]) == 4 and len(r.json()["results"][0]) == 1
    r = httpx.post(f"{server.url}/predict", files=[("image", ("a.jpg", jpegs[0][1], "image/jpeg"))])
    assert r.status_code == 200 and len(r.json()["results"]) == 1


BAD_REQUESTS = {
    "corrupt image": (dict(json={"label": "x", "image": b64(b"not an image at all")}), 422, "corrupt_image"),
    "truncated jpeg": (None, 422, "corrupt_image"),
    "wrong mode": (dict(json={"label": "x", "image": b64(png(mode="CMYK", fmt="JPEG"))}), 422, "unsupported_mode"),
    "gif": (dict(json={"label": "x", "image": b64(png(fmt="GIF"))}), 415, "unsupported_format"),
    "bad base64": (dict(json={"label": "x", "image": "%%%"}), 422, "invalid_base64"),
    "missing label": (dict(json={"image": b64(png())}), 422, "invalid_request"),
    "empty label": (dict(json={"label": "  ", "image": b64(png())}), 422, "invalid_request"),
    "long label": (dict(json={"label": "x" * 101, "image": b64(png())}), 422, "invalid_request"),
    "number label": (dict(json={"label": 7, "image": b64(png())}), 422, "invalid_request"),
    "control chars": (dict(json={"label": "a\x00b", "image": b64(png())}), 422, "invalid_request"),
    "empty body": (dict(content=b"", headers={"content-type": "application/json"}), 400, "empty_body"),
    "bad json": (dict(content=b"{", headers={"content-type": "application/json"}), 400, "invalid_json"),
    "empty list": (dict(json={"samples": []}), 422, "invalid_request"),
    "unknown field": (dict(json={"label": "x", "image": b64(png()), "colour": "red"}), 422, "invalid_request"),
    "padded label": (dict(json={"label": " x", "image": b64(png())}), 422, "invalid_request"),
    "bad sample id": (dict(json={"label": "x", "image": b64(png()), "id": "a b"}), 422, "invalid_request"),
    "deeply nested": (dict(content=b"[" * 5000, headers={"content-type": "application/json"}), 400, "invalid_json"),
    "text body": (dict(content=b"hello", headers={"content-type": "text/plain"}), 415, "unsupported_media_type"),
    "huge body": (dict(content=b"0" * (17 * 1024 * 1024), headers={"content-type": "application/json"}), 413,
                  "body_too_large"),
    "label count": (dict(files=[("image", ("a.png", png(), "image/png"))] * 2, data={"label": ["a", "b", "c"]}), 422,
                    "invalid_request"),
    "one bad of two": (dict(json={"samples": [{"label": "ok", "image": b64(png())},
                                              {"label": "bad", "image": b64(b"GIF89a")}]}), 422, "corrupt_image"),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_input_is_refused_and_changes_nothing(server, jpegs, case):
    kwargs, code, error = BAD_REQUESTS[case]
    if case == "truncated jpeg":
        kwargs = dict(json={"label": "x", "image": b64(jpegs[0][1][: len(jpegs[0][1]) // 2])})
    before = status(server)
    r = httpx.post(f"{server.url}/samples", timeout=30, **kwargs)
    assert r.status_code == code and r.json()["error"] == error, r.text
    after = status(server)
    assert after["samples_received"] == before["samples_received"] and after["classes"] == before["classes"]


def test_bad_predict_requests(server):
    assert httpx.get(f"{server.url}/predict").status_code == 422
    r = httpx.get(f"{server.url}/predict", params={"image": base64.urlsafe_b64encode(b"not an image").decode()})
    assert r.status_code == 422 and r.json()["error"] == "corrupt_image"
    r = httpx.post(f"{server.url}/predict", json={"images": []})
    assert r.status_code == 422


def test_tokens_guard_writes_and_reads(tmp_path, jpegs):
    s = Server(tmp_path, write_token="w-secret", read_token="r-secret").start()
    try:
        body = {"label": "airplane", "image": b64(jpegs[0][1])}
        assert httpx.post(f"{s.url}/samples", json=body).status_code == 401
        assert httpx.post(f"{s.url}/samples", json=body, headers={"Authorization": "Bearer r-secret"}).status_code == 403
        assert httpx.post(f"{s.url}/samples", json=body, headers={"Authorization": "Bearer wrong"}).status_code == 403
        assert httpx.get(f"{s.url}/status", headers={"Authorization": "Bearer r-secret"}).json()["samples_received"] == 0
        r = httpx.post(f"{s.url}/samples", json=body, headers={"Authorization": "Bearer w-secret"})
        assert r.status_code == 201
        assert httpx.get(f"{s.url}/status").status_code == 401
        assert httpx.get(f"{s.url}/healthz").status_code == 200
    finally:
        s.stop()


def test_refuses_public_bind_without_token(tmp_path):
    env = {**os.environ, "ASER_DATA_DIR": str(tmp_path), "ASER_HOST": "0.0.0.0", "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-m", "service"], env=env, cwd=ROOT, capture_output=True, timeout=60)
    assert r.returncode == 2 and b"refusing" in r.stderr


def buffer_rows_by_class(data_dir) -> dict[str, int]:
    import sqlite3

    with sqlite3.connect(data_dir / "aser.db") as conn:
        rows = conn.execute("SELECT c.name, COUNT(*) FROM buffer b JOIN classes c ON c.id = b.class_id "
                            "GROUP BY c.name").fetchall()
    return dict(rows)


# the service's default (the class-balanced KNN-SV memory under the stronger learner's options), and the previous
# default's ASER update (sv-upd + ACE + EMA), which data directories made before it go on with
METHODS = [{}, {"method": "sv-upd"}]


@pytest.mark.parametrize("settings", METHODS, ids=["default", "sv-upd"])
def test_graceful_restart_resumes_the_same_model(tmp_path, jpegs, settings):
    s = Server(tmp_path, batch_size=5, **settings).start()
    try:
        r = httpx.post(f"{s.url}/samples", json={"samples": [{"label": lab, "image": b64(img)} for lab, img in jpegs[:25]]})
        assert r.status_code == 201
        before = wait_trained(s, 25)
        probe = {"images": [b64(img) for _, img in jpegs[25:30]], "k": 2}
        answer = httpx.post(f"{s.url}/predict", json=probe).json()
    finally:
        s.stop()  # SIGTERM: the worker checkpoints on the way out
    assert buffer_rows_by_class(tmp_path) == before["buffer"]
    s.start()
    try:
        after = status(s)
        for key in ("samples_trained", "trained_upto", "steps", "buffer", "classes"):
            assert after[key] == before[key], key
        again = httpx.post(f"{s.url}/predict", json=probe).json()
        assert again["results"] == answer["results"]
    finally:
        s.stop()


@pytest.mark.parametrize("settings", METHODS, ids=["default", "sv-upd"])
def test_sigkill_loses_no_acknowledged_sample(tmp_path, jpegs, settings):
    """Stream samples, SIGKILL the process at random moments, restart each time: every
    acknowledged sample is trained on exactly once in the lineage (the count trained equals
    the count acknowledged and training reached the last sequence number, in order), and the
    buffer rows in SQLite match the buffer the restarted learner holds."""
    import random

    rng = random.Random(0)
    s = Server(tmp_path, batch_size=4, checkpoint_every_steps=2, **settings)
    acked, served = 0, 0
    for _ in range(4):
        s.start()
        assert status(s)["samples_received"] == acked
        assert served == 0 or status(s)["model_version"] > served  # no trained model's number served again
        deadline = time.time() + rng.uniform(0.5, 2.0)
        while time.time() < deadline:
            lab, img = jpegs[acked % len(jpegs)]
            r = httpx.post(f"{s.url}/samples", json={"samples": [{"label": lab, "image": b64(img)}] * 3})
            assert r.status_code == 201
            acked += 3
        served = status(s)["model_version"]
        s.kill()
    s.start()
    try:
        st = wait_trained(s, acked)
        assert st["samples_received"] == acked and st["samples_trained"] == acked and st["trained_upto"] == acked
        assert st["backlog"] == 0
        assert st["method"] == settings.get("method", "cb-sv-duel") and st["buffer_size"] == 50  # full: evictions ran
        if not settings:  # the class-balanced memory: two classes streamed alike hold equal shares, within one slot
            assert max(st["buffer"].values()) - min(st["buffer"].values()) <= 1, st["buffer"]
    finally:
        s.stop()
    assert buffer_rows_by_class(tmp_path) == st["buffer"]


def test_python_client_covers_the_endpoints(server, jpegs):
    from clients.api import ServiceClient, ServiceError

    with ServiceClient(server.url) as client:
        assert client.healthy() and client.ready()
        before = client.status()["samples_received"]
        assert client.add_samples(["airplane", "frog"], [jpegs[1][1], jpegs[-2][1]])["accepted"] == 2
        assert client.add_files("airplane", [jpegs[2][1], jpegs[3][1]], "image/jpeg")["accepted"] == 2
        assert client.status()["samples_received"] == before + 4
        answer = client.predict([jpegs[1][1], jpegs[-2][1]], k=2)
        assert len(answer["results"]) == 2 and {t["label"] for t in answer["results"][0]} <= {"airplane", "frog"}
        assert client.predict_one(jpegs[1][1], k=1)["top"][0]["label"] in {"airplane", "frog"}
        with pytest.raises(ServiceError) as err:
            client.add_samples(["frog"], [b"junk"])
        assert err.value.status == 422 and err.value.error == "corrupt_image"


def test_metrics_in_prometheus_format(server, jpegs):
    for image in (jpegs[4][1], jpegs[5][1]):  # two steps at least: the second replays from the memory
        httpx.post(f"{server.url}/samples", json={"label": "airplane", "image": b64(image)})
        wait_trained(server, status(server)["samples_received"])
    httpx.post(f"{server.url}/samples", json={"label": "airplane", "image": b64(b"junk")})
    httpx.get(f"{server.url}/predict", params={"image": base64.urlsafe_b64encode(jpegs[4][1]).decode()})
    wait_trained(server, status(server)["samples_received"])
    text = httpx.get(f"{server.url}/metrics").text
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
              if line and not line.startswith("#")}
    assert values["aser_samples_received_total"] >= 1
    assert values['aser_requests_rejected_total{error="corrupt_image"}'] >= 1
    assert values["aser_train_step_seconds_count"] >= 1 and values["aser_predict_seconds_count"] >= 1
    assert values["aser_backlog_samples"] == 0 and values["aser_model_version"] >= 1
    assert 0 <= values["aser_samples_replayed_incoming_class_total"] <= values["aser_samples_replayed_total"]
    assert values["aser_samples_replayed_total"] >= 1
    # the standard process metrics: memory, CPU, open files
    assert values["process_resident_memory_bytes"] > 10e6 and values["process_open_fds"] > 0
    assert values["process_cpu_seconds_total"] > 0


def test_k_as_a_multipart_field_and_the_health_schemas(server, jpegs):
    files = [("image", ("a.jpg", jpegs[0][1], "image/jpeg"))]
    r = httpx.post(f"{server.url}/predict", files=files, data={"k": "1"})
    assert r.status_code == 200 and len(r.json()["results"][0]) == 1
    r = httpx.post(f"{server.url}/predict", files=files, data={"k": "many"})
    assert r.status_code == 422 and r.json()["error"] == "invalid_request"
    doc = httpx.get(f"{server.url}/openapi.json").json()
    for path in ("/healthz", "/readyz"):
        schema = doc["paths"][path]["get"]["responses"]["200"]["content"]["application/json"]["schema"]
        assert schema == {"$ref": "#/components/schemas/Health"}
    assert "status" in doc["components"]["schemas"]["Health"]["properties"]


def test_streaming_ingest_acknowledges_each_message(server, jpegs):
    from clients.api import ServiceClient

    with ServiceClient(server.url) as client:
        before = client.status()["samples_received"]
        samples = [(lab, img) for lab, img in jpegs[:6]] + [("frog", b"junk")] + [(lab, img) for lab, img in jpegs[-3:]]
        acks = client.stream_samples(samples)
        assert [a["message"] for a in acks] == list(range(1, 11))
        assert [a.get("error") for a in acks] == [None] * 6 + ["corrupt_image"] + [None] * 3
        seqs = [a["first_seq"] for a in acks if "error" not in a]
        assert seqs == list(range(before + 1, before + 10)) and acks[6]["status"] == 422
        assert client.status()["samples_received"] == before + 9

        with client.websocket() as ws:
            ack = ws.send(["airplane", "frog"], [jpegs[7][1], jpegs[-4][1]])
            assert ack == {"message": 1, "accepted": 2, "stored": 2, "duplicates": 0, "first_seq": before + 10,
                           "last_seq": before + 11, "seqs": [before + 10, before + 11]}
            bad = ws.send(["airplane"], [jpegs[7][1][:100]])
            assert bad["error"] == "corrupt_image" and bad["status"] == 422
            acks = list(ws.pipeline([(["frog"], [img]) for _, img in jpegs[-8:-4]], window=3))
            assert [a["message"] for a in acks] == [3, 4, 5, 6] and acks[-1]["last_seq"] == before + 15
        assert client.status()["samples_received"] == before + 15

    # a malformed or oversized line is refused alone; the stream goes on
    lines = b'{"label": "frog"}\n' + b"x" * (17 * 1024 * 1024) + b"\n" + \
        (json.dumps({"label": "frog", "image": b64(jpegs[-1][1])}) + "\n").encode()
    r = httpx.post(f"{server.url}/samples/stream", content=lines, headers={"content-type": "application/x-ndjson"},
                   timeout=60)
    acks = [json.loads(line) for line in r.text.splitlines()]
    assert [a.get("error") for a in acks] == ["invalid_request", "body_too_large", None]
    assert status(server)["samples_received"] == before + 16
    r = httpx.post(f"{server.url}/samples/stream", content=b"{}", headers={"content-type": "text/plain"})
    assert r.status_code == 415


def test_onnx_snapshot_matches_the_service(server, jpegs):
    """POST /snapshots, list, download; onnxruntime on the file answers as /predict does."""
    import numpy as np

    from clients.onnx_client import OnnxClassifier

    st = wait_trained(server, status(server)["samples_received"])
    r = httpx.post(f"{server.url}/snapshots", timeout=180)
    assert r.status_code == 201, r.text
    snap = r.json()
    assert snap["model_version"] == st["model_version"] and snap["classes"] == st["classes"]
    assert snap["id"] in [s["id"] for s in httpx.get(f"{server.url}/snapshots").json()["snapshots"]]
    r = httpx.get(f"{server.url}/snapshots/{snap['id']}")
    assert r.status_code == 200 and r.headers["x-model-version"] == str(snap["model_version"])
    assert httpx.get(f"{server.url}/snapshots/latest").content == r.content

    clf = OnnxClassifier(r.content)
    assert clf.labels == st["classes"] and clf.input_shape == (3, 32, 32) and clf.model_version == snap["model_version"]
    assert "uint8" in clf.metadata["preprocessing"]
    assert clf.metadata["service_version"] == service.__version__  # the version of the package and /openapi.json
    images = [img for _, img in jpegs[::4]]
    answer = httpx.post(f"{server.url}/predict", json={"images": [b64(i) for i in images], "k": 2}).json()
    assert answer["model_version"] == snap["model_version"]
    onnx_top = clf.predict([io.BytesIO(i) for i in images], k=2)
    for ours, theirs in zip(onnx_top, answer["results"]):
        assert [t["label"] for t in ours] == [t["label"] for t in theirs]
        assert np.allclose([t["probability"] for t in ours], [t["probability"] for t in theirs], atol=1e-4)

    assert httpx.get(f"{server.url}/snapshots/abc").status_code == 422
    assert httpx.get(f"{server.url}/snapshots/99999").json()["error"] == "not_found"


def test_snapshot_needs_a_class_and_the_admin_token(tmp_path, jpegs):
    s = Server(tmp_path, write_token="w", admin_token="a").start()
    try:
        admin = {"Authorization": "Bearer a"}
        r = httpx.post(f"{s.url}/snapshots", headers=admin)
        assert r.status_code == 409 and r.json()["error"] == "no_classes"
        assert httpx.post(f"{s.url}/snapshots", headers={"Authorization": "Bearer w"}).status_code == 403
        assert httpx.get(f"{s.url}/snapshots", headers=admin).json() == {"snapshots": []}
        from websockets.exceptions import InvalidStatus

        from clients.api import ServiceClient

        with pytest.raises(InvalidStatus):
            ServiceClient(s.url, token="wrong").websocket()
        with ServiceClient(s.url, token="w").websocket() as ws:
            assert ws.send(["airplane"], [jpegs[0][1]])["accepted"] == 1
    finally:
        s.stop()


def test_inference_replica_serves_the_latest_snapshot(tmp_path, jpegs):
    # the learner also runs its memory policies on bf16 features (a full memory of 20 engages them)
    learner = Server(tmp_path / "learner", snapshot_every_steps=0, latent_bf16="true", mem_size=20).start()
    replica = Server(tmp_path / "replica", module="service.replica", ready_path="/healthz",
                     replica_source=learner.url, replica_poll_s=0.3).start()
    try:
        assert httpx.get(f"{replica.url}/readyz").status_code == 503  # no snapshot yet
        r = httpx.get(f"{replica.url}/predict", params={"image": b64(jpegs[0][1])})
        assert r.status_code == 503 and r.json()["error"] == "no_snapshot"
        httpx.post(f"{learner.url}/samples", json={"samples": [{"label": lab, "image": b64(img)} for lab, img in jpegs]})
        assert wait_trained(learner, len(jpegs))["buffer_size"] == 20
        first = httpx.post(f"{learner.url}/snapshots", timeout=180).json()
        deadline = time.time() + 30
        while httpx.get(f"{replica.url}/readyz").status_code != 200 and time.time() < deadline:
            time.sleep(0.2)
        probe = {"images": [b64(img) for _, img in jpegs[::5]], "k": 2}
        theirs = httpx.post(f"{learner.url}/predict", json=probe).json()
        ours = httpx.post(f"{replica.url}/predict", json=probe).json()
        assert ours["snapshot_id"] == first["id"] and ours["model_version"] == theirs["model_version"]
        for a, b in zip(ours["results"], theirs["results"]):
            assert [t["label"] for t in a] == [t["label"] for t in b]
            assert all(abs(x["probability"] - y["probability"]) < 1e-4 for x, y in zip(a, b))
        bad = httpx.post(f"{replica.url}/predict", json={"images": [b64(b"junk")]})
        assert bad.status_code == 422 and bad.json()["error"] == "corrupt_image"

        # the learner trains on and exports again: the replica swaps to the newer snapshot
        httpx.post(f"{learner.url}/samples", json={"samples": [{"label": "ship", "image": b64(jpegs[3][1])}] * 10})
        wait_trained(learner, len(jpegs) + 10)
        second = httpx.post(f"{learner.url}/snapshots", timeout=180).json()
        deadline = time.time() + 30
        while httpx.get(f"{replica.url}/status").json()["snapshot_id"] != second["id"] and time.time() < deadline:
            time.sleep(0.2)
        st = httpx.get(f"{replica.url}/status").json()
        assert st["snapshot_id"] == second["id"] and "ship" in st["classes"]
    finally:
        replica.stop()
        learner.stop()


def test_status_is_never_torn_between_the_model_and_the_memory(tmp_path, jpegs):
    """While a stream trains, every /status shows the memory of the model it reports: the memory
    never holds more samples than that model has seen (trained or skipped)."""
    import threading

    s = Server(tmp_path, batch_size=2, max_batch_wait_s=0.05).start()
    try:
        done = threading.Event()

        def send():
            for i in range(0, 40, 2):
                httpx.post(f"{s.url}/samples", json={"samples": [{"label": lab, "image": b64(img)}
                                                                  for lab, img in jpegs[i:i + 2]]})
            done.set()

        threading.Thread(target=send, daemon=True).start()
        polls = 0
        while not done.is_set() or polls < 50:
            st = status(s)
            assert st["buffer_size"] <= st["samples_trained"] + st["lag"]["samples_skipped"], st
            polls += 1
            if polls > 2000:
                break
        assert polls >= 50
    finally:
        s.stop()


def test_a_service_without_sleep_refuses_one_and_shows_none(server):
    r = httpx.post(f"{server.url}/sleep")
    assert r.status_code == 409 and r.json()["error"] == "sleep_off"
    assert status(server)["sleep"] is None
