"""The night's pixel store on a real service (real EuroSAT tiles, sleep on): every trained photo kept, a correction,
a forgotten sample and a forgotten class reaching it at once, a SIGKILL losing nothing, and a data directory made
before the store (or with its file lost) filled from the ingest log's retained photos."""

from __future__ import annotations

import sqlite3

from clients.api import ServiceClient
from clients.cli import status_lines

from .test_service import Server, status
from .test_sleep import CLASSES, send, tiles, wait_for  # noqa: F401  (tiles: the fixture)


def held(folder) -> dict[int, int]:
    """seq -> class id, as the file holds them (read after the service stopped)."""
    with sqlite3.connect(folder / "pixels.db") as conn:
        return dict(conn.execute("SELECT seq, class_id FROM pixels"))


def test_the_pixel_store_keeps_every_trained_photo_and_follows_corrections_forgetting_and_kills(tmp_path, tiles):
    folder = tmp_path / "svc"
    server = Server(folder, backbone="lite0", image_size=64, sleep_idle_s=3600, mem_size=100,
                    max_batch_wait_s=0.2).start()
    try:
        send(server, tiles[:120])
        st = wait_for(server, lambda s: s["samples_trained"] == 120, "train 120")
        pixels = st["storage"]["pixel_store"]
        assert pixels["samples"] == 120 and sorted(pixels["classes"]) == sorted(CLASSES)
        assert 0 < pixels["bytes"] < 120 * 64 * 64 * 3 / 4 and pixels["capacity_bytes"] == 256 * 2**20
        assert "pixel store: 120 photos" in status_lines(st)  # `aser status`
        with ServiceClient(server.url) as client:
            first = client.sample(1)["label"]
            other = next(c for c in CLASSES if c != first)
            client.relabel(1, other)
            client.forget_sample(2)
            client.forget_class(CLASSES[3])
        st = status(server)["storage"]["pixel_store"]
        assert st["samples"] == 120 - 1 - 30 and CLASSES[3] not in st["classes"]
        send(server, tiles[120:160])  # of the three classes left and the forgotten one's label, as a new class
        wait_for(server, lambda s: s["backlog"] == 0 and s["samples_received"] > 100, "train the rest")
        server.kill()
        server.start()
        st = wait_for(server, lambda s: s["backlog"] == 0 and s["serving_current"], "retrained after the kill")
    finally:
        server.stop()
    rows = held(folder)
    with sqlite3.connect(folder / "aser.db") as conn:  # every live photo, each with the log's label
        labels = dict(conn.execute("SELECT seq, class_id FROM samples WHERE deleted IS NULL"))
        other_id = conn.execute("SELECT id FROM classes WHERE name = ? AND forgotten IS NULL", (other,)).fetchone()[0]
    assert rows == labels and 2 not in rows and rows[1] == other_id
    assert st["storage"]["pixel_store"]["samples"] == len(rows) == 120 - 1 - 30 + 40

    # the file lost (as on a directory made before the store): filled from the log at the next start
    (folder / "pixels.db").unlink()
    server.start()
    try:
        assert status(server)["storage"]["pixel_store"]["samples"] == len(rows)
    finally:
        server.stop()
    assert held(folder) == rows
