"""Months unattended: a full disk, clients that stall or vanish, labels that look alike, one
answer per rule, one version, counters that are counters. Real uvicorn servers on loopback,
real CIFAR-10 JPEGs, a real (tmpfs) filesystem that fills up."""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import re
import socket
import subprocess
import time
import unicodedata

import httpx
import pytest

import service
from service.storage.durable import write_durably

from .test_service import Server, b64, status, wait_trained

TIMEOUT = 60  # what the server may take on a busy machine (a step, a commit under load)


def post_samples(server, samples, **kw):
    body = {"samples": [{"label": label, "image": b64(img)} for label, img in samples]}
    return httpx.post(f"{server.url}/samples", json=body, timeout=TIMEOUT, **kw)


def stream_acks(server, lines: list[dict]) -> list[dict]:
    body = "".join(json.dumps(line) + "\n" for line in lines).encode()
    r = httpx.post(f"{server.url}/samples/stream", content=body, timeout=TIMEOUT,
                   headers={"content-type": "application/x-ndjson"})
    return [json.loads(x) for x in r.text.splitlines()]


def ws_ack(server, message: dict) -> dict:
    from websockets.sync.client import connect

    with connect(server.url.replace("http", "ws") + "/samples/ws", open_timeout=TIMEOUT) as ws:
        ws.send(json.dumps(message))
        return json.loads(ws.recv(timeout=TIMEOUT))


@pytest.fixture(scope="module")
def strict_server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("svc"), max_classes=2, max_samples_per_request=3, max_predict_images=3,
               header_timeout_s=1, body_timeout_s=1).start()
    yield s
    s.stop()


def test_a_forgotten_class_no_longer_counts_against_the_limit(strict_server, jpegs):
    airplane, frog = jpegs[0][1], jpegs[-1][1]
    assert post_samples(strict_server, [("a", airplane), ("b", frog)]).status_code == 201
    refused = post_samples(strict_server, [("c", airplane)])
    assert refused.status_code == 409 and refused.json()["error"] == "too_many_classes"
    assert httpx.delete(f"{strict_server.url}/classes/a", timeout=TIMEOUT).status_code == 200
    assert post_samples(strict_server, [("c", airplane)]).status_code == 201
    assert sorted(status(strict_server)["classes"]) == ["b", "c"]
    assert post_samples(strict_server, [("a", airplane)]).json()["error"] == "too_many_classes"


@pytest.mark.parametrize("label", ["\u200b", "\u202e", "\ufeff", "b\u200d", "\u2066b"])
def test_invisible_labels_are_refused_in_every_form(strict_server, jpegs, label):
    image = jpegs[0][1]
    received = status(strict_server)["samples_received"]
    r = post_samples(strict_server, [(label, image)])
    assert r.status_code == 422 and r.json()["error"] == "invalid_request"
    r = httpx.post(f"{strict_server.url}/samples", files={"image": ("x.jpg", image, "image/jpeg")},
                   data={"label": label}, timeout=TIMEOUT)
    assert r.status_code == 422 and r.json()["error"] == "invalid_request"
    ack = stream_acks(strict_server, [{"label": label, "image": b64(image)}])[0]
    assert ack["status"] == 422 and ack["error"] == "invalid_request"
    assert ws_ack(strict_server, {"label": label, "image": b64(image)})["status"] == 422
    assert status(strict_server)["samples_received"] == received


def test_labels_that_look_alike_are_one_class(tmp_path, jpegs):
    server = Server(tmp_path / "svc").start()
    try:
        decomposed, composed = "cafe\u0301", "caf\u00e9"
        assert unicodedata.normalize("NFC", decomposed) == composed and decomposed != composed
        assert post_samples(server, [(decomposed, jpegs[0][1]), (composed, jpegs[1][1])]).status_code == 201
        assert status(server)["classes"] == [composed]
    finally:
        server.stop()


