"""Files that are either whole or absent after a crash: written under a temporary name,
fsynced, renamed over the final name, and the rename itself fsynced."""

from __future__ import annotations

import os
from pathlib import Path


def replace_durably(tmp: Path, path: Path) -> None:
    """Make the finished file `tmp` durable and atomically give it the name `path`."""
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def write_durably(path: Path, data: bytes) -> None:
    """Write `data` to `path` so that a crash leaves the old file, or none, or the whole new one."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_bytes(data)
        replace_durably(tmp, path)
    except BaseException:  # a full disk, say: a half-written file must not eat the last free space
        tmp.unlink(missing_ok=True)
        raise
