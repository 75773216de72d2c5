"""A device's disk is not a server's: each file the service writes, damaged while it is stopped (cut to a third, zeroed
in its middle, or replaced by another lineage's), one at a time, on a real service. What is derived (the latent store,
the checkpoint, the snapshots, the night's pixel store) is set aside and rebuilt, and every acknowledged sample is
there; a damaged ingest log is refused in one line naming the way back."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import httpx
import pytest

from clients.cli import status_lines

from .conftest import ROOT
from .test_service import Server, status
from .test_sleep import CLASSES, send, tiles, wait_for  # noqa: F401  (tiles: the fixture)

SENT = 120  # tiles sent to the lineage that is damaged (30 a class)


def settings(**more) -> dict:
    return dict(backbone="lite0", image_size=64, sleep_idle_s=3600, mem_size=100, max_batch_wait_s=0.2,
                snapshot_every_steps=0, **more)


def trained_lineage(folder, pairs) -> dict:
    """A stopped service's data directory that has learned `pairs`, slept once and exported a snapshot; its status."""
    server = Server(folder, **settings()).start()
    try:
        send(server, pairs)
        wait_for(server, lambda s: s["samples_trained"] == len(pairs), "train")
        httpx.post(f"{server.url}/sleep", timeout=60)
        wait_for(server, lambda s: s["sleep"]["sleeps"] == 1 and s["sleep"]["state"] == "awake", "one sleep")
        assert httpx.post(f"{server.url}/snapshots", timeout=300).status_code in (200, 201)
        st = status(server)
    finally:
        server.stop()
    return st


@pytest.fixture(scope="module")
def lineages(tmp_path_factory, tiles):
    """Ours (four classes of EuroSAT) and another's (the same classes, other tiles), both stopped."""
    root = tmp_path_factory.mktemp("damage")
    ours = trained_lineage(root / "ours", tiles[:SENT])
    theirs = trained_lineage(root / "theirs", tiles[SENT:SENT + 40])
    return root, ours, theirs


def the_file(folder, which: str):
    """The path of `which` (latents, checkpoint, snapshot, log) in a data directory."""
    if which == "checkpoint":
        return next((folder / "checkpoints").glob("learner-*.pt"))
    if which == "snapshot":
        return max(p for p in (folder / "snapshots").glob("snapshot-*.onnx") if not p.name.endswith(".int8.onnx"))
    return folder / {"latents": "latents.db", "pixels": "pixels.db", "log": "aser.db"}[which]