def test_too_many_samples_is_one_answer_in_every_form(strict_server, jpegs):
    image = jpegs[0][1]
    answers = [post_samples(strict_server, [("b", image)] * 4),
               httpx.post(f"{strict_server.url}/samples", files=[("image", ("x.jpg", image, "image/jpeg"))] * 4,
                          data={"label": "b"}, timeout=TIMEOUT),
               httpx.post(f"{strict_server.url}/samples", files=[("image", ("x.jpg", image, "image/jpeg"))] * 5,
                          data={"label": "b"}, timeout=TIMEOUT),
               httpx.post(f"{strict_server.url}/predict", json={"images": [b64(image)] * 4}, timeout=TIMEOUT),
               httpx.post(f"{strict_server.url}/predict", files=[("image", ("x.jpg", image, "image/jpeg"))] * 5,
                          timeout=TIMEOUT)]
    assert [(r.status_code, r.json()["error"]) for r in answers] == [(413, "too_many_samples")] * 5
    ack = stream_acks(strict_server, [{"samples": [{"label": "b", "image": b64(image)}] * 4}])[0]
    assert (ack["status"], ack["error"]) == (413, "too_many_samples")


@pytest.mark.parametrize("field", ["", "labels", "extra"])
def test_an_unknown_multipart_field_is_refused_as_in_json(strict_server, jpegs, field):
    received = status(strict_server)["samples_received"]
    r = httpx.post(f"{strict_server.url}/samples", files={"image": ("x.jpg", jpegs[0][1], "image/jpeg")},
                   data={"label": "b", field: "x"}, timeout=TIMEOUT)
    assert r.status_code == 422 and r.json()["error"] == "invalid_request" and "unknown" in r.json()["detail"]
    assert status(strict_server)["samples_received"] == received


def raw_socket(server) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    return sock


@pytest.mark.parametrize("path", ["/samples", "/predict"])
def test_a_client_that_vanishes_mid_body_is_not_a_server_error(strict_server, path):
    log_before = strict_server.log_path.read_text()
    for _ in range(5):
        with contextlib.closing(raw_socket(strict_server)) as sock:
            sock.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                         "Content-Length: 100\r\n\r\n{\"label\": \"b\"".encode())
    time.sleep(0.5)
    new = strict_server.log_path.read_text()[len(log_before):]
    assert "Traceback" not in new and "unexpected error" not in new
    assert httpx.get(f"{strict_server.url}/readyz", timeout=TIMEOUT).status_code == 200


def test_slow_clients_are_cut_off(strict_server):
    """Half a header: closed after the header timeout (1 s here); half a body: 408."""
    half_header = raw_socket(strict_server)
    half_header.sendall(b"POST /samples HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-")
    half_body = raw_socket(strict_server)
    half_body.sendall(b"POST /samples HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 100\r\n\r\n{\"label\"")
    silent = raw_socket(strict_server)
    t0 = time.monotonic()
    assert half_header.recv(1024) == b"" and silent.recv(1024) == b""  # closed by the server
    answer = b"".join(iter(lambda: half_body.recv(4096), b"")).decode()  # until the server closes
    assert time.monotonic() - t0 < 8
    assert answer.startswith("HTTP/1.1 408") and "request_timeout" in answer
    for s in (half_header, half_body, silent):
        s.close()


def whole_response(sock, data: bytes) -> bytes:
    """Read on from `data` until the headers and as many body bytes as they announce are in."""
    while True:
        head, blank, body = data.partition(b"\r\n\r\n")
        length = re.search(rb"(?im)^content-length: *(\d+)", head) if blank else None
        if length and len(body) >= int(length[1]):
            return data
        if not (chunk := sock.recv(4096)):
            return data
        data += chunk


