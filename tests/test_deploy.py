"""The deployment files agree with the code: every ASER_* variable they set is a setting, every
command is a module that exists, the images install what the project declares, and the replica
serves with its own requirements alone. (scripts/test-deploy.sh builds and runs them.)"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import time

import httpx
import yaml

from clients.bench.live.local_service import free_port
from service.settings import Settings

from .conftest import ROOT


def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def test_compose_settings_and_commands_exist():
    services = compose()["services"]
    assert {"learner", "replica"} <= set(services)
    fields = set(Settings.model_fields)
    for name, svc in services.items():
        for var in svc.get("environment", {}):
            assert var.startswith("ASER_") and var[5:].lower() in fields, f"{name}: {var} is no setting"
        module = svc["command"][-1]
        assert importlib.util.find_spec(module) is not None, f"{name}: no module {module}"
    # the learner's state survives the container; the replica keeps none
    assert any(v.endswith(":/data") for v in services["learner"]["volumes"])
    assert services["replica"].get("read_only") is True and "volumes" not in services["replica"]
    assert services["replica"]["environment"]["ASER_REPLICA_SOURCE"].startswith("http://learner:")


def test_dockerfile_copies_the_packages_and_pins_torch():
    text = (ROOT / "deploy" / "Dockerfile").read_text()
    for package in ("learner", "service", "clients"):
        assert re.search(rf"^COPY {package} {package}$", text, re.M), package
    pinned = re.search(r'"torch==([\d.]+)"', (ROOT / "pyproject.toml").read_text()).group(1)
    assert f"torch=={pinned}" in text
    assert "ASER_DATA_DIR=/data" in text and 'CMD ["python", "-m", "service"]' in text


def project_name(requirement: str) -> str:
    return re.split(r"[<>=!~ ;\[]", requirement, maxsplit=1)[0].lower()


def pyproject_dependencies() -> dict[str, str]:
    import tomllib

    specs = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return {project_name(s): s for s in specs}


def replica_requirements() -> list[str]:
    lines = (ROOT / "deploy" / "replica-requirements.txt").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def test_the_replica_requirements_are_the_projects_own():
    declared = set(pyproject_dependencies().values())
    assert set(replica_requirements()) <= declared
    assert "torch==" not in " ".join(replica_requirements())


def test_the_replica_serves_with_only_its_requirements_installed(tmp_path):
    """Every dependency the replica image leaves out is made unimportable, and `python -m
    service.replica` must still serve on loopback: refuse a request without its token, and
    answer that it has no snapshot yet."""
    mine = {project_name(r) for r in replica_requirements()}
    left_out = {name.replace("-", "_") for name in set(pyproject_dependencies()) - mine}
    assert {"torch", "onnx", "sqlite_utils"} <= left_out
    absent = left_out | {"scipy", "tqdm", "matplotlib"}  # and the bench extra
    port = free_port()
    launcher = (f"import runpy, sys; sys.modules.update(dict.fromkeys({sorted(absent)!r})); "
                "runpy.run_module('service.replica', run_name='__main__')")
    env = {**os.environ, "ASER_PORT": str(port), "ASER_READ_TOKEN": "r", "ASER_REPLICA_SOURCE": "http://127.0.0.1:9"}
    replica = subprocess.Popen([sys.executable, "-c", launcher], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 60
        while replica.poll() is None and time.time() < deadline:
            try:
                ready = httpx.get(f"http://127.0.0.1:{port}/readyz")
                break
            except httpx.TransportError:
                time.sleep(0.2)
        assert replica.poll() is None, replica.stdout.read()[-3000:]
        assert ready.status_code == 503 and ready.json()["status"] == "not ready"
        assert httpx.get(f"http://127.0.0.1:{port}/status").status_code == 401
    finally:
        replica.terminate()
        replica.wait(30)
