"""The Kubernetes manifests validate against the Kubernetes schemas (kubernetes-validate,
strict: no unknown field) and describe the topology the service needs."""

from __future__ import annotations

import copy

import kubernetes_validate
import pytest
import yaml

from service.settings import Settings

from .conftest import ROOT

MANIFESTS = ROOT / "deploy" / "kubernetes"
# the oldest release still supported upstream when written, and the newest the validator knows
VERSIONS = ["1.31.0", kubernetes_validate.latest_version()]


def kustomization() -> dict:
    return yaml.safe_load((MANIFESTS / "kustomization.yaml").read_text())


def resources() -> list[dict]:
    return [doc for name in kustomization()["resources"]
            for doc in yaml.safe_load_all((MANIFESTS / name).read_text()) if doc]


def the(kind: str, component: str | None = None) -> dict:
    found = [r for r in resources() if r["kind"] == kind
             and (component is None or r["metadata"]["labels"].get("app.kubernetes.io/component") == component)]
    assert len(found) == 1, f"{len(found)} {kind} {component or ''}"
    return found[0]


def container(workload: dict) -> dict:
    (c,) = workload["spec"]["template"]["spec"]["containers"]
    return c


@pytest.mark.parametrize("version", VERSIONS)
def test_every_manifest_passes_strict_schema_validation(version):
    for resource in resources():
        kubernetes_validate.validate(resource, version, strict=True)


def test_the_validation_catches_a_misspelt_field():
    learner = copy.deepcopy(the("StatefulSet"))
    container(learner)["readinesProbe"] = container(learner).pop("readinessProbe")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(learner, VERSIONS[-1], strict=True)


def test_the_kustomization_applies_every_manifest():
    listed = set(kustomization()["resources"])
    assert listed == {p.name for p in MANIFESTS.glob("*.yaml")} - {"kustomization.yaml"}


def test_one_learner_with_a_volume_and_probes():
    learner = the("StatefulSet")
    assert learner["spec"]["replicas"] == 1  # the only writer of its SQLite log
    (claim,) = learner["spec"]["volumeClaimTemplates"]
    c = container(learner)
    assert c["command"] == ["python", "-m", "service"]
    assert {"name": claim["metadata"]["name"], "mountPath": "/data"} in c["volumeMounts"]
    assert c["envFrom"] == [{"secretRef": {"name": "aser-tokens"}}]
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz" and c["livenessProbe"]["httpGet"]["path"] == "/healthz"


def test_replicas_follow_the_learner_service_and_scale():
    replica, learner_service = the("Deployment"), the("Service", "learner")
    c = container(replica)
    env = {e["name"]: e for e in c["env"]}
    assert c["command"] == ["python", "-m", "service.replica"]
    port = learner_service["spec"]["ports"][0]["port"]
    assert env["ASER_REPLICA_SOURCE"]["value"] == f"http://{learner_service['metadata']['name']}:{port}"
    for name in ("ASER_READ_TOKEN", "ASER_REPLICA_SOURCE_TOKEN"):
        assert env[name]["valueFrom"]["secretKeyRef"] == {"name": "aser-tokens", "key": "ASER_READ_TOKEN"}
    assert "ASER_WRITE_TOKEN" not in env and "ASER_ADMIN_TOKEN" not in env and "envFrom" not in c
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    hpa = the("HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                             "name": replica["metadata"]["name"]}
    assert 1 < hpa["spec"]["minReplicas"] < hpa["spec"]["maxReplicas"]


def test_services_select_their_pods_and_every_container_is_sized():
    for component, workload in (("learner", the("StatefulSet")), ("replica", the("Deployment"))):
        pods = workload["spec"]["template"]["metadata"]["labels"]
        assert workload["spec"]["selector"]["matchLabels"].items() <= pods.items()
        assert the("Service", component)["spec"]["selector"].items() <= pods.items()
        c = container(workload)
        assert {"cpu", "memory"} <= c["resources"]["requests"].keys() and "memory" in c["resources"]["limits"]
        assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"http": Settings.model_fields["port"].default}
        fields = set(Settings.model_fields)
        for var in c.get("env", []):
            assert var["name"].startswith("ASER_") and var["name"][5:].lower() in fields, var["name"]