def test_a_body_that_trickles_is_cut_off_at_its_deadline(tmp_path):
    """One byte every 0.5 s never stalls for the 10 s chunk timeout, yet the whole body has 3 s."""
    server = Server(tmp_path / "svc", body_timeout_s=10, body_deadline_s=3).start()
    try:
        with contextlib.closing(raw_socket(server)) as sock:
            sock.sendall(b"POST /samples HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 1000\r\n\r\n")
            t0, answer = time.monotonic(), b""
            sock.settimeout(0.5)
            while not answer and time.monotonic() - t0 < 60:
                with contextlib.suppress(OSError):
                    sock.sendall(b" ")
                with contextlib.suppress(TimeoutError):
                    answer = sock.recv(4096)
            sock.settimeout(30)
            answer = whole_response(sock, answer)
            with contextlib.suppress(OSError):  # a trickler goes on after the answer: that must not hold it open
                sock.sendall(b" ")
            try:
                closed = sock.recv(4096) == b""
            except ConnectionResetError:  # closed with our byte unread
                closed = True
        assert answer.startswith(b"HTTP/1.1 408") and b"not whole after 3 s" in answer, answer
        assert closed and b"connection: close" in answer.lower(), answer
        assert status(server)["samples_received"] == 0
    finally:
        server.stop()


def test_one_version_everywhere(strict_server):
    info = httpx.get(f"{strict_server.url}/openapi.json", timeout=TIMEOUT).json()["info"]
    assert info["version"] == service.__version__ == importlib.metadata.version("aser-service")


def test_failure_totals_are_counters_and_scrapes_leave_no_access_log(strict_server):
    before = strict_server.log_path.read_text().count("/metrics")
    for _ in range(3):
        text = httpx.get(f"{strict_server.url}/metrics", timeout=TIMEOUT).text
    for name in ("aser_snapshot_failures", "aser_samples_quarantined"):
        assert f"# TYPE {name}_total counter" in text and f"\n{name}_total 0.0" in text
    httpx.get(f"{strict_server.url}/status", timeout=TIMEOUT)
    time.sleep(0.3)
    log = strict_server.log_path.read_text()
    assert log.count("/metrics") == before and '"GET /status HTTP/1.1" 200' in log


@pytest.fixture
def small_disk(tmp_path):
    """A 24 MiB tmpfs (skipped where this machine cannot mount one)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(mount)], capture_output=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(path) -> None:
    """Write `path` until the filesystem has no byte left."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        for chunk in (1 << 20, 4096, 1):
            with contextlib.suppress(OSError):
                while os.write(fd, b"\0" * chunk):
                    pass
    finally:
        os.close(fd)


def test_a_failed_durable_write_leaves_no_temporary_file(small_disk):
    fill(small_disk / "filler")
    with pytest.raises(OSError):
        write_durably(small_disk / "learner-1.pt", b"x" * (4 << 20))
    assert sorted(p.name for p in small_disk.iterdir()) == ["filler"]


def test_a_full_disk_answers_507_and_recovers_by_itself(small_disk, jpegs):
    data_dir = small_disk / "data"
    (data_dir / "checkpoints").mkdir(parents=True)
    leftover = data_dir / "checkpoints" / "learner-000000000007-1.pt.tmp"  # a crash's leftover
    leftover.write_bytes(b"x" * 1000)
    server = Server(data_dir, checkpoint_every_steps=1, batch_size=10, snapshot_every_steps=0).start()
    try:
        assert not leftover.exists()  # removed at start-up
        assert post_samples(server, jpegs[:20]).status_code == 201
        wait_trained(server, 20)
        fill(small_disk / "filler")
        image = jpegs[20][1]
        answers = [post_samples(server, [("frog", image)]) for _ in range(3)]
        assert all(r.status_code == 507 and r.json()["error"] == "storage_full" for r in answers)
        assert all(int(r.headers["retry-after"]) > 0 for r in answers)
        ack = stream_acks(server, [{"label": "frog", "image": b64(image)}])[0]
        assert (ack["status"], ack["error"]) == (507, "storage_full")
        assert ws_ack(server, {"label": "frog", "image": b64(image)})["status"] == 507
        assert status(server)["samples_received"] == 20  # nothing stored
        assert not list((data_dir / "checkpoints").glob("*.tmp"))
        (small_disk / "filler").unlink()  # space comes back: no restart needed
        r = post_samples(server, jpegs[20:30])
        assert r.status_code == 201 and r.json()["seqs"] == list(range(21, 31))
        assert wait_trained(server, 30)["samples_received"] == 30
        log = server.log_path.read_text()
        assert log.count("is full; writes are refused") == 1 and "space is back" in log
        assert "Traceback" not in log
    finally:
        server.stop()


