"""The history stays bounded for months, and forgetting a class never holds the writer for more
than one small batch (issue 39, item 12). A real SQLite file."""

from contextlib import contextmanager

from service.learning.online import History, HistoryPoint
from service.storage.db import Database


def point(n: int, labels=("cat", "dog")) -> HistoryPoint:
    return HistoryPoint(samples_trained=n, steps=n // 10, at=float(n), received=n, backlog=0,
                        accuracy=0.5, window_accuracy=0.5, new_class_samples=0, loss=None, step_ms=1.0, per_class={k: 0.5 for k in labels},
                        memory={k: 10 for k in labels})


def test_past_its_bound_the_older_half_thins_and_the_span_is_kept(tmp_path):
    history = History(Database(tmp_path / "h.db"), max_points=1000)
    for n in range(1, 5001):
        history.add(point(n))
    kept = [p.samples_trained for p in history.since(0, 10_000)]
    assert len(kept) <= 1000 and kept[0] == 1 and kept[-1] == 5000
    assert kept[-400:] == list(range(4601, 5001))  # the recent points are all there
    gaps = [b - a for a, b in zip(kept, kept[1:])]
    assert min(gaps[:100]) >= 4 and max(gaps[-400:]) == 1  # older stretches thinned more than once


def test_forgetting_rewrites_the_history_in_small_write_transactions(tmp_path):
    db = Database(tmp_path / "h.db")
    history = History(db, max_points=100_000)
    for n in range(1, 3001):
        history.add(point(n, ("cat", "dog") if n % 3 else ("dog",)))
    changes, original = [], db.write

    @contextmanager
    def counted():
        with original() as conn:
            before = conn.total_changes
            yield conn
            changes.append(conn.total_changes - before)

    db.write = counted
    history.forget_label("cat")
    assert sum(changes) == 2000 and max(changes) <= History.FORGET_BATCH
    assert all("cat" not in p.per_class and "cat" not in p.memory for p in history.since(0, 10_000))
    assert sum("dog" in p.per_class for p in history.since(0, 10_000)) == 3000
