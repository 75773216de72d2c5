"""A learner service (or replica) run as a child process on a loopback port, for the load and
torture programs and the tests: start it, wait until ready, stop it, or kill it (SIGKILL).

>>> svc = LocalService("/tmp/aser-demo", {"ASER_MEM_SIZE": "50"}).start()   # doctest: +SKIP
>>> svc.url                                                                  # doctest: +SKIP
'http://127.0.0.1:41237'
>>> svc.kill(); svc.start(); svc.stop()                                      # doctest: +SKIP
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import httpx

from learner.data import held_out_by_number


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def real_jpegs(path: Path, n: int, split: str = "train", classes: list[str] | None = None) -> list[tuple[str, bytes]]:
    """The first n JPEGs of a split of CIFAR-10's zip or EuroSAT's (of the given classes, or all),
    as (class name, bytes), classes interleaved, each class's files in the order of their number."""
    with zipfile.ZipFile(path) as z:
        names = sorted((x for x in z.namelist() if x.endswith(".jpg") and split_of(x) == split), key=file_order)
        by_class: dict[str, list[str]] = {c: [] for c in classes or []}
        for x in names:
            if classes is None or x.split("/")[-2] in by_class:
                by_class.setdefault(x.split("/")[-2], []).append(x)
        rounds = min(n // len(by_class) + 1, max(map(len, by_class.values())))  # n may be "all" (a huge number)
        picked = [files[i] for i in range(rounds) for files in by_class.values() if i < len(files)][:n]
        return [(x.split("/")[-2], z.read(x)) for x in picked]


def split_of(name: str) -> str:
    """CIFAR-10's zip names its split; EuroSAT's ships none, and learner.data's rule for it holds."""
    if "/train/" in name or "/test/" in name:
        return "train" if "/train/" in name else "test"
    return "test" if held_out_by_number(file_number(name)) else "train"


def file_number(name: str) -> int:
    digits = re.search(r"(\d+)\.jpg$", name)
    return int(digits.group(1)) if digits else -1


def file_order(name: str) -> tuple[str, int, str]:
    return name.rsplit("/", 1)[0], file_number(name), name


class LocalService:
    def __init__(self, data_dir: str | Path, env: dict | None = None, module: str = "service",
                 port: int | None = None, ready_path: str = "/readyz", log_path: str | Path | None = None,
                 cwd: str | Path | None = None):
        self.data_dir, self.module, self.ready_path = Path(data_dir), module, ready_path
        self.cwd = cwd  # the checkout whose service runs (`python -m` imports from it first); None: this one
        self.port = port or free_port()
        self.env = {**os.environ, "ASER_DATA_DIR": str(self.data_dir), "ASER_PORT": str(self.port), **(env or {})}
        # the child's output, kept beside the data directory unless told otherwise
        self.log_path = Path(log_path) if log_path else self.data_dir.with_name(self.data_dir.name + ".log")
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 120) -> LocalService:
        """Start the process and wait until its readiness endpoint answers 200."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", self.module], env=self.env, stdout=log, stderr=log,
                                         cwd=self.cwd)
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                tail = self.log_path.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{self.module} exited with {self.proc.returncode}:\n{tail}")
            try:
                if httpx.get(self.url + self.ready_path, timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"{self.module} did not become ready in {timeout} s")

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL: no shutdown, no last checkpoint."""
        if self.running:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)

    def stop(self, timeout: float = 60) -> None:
        """SIGTERM: the service finishes its step, checkpoints and exits."""
        if self.running:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
