"""The deployment files agree with the code: every ASER_* variable they set is a setting, every
command is a module that exists, and the image installs what the project declares."""

from __future__ import annotations

import importlib.util
import re

import yaml

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