def db_rows(data_dir) -> list[tuple[int, int, str | None]]:
    """(seq, bytes of pixels, sample id) of every ingest-log row, read from the file itself."""
    import sqlite3

    with contextlib.closing(sqlite3.connect(data_dir / "aser.db")) as conn:
        return conn.execute("SELECT seq, length(image), sample_id FROM samples ORDER BY seq").fetchall()


def post_with_ids(server, samples, ids):
    body = {"samples": [{"label": label, "image": b64(img), "id": i} for (label, img), i in zip(samples, ids)]}
    return httpx.post(f"{server.url}/samples", json=body, timeout=TIMEOUT)


def wait_for(predicate, timeout=60, what="the condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"{what} did not hold within {timeout} s")


def test_retention_drops_trained_pixels_keeps_ids_and_gives_space_back(tmp_path, jpegs):
    data_dir = tmp_path / "svc"
    server = Server(data_dir, retain_pixels_s=0, retain_every_s=0.5, checkpoint_every_steps=1, batch_size=10,
                    snapshot_every_steps=0).start()
    try:
        ids = [f"cam1-{i:04d}" for i in range(40)]
        assert post_with_ids(server, jpegs, ids).status_code == 201
        wait_trained(server, 40)
        dropped = wait_for(lambda: status(server)["storage"]["retention_pixels_dropped"] >= 40, what="retention")
        assert dropped
        assert [r[1] for r in db_rows(data_dir)] == [0] * 40 and [r[2] for r in db_rows(data_dir)] == ids
        again = post_with_ids(server, jpegs[:5], ids[:5]).json()  # a client's retry: stored once
        assert again["duplicates"] == 5 and again["seqs"] == [1, 2, 3, 4, 5]
        assert status(server)["samples_received"] == 40 and len(status(server)["buffer"]) == 2  # memory kept
        metrics = httpx.get(f"{server.url}/metrics", timeout=TIMEOUT).text
        assert "aser_retention_pixels_dropped_total 40.0" in metrics and "aser_database_bytes " in metrics
        # untrained samples keep their pixels; a restart after a kill trains on them, nothing lost
        server.kill()
        server.start()
        assert post_with_ids(server, jpegs[:10], [f"cam2-{i}" for i in range(10)]).status_code == 201
        st = wait_trained(server, 50)
        assert st["samples_received"] == 50 and st["backlog"] == 0
    finally:
        server.stop()


def test_retention_caps_the_database_and_forgets_ids_past_their_horizon(tmp_path, jpegs):
    data_dir = tmp_path / "svc"
    server = Server(data_dir, retain_pixels_s=1e9, retain_max_mb=0.1, retain_ids_s=2, retain_every_s=0.5,
                    checkpoint_every_steps=1, batch_size=10, snapshot_every_steps=0, image_size=32).start()
    try:
        ids = [f"cam1-{i:04d}" for i in range(40)]
        assert post_with_ids(server, jpegs, ids).status_code == 201
        wait_trained(server, 40)
        wait_for(lambda: status(server)["storage"]["retention_ids_dropped"] >= 1, what="the id horizon")
        rows = db_rows(data_dir)
        assert len(rows) < 40  # the oldest pixels went over the cap, then their rows past the horizon
        r = post_with_ids(server, jpegs[:1], ids[:1]).json()  # beyond the horizon: a new sample
        assert r["stored"] == 1 and r["seqs"] == [41]
        # 0.1 MB is below what the memory's own rows need: the cap cannot be met, and it is said once
        wait_for(lambda: status(server)["storage"]["over_cap"], what="the cap reported unmet")
        assert "aser_database_over_cap 1.0" in httpx.get(f"{server.url}/metrics", timeout=TIMEOUT).text
        # said once an episode, not at every run (a loaded machine may let the size dip under the cap between runs
        # while rows go past their horizon: a second episode)
        said = server.log_path.read_text().count("stays above ASER_RETAIN_MAX_MB")
        assert said >= 1
        for _ in range(3):  # three more runs while the cap stays unmet say nothing more
            last = status(server)["storage"]["retention_last_run"]
            wait_for(lambda: status(server)["storage"]["retention_last_run"] > last, what="another retention run")
        assert status(server)["storage"]["over_cap"]
        assert server.log_path.read_text().count("stays above ASER_RETAIN_MAX_MB") == said
    finally:
        server.stop()


def real_photos(tmp_path) -> dict[str, bytes]:
    """Real images of other sizes: Mini-ImageNet JPEGs (84x84) and one of them as a camera's 640x480."""
    import io
    import zipfile

    from PIL import Image

    from .conftest import MINI_ZIP

    with zipfile.ZipFile(MINI_ZIP) as z:
        names = sorted(n for n in z.namelist() if n.endswith(".jpg"))[:3]
        photos = {n.split("/")[-1]: z.read(n) for n in names}
    big = io.BytesIO()
    Image.open(io.BytesIO(next(iter(photos.values())))).resize((640, 480)).save(big, "JPEG", quality=90)
    photos["camera-640x480.jpg"] = big.getvalue()
    for name, data in photos.items():
        (tmp_path / name).write_bytes(data)
    return photos


def test_images_of_any_size_are_fitted_by_one_rule_everywhere(tmp_path, jpegs):
    import io

    import numpy as np
    from PIL import Image

    from clients.onnx_client import OnnxClassifier
    from learner.formats.snapshot import RESIZE_RULE, read_image

    photos = real_photos(tmp_path)
    server = Server(tmp_path / "svc").start()
    try:
        assert post_samples(server, jpegs).status_code == 201
        assert post_samples(server, [("frog", p) for p in photos.values()]).status_code == 201
        wait_trained(server, len(jpegs) + len(photos))
        camera = photos["camera-640x480.jpg"]
        fitted = io.BytesIO()
        Image.fromarray(read_image(camera, 32).transpose(1, 2, 0)).save(fitted, "PNG")
        answers = httpx.post(f"{server.url}/predict", json={"images": [b64(camera), b64(fitted.getvalue())],
                                                            "k": 2}, timeout=TIMEOUT).json()["results"]
        assert answers[0] == answers[1]  # the service fitted the photo as the rule says
        snap = httpx.post(f"{server.url}/snapshots", timeout=300).json()
        onnx = OnnxClassifier(httpx.get(f"{server.url}/snapshots/{snap['id']}", timeout=TIMEOUT).content)
        assert onnx.metadata["resize"] == RESIZE_RULE
        ours = onnx.predict([tmp_path / "camera-640x480.jpg"], k=2)[0]
        assert [t["label"] for t in ours] == [t["label"] for t in answers[0]]
        assert np.allclose([t["probability"] for t in ours], [t["probability"] for t in answers[0]], atol=1e-4)
    finally:
        server.stop()
    strict = Server(tmp_path / "strict", strict_image_size=True).start()
    try:
        r = post_samples(strict, [("frog", photos["camera-640x480.jpg"])])
        assert r.status_code == 422 and r.json()["error"] == "wrong_shape" and "640x480" in r.json()["detail"]
    finally:
        strict.stop()


def onnx_client(*args) -> subprocess.CompletedProcess:
    import sys

    from .conftest import ROOT

    return subprocess.run([sys.executable, "-m", "clients.onnx_client", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_the_onnx_client_says_what_is_wrong_in_one_line(tmp_path, strict_server, jpegs):
    import onnx
    from onnx import TensorProto, helper

    photo = tmp_path / "photo.jpg"
    photo.write_bytes(jpegs[0][1])
    (tmp_path / "empty.onnx").write_bytes(b"")
    (tmp_path / "text.onnx").write_text("not a model")
    (tmp_path / "notes.jpg").write_text("not an image")
    graph = helper.make_graph([helper.make_node("Identity", ["pixels"], ["logits"])], "other",
                              [helper.make_tensor_value_info("pixels", TensorProto.FLOAT, [1, 3])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 3])])
    onnx.save(helper.make_model(graph), tmp_path / "foreign.onnx")
    cases = {
        "missing model": ([tmp_path / "missing.onnx", photo], "no such file"),
        "empty model": ([tmp_path / "empty.onnx", photo], "empty"),
        "not onnx": ([tmp_path / "text.onnx", photo], "not a usable ONNX model"),
        "not a snapshot": ([tmp_path / "foreign.onnx", photo], "not a snapshot of this service"),
        "service down": (["--url", "http://127.0.0.1:9", photo], "cannot reach the service"),
        "unknown snapshot": (["--url", strict_server.url, "--snapshot", "99999", photo], "answered 404"),
    }
    for case, (args, said) in cases.items():
        run = onnx_client(*args)
        lines = run.stderr.strip().splitlines()
        assert run.returncode == 1 and len(lines) == 1 and said in lines[0], (case, run.stderr)
    # a real snapshot, then images that are not
    assert post_samples(strict_server, jpegs[:2]).status_code in (201, 409)
    wait_for(lambda: status(strict_server)["samples_trained"] > 0, what="training")
    model = tmp_path / "model.onnx"
    assert httpx.post(f"{strict_server.url}/snapshots", timeout=300).status_code == 201
    model.write_bytes(httpx.get(f"{strict_server.url}/snapshots/latest", timeout=TIMEOUT).content)
    for image, said in ((tmp_path / "nothing.jpg", "no such file"), (tmp_path / "notes.jpg", "not a readable image"),
                        (tmp_path, "a directory")):
        run = onnx_client(model, image)
        assert run.returncode == 1 and said in run.stderr and "Traceback" not in run.stderr
    for k in ("0", "-1"):
        assert onnx_client(model, photo, "--k", k).returncode == 2
    good = onnx_client(model, photo, "--k", "1")
    assert good.returncode == 0 and len(json.loads(good.stdout)["top"]) == 1


def test_reads_answer_after_a_restart_on_a_full_disk(small_disk, jpegs):
    """Reader connections opened after the disk filled (a restart, new threads) set nothing in the
    file: /status, /metrics, /history and /memory answer 200 while writes answer 507."""
    from concurrent.futures import ThreadPoolExecutor

    data_dir = small_disk / "data"
    server = Server(data_dir, batch_size=10, snapshot_every_steps=0).start()
    try:
        assert post_samples(server, jpegs[:20]).status_code == 201
        wait_trained(server, 20)
    finally:
        server.stop()
    server = Server(data_dir, batch_size=10, snapshot_every_steps=0).start()
    try:
        fill(small_disk / "filler")
        paths = ["/status", "/metrics", "/history", "/memory", "/readyz"] * 6
        with ThreadPoolExecutor(len(paths)) as pool:  # many at once: the server opens new reader threads
            answers = list(pool.map(lambda p: httpx.get(f"{server.url}{p}", timeout=TIMEOUT), paths))
        assert [r.status_code for r in answers] == [200] * len(paths), [(r.url.path, r.text[:80]) for r in answers]
        assert post_samples(server, jpegs[20:21]).status_code == 507
    finally:
        server.stop()
        (small_disk / "filler").unlink(missing_ok=True)