def damage(root, folder, which: str, how: str) -> None:
    path = the_file(folder, which)
    data = path.read_bytes()
    if how == "truncated":
        path.write_bytes(data[:len(data) // 3])
    elif how == "zeroed":
        middle = len(data) // 2
        path.write_bytes(data[:middle - 2048] + bytes(4096) + data[middle + 2048:])
    else:  # another lineage's file under this one's name
        path.write_bytes(the_file(root / "theirs", which).read_bytes())


def copy_of(root, name: str):
    """A copy of our stopped lineage's data directory (SQLite's write-ahead logs are checkpointed at a clean stop)."""
    folder = root / name
    shutil.copytree(root / "ours", folder)
    return folder


@pytest.mark.parametrize("which,how", [
    ("latents", "truncated"), ("latents", "zeroed"), ("latents", "another"),
    ("checkpoint", "truncated"), ("checkpoint", "zeroed"), ("checkpoint", "another"),
    ("snapshot", "truncated"), ("snapshot", "zeroed"), ("snapshot", "another"),
    ("pixels", "truncated"), ("pixels", "another"),
])
def test_a_damaged_derived_file_is_set_aside_and_rebuilt_with_every_acknowledged_sample(lineages, tiles, which, how):
    root, ours, _ = lineages
    folder = copy_of(root, f"{which}-{how}")
    damage(root, folder, which, how)
    server = Server(folder, **settings())
    server.start()
    try:
        st = wait_for(server, lambda s: s["samples_trained"] == SENT and s["serving_current"], "ready and trained")
        assert st["samples_received"] == SENT and sorted(st["classes"]) == sorted(CLASSES)
        found = st["damaged_files"]
        kind = {"latents": "latent_store", "checkpoint": "checkpoint", "snapshot": "snapshot",
                "pixels": "pixel_store"}[which]
        assert [f["kind"] for f in found] == [kind], found
        assert f"damaged at start-up: {found[0]['file']} ({found[0]['reason']})" in status_lines(st)  # `aser status`
        beside = {"checkpoint": folder / "checkpoints", "snapshot": folder / "snapshots"}.get(which, folder)
        assert (beside / found[0]["set_aside_as"]).exists()
        assert f'aser_damaged_files_total{{kind="{kind}"}} 1.0' in httpx.get(f"{server.url}/metrics").text
        r = httpx.post(f"{server.url}/predict", files={"image": ("t.jpg", tiles[-1][1], "image/jpeg")})
        assert r.status_code == 200 and r.json()["results"][0][0]["label"] in CLASSES
        if which == "latents":  # filled again from the log: every trained sample but the held-back ones
            held = st["head_choice"]["held_back"]["samples"]
            assert st["sleep"]["store"]["samples"] == SENT - held == ours["sleep"]["store"]["samples"]
            httpx.post(f"{server.url}/sleep")
            st = wait_for(server, lambda s: s["sleep"]["sleeps"] >= 1 and s["sleep"]["state"] == "awake"
                          and s["sleep"]["new_samples"] == 0, "a sleep over the store filled again")
        if which == "pixels":  # filled again from the log: every trained photo
            assert st["storage"]["pixel_store"]["samples"] == ours["storage"]["pixel_store"]["samples"] == SENT
        if which == "checkpoint":  # the lineage trained again over the log: the model, the store and the memory
            assert st["sleep"]["store"]["samples"] == ours["sleep"]["store"]["samples"]
            assert st["buffer_size"] == ours["buffer_size"]
        # an intact snapshot is listed again (the worker exports one where the latest was lost)
        deadline = time.time() + 300
        while not httpx.get(f"{server.url}/snapshots").json()["snapshots"] and time.time() < deadline:
            time.sleep(0.5)
        latest = httpx.get(f"{server.url}/snapshots/latest")
        assert latest.status_code == 200 and len(latest.content) == \
            httpx.get(f"{server.url}/snapshots").json()["snapshots"][-1]["size_bytes"]
        # a second restart finds everything intact: nothing more is set aside
        server.stop()
        server.start()
        st = wait_for(server, lambda s: s["samples_trained"] == SENT, "the second restart")
        assert st["damaged_files"] == [] and st["samples_received"] == SENT
    finally:
        server.stop()
    log = server.log_path.read_text(errors="replace")
    assert "Traceback" not in log and "is damaged" in log


def run_service(folder, *args):
    environment = {k: v for k, v in os.environ.items() if not k.startswith("ASER_")}
    environment |= {"ASER_DATA_DIR": str(folder), "PYTHONPATH": str(ROOT), "ASER_BACKBONE": "lite0",
                    "ASER_IMAGE_SIZE": "64"}
    return subprocess.run([sys.executable, "-m", "service", *args], env=environment, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("how", ["truncated", "zeroed"])
def test_a_damaged_ingest_log_is_refused_in_one_line_and_salvaged_by_recover_log(lineages, how):
    root, _, _ = lineages
    folder = copy_of(root, f"log-{how}")
    damage(root, folder, "log", how)
    before = (folder / "aser.db").read_bytes()
    done = run_service(folder)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    line = done.stderr.strip()
    assert len(line.splitlines()) == 1 and str(folder / "aser.db") in line and "recover-log" in line, done.stderr
    assert (folder / "aser.db").read_bytes() == before  # never replaced
    # the way back the line names, then the service starts on what could be read
    done = run_service(folder, "recover-log")
    assert done.returncode == 0 and "samples: " in done.stdout, done.stdout + done.stderr
    assert [p.name for p in folder.glob("aser.db.damaged-*")] and (folder / "aser.db").read_bytes() != before
    server = Server(folder, **settings()).start()
    try:
        st = status(server)
        assert 0 < st["samples_received"] <= SENT
        wait_for(server, lambda s: s["samples_trained"] == s["samples_received"] and s["backlog"] == 0,
                 "what was recovered trained")
    finally:
        server.stop()


def test_another_lineages_ingest_log_makes_the_service_that_lineage(lineages):
    """Nothing tells another device's intact log from ours: the service goes on as that lineage, its checkpoint
    (missing here) trained again and its snapshots (missing here) unlisted."""
    root, _, theirs = lineages
    folder = copy_of(root, "log-another")
    damage(root, folder, "log", "another")
    server = Server(folder, **settings()).start()
    try:
        st = wait_for(server, lambda s: s["samples_trained"] == 40, "their samples trained")
        assert st["samples_received"] == theirs["samples_received"] == 40
        assert {f["kind"] for f in st["damaged_files"]} == {"checkpoint", "snapshot"}
    finally:
        server.stop()
