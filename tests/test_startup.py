"""`python -m service` as a newcomer meets it (issue 39, item 5): a real `--help`, bad settings as
one line naming the variable and exit status 2 before anything opens, and a log that says what
the learner is and where it resumed."""

import os
import socket
import subprocess
import sys

import httpx
import pytest

from service.settings import Settings

from .conftest import ROOT
from .test_service import Server, wait_trained


def run_service(tmp_path, *args, **env):
    environment = {k: v for k, v in os.environ.items() if not k.startswith("ASER_")}
    environment |= {"ASER_DATA_DIR": str(tmp_path / "data"), "PYTHONPATH": str(ROOT), **env}
    return subprocess.run([sys.executable, "-m", "service", *args], env=environment, capture_output=True,
                          text=True, timeout=120, cwd=tmp_path)


def test_help_lists_every_setting_and_starts_nothing(tmp_path):
    done = run_service(tmp_path, "--help")
    assert done.returncode == 0
    for name in Settings.model_fields:
        assert f"ASER_{name.upper()}" in done.stdout
    assert "default 'cb-sv-duel'" in done.stdout and not (tmp_path / "data").exists()


@pytest.mark.parametrize("env,names", [
    ({"ASER_MEM_SIZE": "abc"}, "ASER_MEM_SIZE"),
    ({"ASER_READ_TOKEN": "r"}, "ASER_READ_TOKEN"),
    ({"ASER_METHOD": "icarl"}, "ASER_METHOD"),
    ({"ASER_HOST": "0.0.0.0"}, "ASER_WRITE_TOKEN"),
])
def test_a_bad_setting_is_one_line_and_exit_2_before_anything_opens(tmp_path, env, names):
    done = run_service(tmp_path, **env)
    assert done.returncode == 2 and names in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr
    assert not (tmp_path / "data").exists()


def test_a_port_in_use_is_one_line(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        done = run_service(tmp_path, ASER_PORT=str(taken.getsockname()[1]))
    assert done.returncode == 2 and "ASER_PORT" in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_the_log_says_what_learns_and_where_it_resumed(tmp_path, jpegs):
    server = Server(tmp_path, checkpoint_every_steps=1, batch_size=10).start()
    try:
        files = [("image", (f"{i}.jpg", img, "image/jpeg")) for i, (_, img) in enumerate(jpegs[10:30])]
        labels = [lab for lab, _ in jpegs[10:30]]  # 10 airplanes, 10 frogs
        assert httpx.post(f"{server.url}/samples", files=files, data={"label": labels}).status_code == 201
        wait_trained(server, 20)
    finally:
        server.stop()
    first = server.log_path.read_text()
    assert "learner: cb-sv-duel" in first and "M=50" in first and "a new lineage" in first
    assert "new class 'airplane'" in first and "new class 'frog'" in first and "snapshot 1: " in first
    server = Server(tmp_path, checkpoint_every_steps=1, batch_size=10).start()
    server.stop()
    assert "resumed from a checkpoint at sample 20" in server.log_path.read_text()
