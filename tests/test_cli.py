"""The `aser` command line against a real service, on real photos (Split EuroSAT tiles written as a folder a class):
add (again, and after a kill mid-upload: nothing twice, nothing missing), predict, evaluate (the service's and a
downloaded snapshot's reports agree, the confusion matrix is a PNG), snapshot, status, and its one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx
import pytest
from PIL import Image

from clients.bench.live.local_service import free_port, real_jpegs

from .conftest import EUROSAT_ZIP, ROOT
from .test_service import Server

CLASSES = ["Forest", "Highway", "SeaLake"]
TOKEN = "cli-admin-token"


def write_folder(root, pairs) -> list:
    files = []
    for i, (label, jpeg) in enumerate(pairs):
        path = root / label / f"{i:04d}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(jpeg)
        files.append(path)
    return files


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("photos")
    write_folder(root / "train", real_jpegs(EUROSAT_ZIP, 120, classes=CLASSES))
    write_folder(root / "test", real_jpegs(EUROSAT_ZIP, 30, split="test", classes=CLASSES))
    return root


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("cli"), backbone="lite0", image_size=64, admin_token=TOKEN,
               max_batch_wait_s=0.2).start()
    yield s
    s.stop()


def aser(*args, url=None, token=TOKEN, cwd=None, **kwargs) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "clients.cli", *(["--url", url] if url else []),
               *(["--token", token] if token else []), *map(str, args)]
    return subprocess.run(command, capture_output=True, text=True, cwd=cwd or ROOT, timeout=600, **kwargs)


def settled(server) -> dict:
    deadline = time.time() + 300
    while time.time() < deadline:
        st = httpx.get(f"{server.url}/status", headers={"Authorization": f"Bearer {TOKEN}"}).json()
        if st["backlog"] == 0 and st["serving_current"]:
            return st
        time.sleep(0.2)
    raise AssertionError("the service did not settle")


def test_add_a_folder_then_again_then_after_a_kill_sends_each_photo_once(server, folders, tmp_path):
    journal = tmp_path / "sent"
    first = subprocess.Popen([sys.executable, "-m", "clients.cli", "--url", server.url, "--token", TOKEN, "add",
                              folders / "train", "--batch", "1", "--journal", journal], cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and not (journal.exists() and len(journal.read_text().splitlines()) >= 5):
        time.sleep(0.01)
    first.kill()  # mid-upload: some acknowledged, maybe a request in flight
    first.wait()
    acknowledged = len(journal.read_text().splitlines())
    assert 5 <= acknowledged < 120
    again = aser("add", folders / "train", "--journal", journal, "--quiet", url=server.url)
    assert again.returncode == 0, again.stderr
    assert f"120 photos: {120 - acknowledged} sent" in again.stdout and f"{acknowledged} skipped" in again.stdout
    st = settled(server)
    assert st["samples_received"] == 120 and sorted(st["classes"]) == CLASSES  # nothing twice, nothing missing
    once_more = aser("add", folders / "train", "--journal", journal, "--quiet", url=server.url)
    assert "120 photos: 0 sent" in once_more.stdout and "120 skipped" in once_more.stdout
    fresh_journal = aser("add", folders / "train", "--journal", tmp_path / "other", "--quiet", url=server.url)
    assert "120 sent (0 stored, 120 already there)" in fresh_journal.stdout  # the ids: the service stores none twice
    assert status_of(server)["samples_received"] == 120


def status_of(server) -> dict:
    return httpx.get(f"{server.url}/status", headers={"Authorization": f"Bearer {TOKEN}"}).json()


def test_predict_and_evaluate_agree_with_the_service_and_its_snapshot(server, folders, tmp_path):
    aser("add", folders / "train", "--journal", tmp_path / "sent", "--quiet", url=server.url)
    settled(server)
    files = sorted((folders / "test").rglob("*.jpg"))
    out = aser("predict", *files[:3], "--k", "2", "--json", url=server.url)
    assert out.returncode == 0, out.stderr
    theirs = httpx.post(f"{server.url}/predict", headers={"Authorization": f"Bearer {TOKEN}"},
                        files=[("image", (f.name, f.read_bytes(), "image/jpeg")) for f in files[:3]],
                        params={"k": 2}).json()["results"]
    assert [a["top"] for a in json.loads(out.stdout)] == theirs

    png, report = tmp_path / "confusion.png", tmp_path / "report.json"
    out = aser("evaluate", folders / "test", "--json", "--report", report, "--confusion", png, "--quiet",
               url=server.url)
    assert out.returncode == 0, out.stderr
    r = json.loads(report.read_text())
    answers = httpx.post(f"{server.url}/predict", headers={"Authorization": f"Bearer {TOKEN}"},
                         files=[("image", (f.name, f.read_bytes(), "image/jpeg")) for f in files]).json()["results"]
    right = sum(a[0]["label"] == f.parent.name for a, f in zip(answers, files))
    assert r["photos"] == 30 and r["accuracy"] == round(right / 30, 4) and r["accuracy"] > 0.6
    assert sum(v["support"] for v in r["per_class"].values()) == 30 and sum(map(sum, r["confusion"]["matrix"])) == 30
    assert Image.open(png).size[0] >= 300  # a picture

    model = tmp_path / "model.onnx"
    out = aser("snapshot", "-o", model, "--new", url=server.url)
    assert out.returncode == 0 and model.stat().st_size > 1_000_000, out.stderr
    offline = aser("evaluate", folders / "test", "--onnx", model, "--json", "--quiet", url="http://127.0.0.1:9")
    assert offline.returncode == 0, offline.stderr  # no service needed
    o = json.loads(offline.stdout)
    assert o["accuracy"] == r["accuracy"] and o["confusion"] == r["confusion"]
    markdown = aser("evaluate", folders / "test", "--quiet", url=server.url).stdout
    assert "| class | precision | recall | support |" in markdown and f"{100 * r['accuracy']:.2f}%" in markdown
    st = aser("status", url=server.url)
    assert st.returncode == 0 and "120 received, 120 trained" in st.stdout


def test_errors_are_one_line_and_an_exit_code(server, folders, tmp_path):
    down = aser("status", url=f"http://127.0.0.1:{free_port()}")
    assert down.returncode == 3 and "no service answers" in down.stderr and "Traceback" not in down.stderr
    after = aser("status", "--url", server.url, "--token", TOKEN)  # the options after the command too
    assert after.returncode == 0 and "received" in after.stdout
    bad_token = aser("status", url=server.url, token="wrong")
    assert bad_token.returncode == 1 and ("401" in bad_token.stderr or "403" in bad_token.stderr)
    assert len(bad_token.stderr.strip().splitlines()) == 1
    empty = tmp_path / "empty"
    empty.mkdir()
    nothing = aser("add", empty, url=server.url)
    assert nothing.returncode == 2 and "no images found" in nothing.stderr
    broken = tmp_path / "broken"
    write_folder(broken, [("Forest", b"\xff\xd8\xff not a jpeg at all")])
    good = next((folders / "train" / "Forest").iterdir())
    (broken / "Forest" / "good.jpg").write_bytes(good.read_bytes())
    refused = aser("add", broken, "--journal", tmp_path / "j", "--quiet", url=server.url)
    assert refused.returncode == 1 and "1 refused" in refused.stdout
    assert "0000.jpg" in refused.stderr and "corrupt_image" in refused.stderr and "Traceback" not in refused.stderr
    loose = tmp_path / "loose"
    loose.mkdir()
    (loose / "a.jpg").write_bytes(good.read_bytes())
    assert "give --label" in aser("add", loose, url=server.url).stderr
    forget = aser("forget", "Highway", url=server.url)
    assert forget.returncode == 2 and "--yes" in forget.stderr
    for fresh in ((), ("--fresh",)):  # the default sleeps: a sleep asked for now (ASER_SLEEP=false: 409 sleep_off)
        sleep = aser("sleep", *fresh, url=server.url)
        assert sleep.returncode == 0 and " requested: a budget of" in sleep.stdout, sleep.stderr
        assert ("fresh sleep" in sleep.stdout) == bool(fresh)


def test_a_photo_of_no_learned_class_is_none_of_these(server, folders, tmp_path):
    """Once each class holds enough samples back (80 tiles a class: 7 held back each), camera photos of another world
    (scikit-image's, at 64 px) score above the classes' own test tiles and are mostly answered "none of these", the
    tiles seldom; /status says what decides."""
    import os

    from skimage import data_dir

    write_folder(tmp_path / "more", real_jpegs(EUROSAT_ZIP, 240, classes=CLASSES)[120:])
    assert aser("add", tmp_path / "more", "--quiet", url=server.url).returncode == 0
    st = settled(server)
    assert st["config"]["calibrate"] and st["calibration"]["held_back"] == 21
    assert st["calibration"]["temperature"] > 0 and st["calibration"]["unknown_threshold"] is not None
    assert st["calibration"]["threshold_samples"] > st["calibration"]["held_back"]  # the trained samples' too
    photos = tmp_path / "photos"
    photos.mkdir()
    for name in ("astronaut.png", "chelsea.png", "coffee.png", "rocket.jpg", "motorcycle_left.png",
                 "hubble_deep_field.jpg"):
        Image.open(os.path.join(data_dir, name)).convert("RGB").save(photos / (name.split(".")[0] + ".jpg"))
    strangers = json.loads(aser("predict", photos, "--json", url=server.url).stdout)
    tiles = json.loads(aser("predict", folders / "test", "--json", url=server.url).stdout)
    tile_scores = sorted(a["unknown_score"] for a in tiles)
    assert all(a["unknown_score"] > tile_scores[len(tiles) // 2] for a in strangers), (strangers, tile_scores)
    assert sum(a["unknown"] for a in strangers) >= 4 and sum(a["unknown"] for a in tiles) <= 3, (strangers, tiles)
    assert all(a["unknown_score"] > st["calibration"]["unknown_threshold"] for a in strangers if a["unknown"])
    assert "none of these" in aser("predict", photos, url=server.url).stdout


def test_the_console_script_is_installed_and_serve_is_the_service():
    script = ROOT / ".venv" / "bin" / "aser"
    command = [str(script)] if script.exists() else [sys.executable, "-m", "clients.cli"]
    helped = subprocess.run([*command, "serve", "--help"], capture_output=True, text=True, timeout=120)
    assert helped.returncode == 0 and "ASER_SLEEP" in helped.stdout and "usage: python -m service" in helped.stdout
    assert "evaluate" in subprocess.run([*command, "--help"], capture_output=True, text=True).stdout

