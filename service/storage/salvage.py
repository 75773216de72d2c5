"""The way back from a damaged ingest log: every row SQLite can still read, copied into a new file that then takes the
damaged one's place (which is set aside beside it, never deleted). `python -m service recover-log` runs it.

SQLite's shell has `.recover`, which also reads pages no longer linked from their tables; the shells these machines
and Debian 12 ship (3.40) fail it on every file, so the service carries its own: each table is read in rowid order
and, past a page it cannot read, probed one rowid at a time up to the highest the file still names, so the rows in
intact pages come back and those in lost pages are counted as missing. Sequence numbers are never handed out twice:
the new file's counters start above every number the old one recorded.

>>> import tempfile, pathlib
>>> folder = pathlib.Path(tempfile.mkdtemp())
>>> conn = sqlite3.connect(folder / "aser.db")
>>> _ = conn.execute("CREATE TABLE samples (seq INTEGER PRIMARY KEY AUTOINCREMENT, image BLOB)")
>>> _ = conn.executemany("INSERT INTO samples (image) VALUES (?)", [(bytes(3000),)] * 300)
>>> conn.commit(); conn.close()
>>> with open(folder / "aser.db", "r+b") as f:
...     _ = f.seek(40 * 4096); _ = f.write(bytes(4096))  # one page of rows zeroed
>>> report = salvage_database(folder / "aser.db")
>>> report.tables["samples"]["recovered"] < 300, report.tables["samples"]["highest"]
(True, 300)
>>> sqlite_damage(folder / "aser.db") is None, report.set_aside_as.startswith("aser.db.damaged-")
(True, True)
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass, field
from pathlib import Path

from service.storage.integrity import Damage, sqlite_damage

MISSES_PAST_THE_LAST = 10_000  # rowids probed past the last one read where the file names no highest


class SalvageFailed(Exception):
    """Nothing can be salvaged: the file's schema is unreadable."""


@dataclass
class SalvageReport:
    tables: dict[str, dict] = field(default_factory=dict)  # name -> recovered, highest rowid named, unreadable
    set_aside_as: str = ""

    def lines(self) -> list[str]:
        out = []
        for name, t in self.tables.items():
            missing = max(0, t["highest"] - t["recovered"]) if t["highest"] else 0
            out.append(f"{name}: {t['recovered']} rows recovered" + (f", up to rowid {t['highest']}" if t["highest"]
                                                                       else "") + (f" (at most {missing} lost)"
                                                                                   if missing else ""))
        return out


def salvage_database(damaged: Path, reason: str = "damaged") -> SalvageReport:
    """Copy what can be read of `damaged` into a new file, set `damaged` aside and put the new file in its place."""
    recovered = damaged.with_name(damaged.stem + "-recovered" + damaged.suffix)
    recovered.unlink(missing_ok=True)
    source = sqlite3.connect(damaged, isolation_level=None)
    target = sqlite3.connect(recovered, isolation_level=None)
    report = SalvageReport()
    try:
        source.execute("PRAGMA writable_schema=ON")  # a schema that does not parse whole still reads (and is not written)
        try:
            schema = source.execute("SELECT type, name, sql FROM sqlite_master WHERE sql IS NOT NULL "
                                    "AND name NOT LIKE 'sqlite_%'").fetchall()
        except sqlite3.DatabaseError as exc:
            raise SalvageFailed(f"{damaged}'s schema cannot be read ({exc}): nothing can be salvaged") from exc
        counters = _counters(source)
        target.execute("PRAGMA auto_vacuum=INCREMENTAL")  # as the service makes its files
        target.execute("BEGIN")
        for kind, name, sql in schema:
            if kind == "table":
                target.execute(sql)
                report.tables[name] = _copy_rows(source, target, name, counters.get(name))
        for kind, name, sql in schema:
            if kind != "table":  # indexes, triggers, views: built over the rows copied
                target.execute(sql)
        for name, seq in counters.items():
            if name in report.tables:
                target.execute("UPDATE sqlite_sequence SET seq = max(seq, ?) WHERE name = ?", (seq, name))
                target.execute("INSERT INTO sqlite_sequence (name, seq) SELECT ?, ? WHERE NOT EXISTS "
                               "(SELECT 1 FROM sqlite_sequence WHERE name = ?)", (name, seq, name))
        target.execute("COMMIT")
    finally:
        source.close()
        target.close()
    report.set_aside_as = Damage().set_aside(damaged, reason, "ingest_log",
                                             f"its readable rows are now {damaged.name}").name
    recovered.replace(damaged)
    return report


def _counters(source: sqlite3.Connection) -> dict[str, int]:
    """AUTOINCREMENT's highest numbers handed out, where the file can still say."""
    try:
        return {name: seq for name, seq in source.execute("SELECT name, seq FROM sqlite_sequence")}
    except sqlite3.DatabaseError:
        return {}


def _copy_rows(source: sqlite3.Connection, target: sqlite3.Connection, table: str, counter: int | None) -> dict:
    columns = [row[1] for row in source.execute(f'PRAGMA table_info("{table}")')]
    names = ", ".join(f'"{c}"' for c in columns)
    insert = f'INSERT INTO "{table}" (rowid, {names}) VALUES ({", ".join("?" * (len(columns) + 1))})'
    select = f'SELECT rowid, {names} FROM "{table}"'
    copied, last, unreadable = 0, 0, False
    try:
        for row in source.execute(select + " ORDER BY rowid"):
            target.execute(insert, row)
            copied, last = copied + 1, row[0]
    except sqlite3.DatabaseError:
        unreadable = True
    highest = max(counter or 0, _highest_rowid(source, table) or 0)
    if unreadable:  # past the damage, rowid by rowid: each probe descends the tree afresh
        top = highest or last + MISSES_PAST_THE_LAST
        rowid, misses = last, 0
        while rowid < top and (highest or misses < MISSES_PAST_THE_LAST):
            rowid += 1
            try:
                row = source.execute(select + " WHERE rowid = ?", (rowid,)).fetchone()
            except sqlite3.DatabaseError:
                row = None
            if row is None:
                misses += 1
                continue
            target.execute(insert, row)
            copied, misses = copied + 1, 0
    return {"recovered": copied, "highest": highest or last, "unreadable": unreadable}


def _highest_rowid(source: sqlite3.Connection, table: str) -> int | None:
    try:
        return source.execute(f'SELECT max(rowid) FROM "{table}"').fetchone()[0]
    except sqlite3.DatabaseError:
        return None


def recover_ingest_log(path: Path) -> int:
    """The command line's `recover-log`: salvage `path` if damaged; prints what came back. Returns an exit status."""
    reason = sqlite_damage(path)
    if reason is None:
        print(f"{path} is intact (or absent): nothing to recover")
        return 0
    try:
        report = salvage_database(path, reason)
    except SalvageFailed as exc:
        print(f"error: {exc}")
        return 1
    print(f"{path} was damaged ({reason}); set aside as {report.set_aside_as}, its readable rows copied into a new "
          f"{path.name}:")
    for line in report.lines():
        print("  " + line)
    return 0
