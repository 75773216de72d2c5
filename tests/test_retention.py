"""Retention never scans months of id-only rows inside a write transaction (issue 39, item 13): the
work done on the writer connection (SQLite VM steps, not seconds) stays that of the rows it changes.
A real SQLite file with 20,000 rows that keep only their ids and 100 trained rows with pixels."""

import time

from service.storage.db import Database
from service.storage.retention import Retention, RetentionPolicy
from service.storage.store import IngestLog


def writer_steps(db: Database, run) -> int:
    """SQLite VM instructions executed on the writer connection while `run()` runs."""
    steps = 0

    def count():
        nonlocal steps
        steps += 100
        return 0

    db._writer.set_progress_handler(count, 100)
    try:
        run()
    finally:
        db._writer.set_progress_handler(None, 100)
    return steps


def test_a_pass_over_months_of_ids_holds_the_writer_only_for_what_it_changes(tmp_path):
    db = Database(tmp_path / "aser.db")
    IngestLog(db, (3, 32, 32))
    now = time.time()
    with db.write() as conn:
        conn.execute("INSERT INTO classes (name) VALUES ('cat')")
        class_id = conn.execute("SELECT id FROM classes").fetchone()[0]
        conn.executemany("INSERT INTO samples (class_id, image, received, sample_id) VALUES (?, X'', ?, ?)",
                         [(class_id, now - 3600, f"old-{i}") for i in range(20_000)])
        conn.executemany("INSERT INTO samples (class_id, image, received, sample_id) VALUES (?, ?, ?, ?)",
                         [(class_id, bytes(3072), now - 60, f"new-{i}") for i in range(100)])
    retention = Retention(db, RetentionPolicy(pixels_s=0, max_bytes=0, ids_s=30 * 86400), 60, lambda: 20_100)
    steps = writer_steps(db, lambda: retention.run_once(now))
    assert retention.totals.pixels_dropped == 100 and retention.totals.ids_dropped == 0
    with db.read() as conn:
        assert conn.execute("SELECT COUNT(*) FROM samples WHERE length(image) > 0").fetchone()[0] == 0
        assert conn.execute("SELECT COUNT(*) FROM samples").fetchone()[0] == 20_100
    # a scan of the 20,000 id-only rows inside a write costs over 100,000 steps; 100 rows by key, far fewer
    assert steps < 50_000, steps
    assert writer_steps(db, lambda: retention.run_once(now)) < 5_000  # nothing left to do: next to nothing
