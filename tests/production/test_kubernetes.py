"""kubernetes/: the kustomize overlays rendered with `kubectl kustomize` (kustomize is
built into kubectl) and checked without a cluster: every object against the Kubernetes
schemas (kubernetes-validate, strict), KEDA's objects against the fields of its CRDs
(written out below from KEDA's ScaledObject reference), and what the render says
against what the overlays ask for."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from binder.metrics import BinderMetrics
from binder.settings import BinderSettings
from gateway.server.metrics import GatewayMetrics
from gateway.server.search.binders import BinderClient
from gateway.server.settings import GatewaySettings

# The checkout's (not shipped in the package: applied from a checkout with kubectl).
KUBERNETES = Path(__file__).resolve().parents[2] / "kubernetes"
NAMESPACE = "triton-gateway"
# The oldest Kubernetes the manifests are meant for, and the newest the package knows.
VERSIONS = ["1.30", kubernetes_validate.utils.latest_version()]

# -- KEDA (keda.sh/v1alpha1): not in kubernetes-validate; the fields of its CRDs that a
# manifest may use (KEDA 2.x ScaledObject and TriggerAuthentication references).
_STRINGS = {"type": "object", "additionalProperties": {"type": "string"}}
_HPA_BEHAVIOR = {"type": "object"}  # autoscaling/v2 HPA behavior, checked by its own schema below
SCALED_OBJECT = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "keda.sh/v1alpha1"},
        "kind": {"const": "ScaledObject"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object",
            "required": ["scaleTargetRef", "triggers"],
            "additionalProperties": False,
            "properties": {
                "scaleTargetRef": {
                    "type": "object",
                    "required": ["name"],
                    "additionalProperties": False,
                    "properties": {
                        "apiVersion": {"type": "string"},
                        "kind": {"type": "string"},
                        "name": {"type": "string"},
                        "envSourceContainerName": {"type": "string"},
                    },
                },
                "pollingInterval": {"type": "integer", "minimum": 1},
                "cooldownPeriod": {"type": "integer", "minimum": 0},
                "initialCooldownPeriod": {"type": "integer", "minimum": 0},
                "idleReplicaCount": {"type": "integer", "minimum": 0},
                "minReplicaCount": {"type": "integer", "minimum": 0},
                "maxReplicaCount": {"type": "integer", "minimum": 1},
                "fallback": {
                    "type": "object",
                    "required": ["failureThreshold", "replicas"],
                    "additionalProperties": False,
                    "properties": {
                        "failureThreshold": {"type": "integer", "minimum": 1},
                        "replicas": {"type": "integer", "minimum": 0},
                        "behavior": {
                            "enum": ["static", "currentReplicas", "currentReplicasIfHigher", "currentReplicasIfLower"]
                        },
                    },
                },
                "advanced": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "restoreToOriginalReplicaCount": {"type": "boolean"},
                        "horizontalPodAutoscalerConfig": {
                            "type": "object",
                            "additionalProperties": False,
                            "properties": {"name": {"type": "string"}, "behavior": _HPA_BEHAVIOR},
                        },
                        "scalingModifiers": {"type": "object"},
                    },
                },
                "triggers": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "required": ["type", "metadata"],
                        "additionalProperties": False,
                        "properties": {
                            "type": {"type": "string"},
                            "name": {"type": "string"},
                            # KEDA's CRD: map[string]string; a bare number is refused.
                            "metadata": _STRINGS,
                            "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
                            "useCachedMetrics": {"type": "boolean"},
                            "authenticationRef": {
                                "type": "object",
                                "required": ["name"],
                                "additionalProperties": False,
                                "properties": {
                                    "name": {"type": "string"},
                                    "kind": {"enum": ["TriggerAuthentication", "ClusterTriggerAuthentication"]},
                                },
                            },
                        },
                    },
                },
            },
        },
    },
}
TRIGGER_AUTHENTICATION = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "keda.sh/v1alpha1"},
        "kind": {"const": "TriggerAuthentication"},
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "secretTargetRef": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["parameter", "name", "key"],
                        "additionalProperties": False,
                        "properties": {
                            "parameter": {"type": "string"},
                            "name": {"type": "string"},
                            "key": {"type": "string"},
                        },
                    },
                },
                "env": {"type": "array"},
            },
        },
    },
}
# Metadata each trigger type reads (KEDA's scaler references); anything else is a typo
# KEDA would ignore in silence.
TRIGGER_METADATA = {
    "prometheus": (
        {"serverAddress", "query", "threshold"},
        {"activationThreshold", "namespace", "customHeaders", "ignoreNullValues", "queryParameters", "unsafeSsl"},
    ),
    "cpu": ({"value"}, {"containerName"}),
    "redis-streams": (
        {"stream"},
        {"address", "host", "port", "addressFromEnv", "hostFromEnv", "portFromEnv", "usernameFromEnv"}
        | {"passwordFromEnv", "consumerGroup", "pendingEntriesCount", "streamLength", "lagCount"}
        | {"activationLagCount", "enableTLS", "unsafeSsl", "databaseIndex"},
    ),
}
KEDA_SCHEMAS = {"ScaledObject": SCALED_OBJECT, "TriggerAuthentication": TRIGGER_AUTHENTICATION}

# -- the Percona Operator for MongoDB (psmdb.percona.com/v1): the fields of its
# PerconaServerMongoDB that overlays/scale-out uses (from the operator's deploy/cr.yaml).
_RESOURCES = {
    "type": "object",
    "additionalProperties": False,
    "properties": {"requests": _STRINGS, "limits": _STRINGS},
}
_MEMBERS = {
    "type": "object",
    "required": ["size"],
    "properties": {
        "name": {"type": "string"},
        "size": {"type": "integer", "minimum": 1},
        "affinity": {
            "type": "object",
            "additionalProperties": False,
            "properties": {"antiAffinityTopologyKey": {"type": "string"}, "advanced": {"type": "object"}},
        },
        "podDisruptionBudget": {
            "type": "object",
            "additionalProperties": False,
            "properties": {"maxUnavailable": {"type": "integer"}, "minAvailable": {"type": "integer"}},
        },
        "resources": _RESOURCES,
        "volumeSpec": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "persistentVolumeClaim": {
                    "type": "object",
                    "properties": {"resources": {"type": "object"}, "storageClassName": {"type": "string"}},
                },
                "emptyDir": {"type": "object"},
            },
        },
        "expose": {
            "type": "object",
            "additionalProperties": False,
            "properties": {"enabled": {"type": "boolean"}, "type": {"type": "string"}},
        },
    },
    "additionalProperties": False,
}
PERCONA_SERVER_MONGODB = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "psmdb.percona.com/v1"},
        "kind": {"const": "PerconaServerMongoDB"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object",
            "required": ["crVersion", "image", "replsets"],
            "additionalProperties": False,
            "properties": {
                "crVersion": {"type": "string"},
                "image": {"type": "string"},
                "updateStrategy": {"enum": ["SmartUpdate", "RollingUpdate", "OnDelete"]},
                "secrets": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {"users": {"type": "string"}, "keyFile": {"type": "string"}},
                },
                "users": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["name", "db", "passwordSecretRef", "roles"],
                        "additionalProperties": False,
                        "properties": {
                            "name": {"type": "string"},
                            "db": {"type": "string"},
                            "passwordSecretRef": {
                                "type": "object",
                                "required": ["name", "key"],
                                "additionalProperties": False,
                                "properties": {"name": {"type": "string"}, "key": {"type": "string"}},
                            },
                            "roles": {
                                "type": "array",
                                "items": {
                                    "type": "object",
                                    "required": ["name", "db"],
                                    "additionalProperties": False,
                                    "properties": {"name": {"type": "string"}, "db": {"type": "string"}},
                                },
                            },
                        },
                    },
                },
                "replsets": {"type": "array", "minItems": 1, "items": {**_MEMBERS, "required": ["name", "size"]}},
                "sharding": {
                    "type": "object",
                    "required": ["enabled"],
                    "additionalProperties": False,
                    "properties": {
                        "enabled": {"type": "boolean"},
                        "configsvrReplSet": _MEMBERS,
                        "mongos": _MEMBERS,
                        "balancer": {"type": "object"},
                    },
                },
                "backup": {"type": "object", "properties": {"enabled": {"type": "boolean"}}},
            },
        },
    },
}
CUSTOM_SCHEMAS = {("psmdb.percona.com/v1", "PerconaServerMongoDB"): PERCONA_SERVER_MONGODB}


# -- rendering ---------------------------------------------------------------------------


def _kustomize_command() -> list[str]:
    kubectl = os.environ.get("KUBECTL") or shutil.which("kubectl")
    if kubectl:
        return [kubectl, "kustomize"]
    kustomize = shutil.which("kustomize")
    if kustomize:
        return [kustomize, "build"]
    pytest.skip("rendering needs kubectl (kustomize is built in) or kustomize on PATH")


def render(overlay: Path) -> list[dict[str, Any]]:
    result = subprocess.run(
        [*_kustomize_command(), str(overlay)], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


@pytest.fixture(scope="module")
def production() -> list[dict[str, Any]]:
    return render(KUBERNETES / "overlays" / "production")


@pytest.fixture(scope="module")
def fixed() -> list[dict[str, Any]]:
    return render(KUBERNETES / "overlays" / "fixed")


@pytest.fixture(scope="module")
def scale_out() -> list[dict[str, Any]]:
    return render(KUBERNETES / "overlays" / "scale-out")


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A copy of kubernetes/ to change values in."""
    copy = tmp_path / "kubernetes"
    shutil.copytree(KUBERNETES, copy)
    return copy


def one(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} rendered"
    return found[0]


def container(workload: dict[str, Any]) -> dict[str, Any]:
    return workload["spec"]["template"]["spec"]["containers"][0]


def config(docs: list[dict[str, Any]], workload: dict[str, Any]) -> dict[str, str]:
    """The environment a workload's first container gets from its ConfigMaps."""
    names = [source["configMapRef"]["name"] for source in container(workload).get("envFrom", [])]
    return {k: v for name in names for k, v in one(docs, "ConfigMap", name)["data"].items()}


def load(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def edit_yaml_documents(path: Path, change: Any) -> None:
    docs = list(yaml.safe_load_all(path.read_text()))
    for doc in docs:
        change(doc)
    path.write_text(yaml.safe_dump_all(docs, sort_keys=False))


# -- schemas -----------------------------------------------------------------------------


def validate(doc: dict[str, Any], version: str) -> None:
    custom = CUSTOM_SCHEMAS.get((doc["apiVersion"], doc["kind"]))
    if custom is not None:
        jsonschema.validate(doc, custom)
        return
    if doc["apiVersion"].startswith("keda.sh/"):
        jsonschema.validate(doc, KEDA_SCHEMAS[doc["kind"]])
        for trigger in doc["spec"].get("triggers", []):
            required, optional = TRIGGER_METADATA[trigger["type"]]
            keys = set(trigger["metadata"])
            assert required <= keys, f"{trigger['type']}: missing {required - keys}"
            assert keys <= required | optional, f"{trigger['type']}: unknown {keys - required - optional}"
        behavior = doc["spec"].get("advanced", {}).get("horizontalPodAutoscalerConfig", {}).get("behavior")
        if behavior is not None:  # the HPA's own field, by the Kubernetes schema
            hpa = {
                "apiVersion": "autoscaling/v2",
                "kind": "HorizontalPodAutoscaler",
                "metadata": {"name": "check"},
                "spec": {"scaleTargetRef": {"kind": "Deployment", "name": "x"}, "maxReplicas": 2, "behavior": behavior},
            }
            kubernetes_validate.validate(hpa, version, strict=True)
        return
    kubernetes_validate.validate(doc, version, strict=True)


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("overlay", ["production", "fixed", "scale-out"])
def test_every_rendered_object_validates_against_its_schema(overlay: str, version: str, request) -> None:
    docs = request.getfixturevalue(overlay.replace("-", "_"))
    assert len(docs) > 10
    for doc in docs:
        try:
            validate(doc, version)
        except (jsonschema.ValidationError, AssertionError) as exc:
            raise AssertionError(f"{doc['kind']}/{doc['metadata']['name']}: {exc}") from None


@pytest.mark.parametrize("example", sorted(p.name for p in (KUBERNETES / "examples").glob("*.yaml")))
def test_the_examples_validate_against_their_schemas(example: str) -> None:
    for doc in yaml.safe_load_all((KUBERNETES / "examples" / example).read_text()):
        validate(doc, VERSIONS[0])


def test_strict_validation_refuses_a_misspelt_field(production) -> None:
    gateway = one(production, "Deployment", "gateway")
    spec = gateway["spec"]["template"]["spec"]
    bad = {**gateway, "spec": {**gateway["spec"], "template": {**gateway["spec"]["template"], "spec": {**spec}}}}
    bad["spec"]["template"]["spec"]["terminationGracePeriod"] = 30
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(bad, VERSIONS[0])
    scaled = one(production, "ScaledObject", "binder")
    misspelt = {**scaled, "spec": {**scaled["spec"], "maxReplicas": 3}}
    with pytest.raises(jsonschema.ValidationError):
        validate(misspelt, VERSIONS[0])


# -- replica counts ------------------------------------------------------------------------


def _workload(docs: list[dict[str, Any]], name: str) -> dict[str, Any]:
    kind = "StatefulSet" if name == "binder" else "Deployment"
    return one(docs, kind, name)


def test_fixed_replica_counts_are_the_overlays(fixed) -> None:
    asked = {r["name"]: r["count"] for r in load(KUBERNETES / "overlays" / "fixed" / "kustomization.yaml")["replicas"]}
    assert set(asked) == {"triton", "gateway", "binder"}
    assert {name: _workload(fixed, name)["spec"]["replicas"] for name in asked} == asked


def test_changing_a_fixed_count_changes_the_render(tree: Path) -> None:
    path = tree / "overlays" / "fixed" / "kustomization.yaml"
    kustomization = load(path)
    wanted = {"triton": 5, "gateway": 7, "binder": 3}
    kustomization["replicas"] = [{"name": name, "count": count} for name, count in wanted.items()]
    path.write_text(yaml.safe_dump(kustomization, sort_keys=False))
    docs = render(path.parent)
    assert {name: _workload(docs, name)["spec"]["replicas"] for name in wanted} == wanted


def _scaled_objects(path: Path) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in yaml.safe_load_all(path.read_text()) if d["kind"] == "ScaledObject"}


def test_production_leaves_the_counts_to_keda_within_the_overlays_bounds(production) -> None:
    asked = _scaled_objects(KUBERNETES / "overlays" / "production" / "autoscaling.yaml")
    assert set(asked) == {"triton", "gateway", "binder"}
    for name, spec in asked.items():
        workload = _workload(production, name)
        # No spec.replicas: an apply must not reset what the autoscaler chose.
        assert "replicas" not in workload["spec"], name
        rendered = one(production, "ScaledObject", name)["spec"]
        target = rendered["scaleTargetRef"]
        assert (target["kind"], target["name"]) == (workload["kind"], workload["metadata"]["name"])
        bounds = (rendered["minReplicaCount"], rendered["maxReplicaCount"])
        assert bounds == (spec["spec"]["minReplicaCount"], spec["spec"]["maxReplicaCount"])
        assert 1 <= bounds[0] <= bounds[1]


def test_changing_the_autoscaling_bounds_changes_the_render(tree: Path) -> None:
    def change(doc: dict[str, Any]) -> None:
        if doc["kind"] == "ScaledObject" and doc["metadata"]["name"] == "triton":
            doc["spec"]["minReplicaCount"], doc["spec"]["maxReplicaCount"] = 3, 16
        if doc["kind"] == "ScaledObject" and doc["metadata"]["name"] == "gateway":
            doc["spec"]["maxReplicaCount"] = 40

    edit_yaml_documents(tree / "overlays" / "production" / "autoscaling.yaml", change)
    docs = render(tree / "overlays" / "production")
    assert one(docs, "ScaledObject", "triton")["spec"]["minReplicaCount"] == 3
    assert one(docs, "ScaledObject", "triton")["spec"]["maxReplicaCount"] == 16
    assert one(docs, "ScaledObject", "gateway")["spec"]["maxReplicaCount"] == 40


# -- Triton -----------------------------------------------------------------------------


def _gpus(triton: dict[str, Any]) -> tuple[Any, Any]:
    resources = container(triton)["resources"]
    return resources["requests"]["nvidia.com/gpu"], resources["limits"]["nvidia.com/gpu"]


def test_each_triton_replica_gets_the_gpus_the_overlay_gives(production, fixed) -> None:
    patch = load(KUBERNETES / "overlays" / "production" / "triton-resources.yaml")
    asked = patch["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]
    assert _gpus(one(production, "Deployment", "triton")) == (asked, asked)
    assert _gpus(one(fixed, "Deployment", "triton")) == (1, 1)  # the base: one GPU each


def test_changing_the_gpus_per_replica_changes_the_render(tree: Path) -> None:
    path = tree / "overlays" / "production" / "triton-resources.yaml"
    patch = load(path)
    resources = patch["spec"]["template"]["spec"]["containers"][0]["resources"]
    resources["requests"]["nvidia.com/gpu"] = resources["limits"]["nvidia.com/gpu"] = 2
    path.write_text(yaml.safe_dump(patch, sort_keys=False))
    assert _gpus(one(render(path.parent), "Deployment", "triton")) == (2, 2)


def _port(spec: dict[str, Any], name_or_number: Any) -> int:
    if isinstance(name_or_number, int):
        return name_or_number
    return next(p["containerPort"] for p in spec["ports"] if p["name"] == name_or_number)


def test_triton_is_ready_when_its_models_are_and_has_shared_memory_and_the_model_store(production) -> None:
    triton = one(production, "Deployment", "triton")
    spec = container(triton)
    for probe in ("readinessProbe", "startupProbe"):
        check = spec[probe]["httpGet"]
        assert (check["path"], _port(spec, check["port"])) == ("/v2/health/ready", 8000)
    assert spec["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
    assert "--http-port=8000" in spec["command"] and "--grpc-port=8001" in spec["command"]

    volumes = {v["name"]: v for v in triton["spec"]["template"]["spec"]["volumes"]}
    mounts = {m["mountPath"]: m for m in spec["volumeMounts"]}
    assert volumes[mounts["/dev/shm"]["name"]]["emptyDir"]["medium"] == "Memory"
    store = {path: (m["name"], m.get("subPath"), m.get("readOnly")) for path, m in mounts.items() if path != "/dev/shm"}
    assert store == {
        "/models": ("model-store", "model_repo", True),
        "/engines": ("model-store", "engines", True),
        "/hf": ("model-store", "hf", True),
    }
    claim = volumes["model-store"]["persistentVolumeClaim"]["claimName"]
    assert one(production, "PersistentVolumeClaim", claim)["spec"]["accessModes"] == ["ReadWriteMany"]


def test_gateways_find_triton_replicas_through_the_headless_service(production) -> None:
    env = config(production, one(production, "Deployment", "gateway"))
    service = one(production, "Service", env["TRITON_DNS_NAME"])
    triton = one(production, "Deployment", "triton")
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"].get("publishNotReadyAddresses", False) is False
    pod_labels = triton["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    grpc = next(p for p in service["spec"]["ports"] if p["port"] == int(env["TRITON_DNS_PORT"]))
    assert _port(container(triton), grpc["targetPort"]) == 8001
    assert float(env["DISCOVERY_INTERVAL_S"]) > 0


# -- gateways and binders -----------------------------------------------------------------


def _sleep_s(spec: dict[str, Any]) -> int:
    command = spec["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    return int(command[1])


def test_a_stopping_gateway_has_time_to_drain_and_hand_over(production) -> None:
    gateway = one(production, "Deployment", "gateway")
    drain_s = float(config(production, gateway)["DRAIN_S"])
    # preStop, then uvicorn's graceful close (DRAIN_S + 5), then the dispatcher's drain.
    needed = _sleep_s(container(gateway)) + (drain_s + 5) + drain_s
    assert gateway["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > needed
    pdb = one(production, "PodDisruptionBudget", "gateway")
    labels = gateway["spec"]["template"]["metadata"]["labels"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert pdb["spec"]["maxUnavailable"] == 1
    assert container(gateway)["readinessProbe"]["httpGet"]["path"] == "/healthz"


def test_binders_are_a_statefulset_with_a_snapshot_volume_each(production) -> None:
    binder = one(production, "StatefulSet", "binder")
    spec = container(binder)
    claims = {t["metadata"]["name"] for t in binder["spec"]["volumeClaimTemplates"]}
    mounts = {m["name"]: m["mountPath"] for m in spec["volumeMounts"]}
    assert mounts[claims.pop()] == config(production, binder)["FAISS_DIR"] and not claims
    name = next(e for e in spec["env"] if e["name"] == "BINDER_NAME")
    assert name["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert binder["spec"]["persistentVolumeClaimRetentionPolicy"]["whenScaled"] == "Retain"
    gateway_env = config(production, one(production, "Deployment", "gateway"))
    service = one(production, "Service", "binder")
    for url in gateway_env["BINDER_URLS"].split(","):
        host, port = url.removeprefix("http://").split(":")
        assert (host, int(port)) == ("binder", service["spec"]["ports"][0]["port"])


def test_every_config_and_secret_reference_resolves(production) -> None:
    secret = load(KUBERNETES / "examples" / "secret.example.yaml")
    for doc in production:
        for c in doc.get("spec", {}).get("template", {}).get("spec", {}).get("containers", []):
            for source in c.get("envFrom", []):
                one(production, "ConfigMap", source["configMapRef"]["name"])
            for var in c.get("env", []):
                ref = var.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["name"] == secret["metadata"]["name"]
                    assert ref["key"] in secret["stringData"], ref


# -- the front door --------------------------------------------------------------------------


INGRESS_PATHS = {"gateway-api": ("/", "Prefix", "8m"), "gateway-files": ("/v1/files", "Exact", "201m")}


@pytest.mark.parametrize("name", sorted(INGRESS_PATHS))
def test_the_ingress_is_safe_for_server_sent_events(production, name: str) -> None:
    ingress = one(production, "Ingress", name)
    notes = ingress["metadata"]["annotations"]
    assert notes["nginx.ingress.kubernetes.io/proxy-buffering"] == "off"
    assert int(notes["nginx.ingress.kubernetes.io/proxy-read-timeout"]) >= 3600
    assert int(notes["nginx.ingress.kubernetes.io/proxy-send-timeout"]) >= 3600
    assert notes["nginx.org/proxy-buffering"] == "False"
    [path] = ingress["spec"]["rules"][0]["http"]["paths"]
    backend = path["backend"]["service"]
    service = one(production, "Service", backend["name"])
    assert backend["port"]["name"] in {p["name"] for p in service["spec"]["ports"]}


def test_only_file_uploads_pass_the_ingress_with_bodies_over_8_mib(production) -> None:
    files_limit = GatewaySettings.model_fields["max_file_bytes"].default + (1 << 20)  # the gateway's, with the form
    limits = {"gateway-api": "8m", "gateway-files": f"{files_limit >> 20}m"}
    assert INGRESS_PATHS["gateway-files"][2] == limits["gateway-files"]
    for name, (route, kind, size) in INGRESS_PATHS.items():
        ingress = one(production, "Ingress", name)
        notes = ingress["metadata"]["annotations"]
        assert notes["nginx.ingress.kubernetes.io/proxy-body-size"] == notes["nginx.org/client-max-body-size"] == size
        [path] = ingress["spec"]["rules"][0]["http"]["paths"]
        assert (path["path"], path["pathType"]) == (route, kind)
        assert notes["nginx.org/mergeable-ingress-type"] == "minion" and "tls" not in ingress["spec"]


def test_the_ingresses_serve_one_host_with_tls_on_the_master(production) -> None:
    master = one(production, "Ingress", "gateway")
    assert master["metadata"]["annotations"]["nginx.org/mergeable-ingress-type"] == "master"
    assert "http" not in master["spec"]["rules"][0]  # F5's master holds no paths
    host = master["spec"]["rules"][0]["host"]
    assert master["spec"]["tls"][0]["hosts"] == [host]
    ingresses = [doc for doc in production if doc["kind"] == "Ingress"]
    assert {doc["metadata"]["name"] for doc in ingresses} == {"gateway", *INGRESS_PATHS}
    assert {doc["spec"]["rules"][0]["host"] for doc in ingresses} == {host}


# -- network policies ------------------------------------------------------------------------


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    assert "matchExpressions" not in selector  # not evaluated here
    return selector.get("matchLabels", {}).items() <= labels.items()


def _peer_admits(peer: dict[str, Any], namespace: str, labels: dict[str, str]) -> bool:
    if "ipBlock" in peer:
        return False
    if "namespaceSelector" in peer:
        namespace_ok = _selects(peer["namespaceSelector"], {"kubernetes.io/metadata.name": namespace})
    else:
        namespace_ok = namespace == NAMESPACE
    return namespace_ok and ("podSelector" not in peer or _selects(peer["podSelector"], labels))


def allowed(
    policies: list[dict[str, Any]], source: tuple[str, dict[str, str]], target: dict[str, str], port: int
) -> bool:
    """Whether NetworkPolicy semantics let `source` (namespace, pod labels) open a TCP
    connection to a pod of this namespace labelled `target` on `port`."""
    isolating = [
        p
        for p in policies
        if _selects(p["spec"]["podSelector"], target) and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
    ]
    if not isolating:
        return True
    for policy in isolating:
        for rule in policy["spec"].get("ingress", []):
            if "ports" in rule and not any(p["port"] == port for p in rule["ports"]):
                continue
            if "from" not in rule or any(_peer_admits(peer, *source) for peer in rule["from"]):
                return True
    return False


def test_network_policies_allow_only_the_intended_connections(production) -> None:
    policies = [d for d in production if d["kind"] == "NetworkPolicy"]
    assert {p["metadata"]["namespace"] for p in policies} == {NAMESPACE}

    def pod(name: str) -> dict[str, str]:
        return _workload(production, name)["spec"]["template"]["metadata"]["labels"]

    redis, mongodb = {"app.kubernetes.io/component": "redis"}, {"app.kubernetes.io/component": "mongodb"}
    sources = {
        "gateway": (NAMESPACE, pod("gateway")),
        "binder": (NAMESPACE, pod("binder")),
        "triton": (NAMESPACE, pod("triton")),
        "redis": (NAMESPACE, redis),
        "mongodb": (NAMESPACE, mongodb),
        "other pod": (NAMESPACE, {"app": "debug"}),
        "ingress": ("ingress-nginx", {"app.kubernetes.io/name": "ingress-nginx"}),
        "prometheus": ("monitoring", {"app.kubernetes.io/name": "prometheus"}),
        "keda": ("keda", {"app.kubernetes.io/name": "keda-operator"}),
        "keda webhooks": ("keda", {"app.kubernetes.io/name": "keda-admission-webhooks"}),
        "elsewhere": ("default", {"app.kubernetes.io/component": "gateway"}),
    }
    targets = {
        ("triton", 8000): pod("triton"),
        ("triton", 8001): pod("triton"),
        ("triton", 8002): pod("triton"),
        ("binder", 8090): pod("binder"),
        ("gateway", 8080): pod("gateway"),
        ("redis", 6379): redis,
        ("redis", 16379): redis,
        ("mongodb", 27017): mongodb,
    }
    expected = {
        ("gateway", "triton", 8001),
        ("gateway", "triton", 8002),
        ("prometheus", "triton", 8002),
        ("gateway", "binder", 8090),
        ("prometheus", "binder", 8090),
        ("ingress", "gateway", 8080),
        ("prometheus", "gateway", 8080),
        ("gateway", "redis", 6379),
        ("binder", "redis", 6379),
        ("redis", "redis", 6379),
        ("redis", "redis", 16379),
        ("gateway", "mongodb", 27017),
        ("binder", "mongodb", 27017),
        ("mongodb", "mongodb", 27017),
    }
    got = {
        (source, target, port)
        for source, peer in sources.items()
        for (target, port), labels in targets.items()
        if allowed(policies, peer, labels, port)
    }
    assert got == expected


# -- autoscaling signals ------------------------------------------------------------------------


def test_the_scalers_read_the_signals_the_services_publish(production) -> None:
    # Binders: the group's lag and pending entries over every shard's results stream, as
    # the binders report them (the same from every binder, hence max).
    binder_metrics = {m.name for m in BinderMetrics(stored=lambda: 0).registry.collect()}
    binder = {t["name"]: t["metadata"]["query"] for t in one(production, "ScaledObject", "binder")["spec"]["triggers"]}
    assert binder == {
        "results_lag": 'max(binder_results_lag{namespace="triton-gateway"})',
        "results_pending": 'max(binder_results_pending{namespace="triton-gateway"})',
    }
    assert {"binder_results_lag", "binder_results_pending"} <= binder_metrics
    annotations = one(production, "StatefulSet", "binder")["spec"]["template"]["metadata"]["annotations"]
    assert (annotations["prometheus.io/scrape"], annotations["prometheus.io/port"]) == ("true", "8090")

    gateway_metrics = {m.name for m in GatewayMetrics().registry.collect()}
    backlog = next(t for t in one(production, "ScaledObject", "gateway")["spec"]["triggers"] if t["name"] == "backlog")
    assert "gateway_backlog" in gateway_metrics
    assert backlog["metadata"]["query"].startswith("max(gateway_backlog{")  # one Redis-wide number

    triton = {t["name"]: t for t in one(production, "ScaledObject", "triton")["spec"]["triggers"]}
    assert "nv_inference_queue_duration_us" in triton["queue_time"]["metadata"]["query"]
    assert 'kv_cache_block_type="fraction"' in triton["kv_cache"]["metadata"]["query"]
    # Averages, not totals: Value, so KEDA does not divide them by the replica count.
    assert {t["metricType"] for t in triton.values()} == {"Value"}


# -- past one node (overlays/scale-out): Redis Cluster, sharded MongoDB, index partitions -------


def _hosts(value: str) -> list[tuple[str, int]]:
    found = []
    for address in value.split(","):
        host, _, port = address.removeprefix("http://").rpartition(":")
        found.append((host, int(port)))
    return found


def test_scale_out_runs_the_queues_on_a_redis_cluster_with_a_replica_per_primary(scale_out) -> None:
    redis = one(scale_out, "StatefulSet", "redis")
    nodes = redis["spec"]["replicas"]
    bootstrap = container(one(scale_out, "Job", "redis-cluster-bootstrap"))
    script = bootstrap["args"][0]
    assert {e["name"]: e.get("value") for e in bootstrap["env"]}["NODES"] == str(nodes)
    assert "--cluster create" in script and "--cluster-replicas 1" in script
    primaries = nodes // 2
    conf = one(scale_out, "ConfigMap", "redis-cluster-config")["data"]["redis.conf"]
    settings = dict(line.split(None, 1) for line in conf.splitlines() if line and not line.startswith("#"))
    assert settings["cluster-enabled"] == "yes" and settings["appendonly"] == "yes"
    assert settings["maxmemory-policy"] == "noeviction"
    assert settings["cluster-require-full-coverage"] == "no"  # one shard down leaves the others serving
    headless = one(scale_out, "Service", redis["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is True
    assert {p["port"] for p in headless["spec"]["ports"]} == {6379, 16379}
    pods = {f"redis-{n}.{headless['metadata']['name']}" for n in range(nodes)}
    for workload in (one(scale_out, "Deployment", "gateway"), one(scale_out, "StatefulSet", "binder")):
        env = config(scale_out, workload)
        assert set(_hosts(env["REDIS_CLUSTER_NODES"])) <= {(pod, 6379) for pod in pods}
        # Enough shards to spread the tenants over every primary (and over more later).
        assert int(env["REDIS_SHARDS"]) >= 8 * primaries
    gateway = config(scale_out, one(scale_out, "Deployment", "gateway"))
    assert gateway["REDIS_SHARDS"] == config(scale_out, one(scale_out, "StatefulSet", "binder"))["REDIS_SHARDS"]
    assert 1 <= int(gateway["REDIS_WAIT_REPLICAS"]) <= nodes // primaries - 1  # a replica each to wait for
    assert one(scale_out, "PodDisruptionBudget", "redis")["spec"]["maxUnavailable"] == 1


def test_scale_out_keeps_the_results_on_a_mongodb_shard_per_replica_set_sharded_by_request_id(scale_out) -> None:
    cluster = one(scale_out, "PerconaServerMongoDB", "mongodb")["spec"]
    assert len(cluster["replsets"]) >= 2 and {rs["size"] for rs in cluster["replsets"]} == {3}
    sharding = cluster["sharding"]
    assert sharding["enabled"] is True and sharding["configsvrReplSet"]["size"] == 3
    assert sharding["mongos"]["size"] >= 2
    job = container(one(scale_out, "Job", "mongodb-shard-results"))
    database = next(e["value"] for e in job["env"] if e["name"] == "DATABASE")
    script = job["args"][0]
    assert "sh.shardCollection(name + '.results', {_id: 'hashed'})" in script
    assert f"--host {one(scale_out, 'PerconaServerMongoDB', 'mongodb')['metadata']['name']}-mongos" in script
    assert database == "triton_gateway"  # the gateways' MONGO_DB default
    user = next(u for u in cluster["users"] if u["name"] == "gateway")
    assert user["roles"] == [{"name": "readWrite", "db": database}]


def test_scale_out_splits_the_index_over_binders_and_gateways_ask_the_tenants_binder(scale_out) -> None:
    binder = one(scale_out, "StatefulSet", "binder")
    gateway_env = config(scale_out, one(scale_out, "Deployment", "gateway"))
    partitions = int(gateway_env["INDEX_PARTITIONS"])
    assert partitions > 1 and config(scale_out, binder)["INDEX_PARTITIONS"] == str(partitions)
    count = binder["spec"]["replicas"]  # fixed: the gateways name each binder
    assert count % partitions == 0 and count // partitions >= 2  # a spare binder per partition
    assert not [d for d in scale_out if d["kind"] == "ScaledObject" and d["metadata"]["name"] == "binder"]
    urls = gateway_env["BINDER_URLS"].split(",")
    assert _hosts(gateway_env["BINDER_URLS"]) == [(f"binder-{n}.binder-headless", 8090) for n in range(count)]
    client = BinderClient(urls, http=None, partitions=partitions)  # type: ignore[arg-type]
    for n, url in enumerate(urls):  # binder-n's own partition is where the gateways look for its tenants
        held = BinderSettings(binder_name=f"binder-{n}", index_partitions=partitions).index_partition
        assert held is not None and url in client.holders[held]


def test_scale_out_network_policies_admit_the_cluster_bus_and_the_operators_mongodb(scale_out) -> None:
    policies = [d for d in scale_out if d["kind"] == "NetworkPolicy"]

    def pod(kind: str, name: str) -> dict[str, str]:
        return one(scale_out, kind, name)["spec"]["template"]["metadata"]["labels"]

    redis = pod("StatefulSet", "redis")
    mongod = {"app.kubernetes.io/name": "percona-server-mongodb", "app.kubernetes.io/instance": "mongodb"}
    operator = {"app.kubernetes.io/name": "percona-server-mongodb-operator"}
    sources = {
        "gateway": (NAMESPACE, pod("Deployment", "gateway")),
        "binder": (NAMESPACE, pod("StatefulSet", "binder")),
        "redis": (NAMESPACE, redis),
        "redis bootstrap": (NAMESPACE, pod("Job", "redis-cluster-bootstrap")),
        "mongod": (NAMESPACE, mongod),
        "operator": (NAMESPACE, operator),
        "shard job": (NAMESPACE, pod("Job", "mongodb-shard-results")),
        "other pod": (NAMESPACE, {"app": "debug"}),
    }
    targets = {("redis", 6379): redis, ("redis", 16379): redis, ("mongod", 27017): mongod}
    got = {
        (source, target, port)
        for source, peer in sources.items()
        for (target, port), labels in targets.items()
        if allowed(policies, peer, labels, port)
    }
    assert got == {
        ("gateway", "redis", 6379),
        ("binder", "redis", 6379),
        ("redis", "redis", 6379),
        ("redis", "redis", 16379),
        ("redis bootstrap", "redis", 6379),
        ("redis bootstrap", "redis", 16379),
        ("gateway", "mongod", 27017),
        ("binder", "mongod", 27017),
        ("mongod", "mongod", 27017),
        ("operator", "mongod", 27017),
        ("shard job", "mongod", 27017),
    }


def test_scale_out_secret_references_resolve_to_the_documented_secrets(scale_out) -> None:
    documented = {
        "triton-gateway": set(load(KUBERNETES / "examples" / "secret.example.yaml")["stringData"]),
        "triton-gateway-mongodb": set(load(KUBERNETES / "examples" / "mongodb-secret.example.yaml")["stringData"]),
        # Made by the operator (its system users).
        "mongodb-users": {"MONGODB_CLUSTER_ADMIN_USER", "MONGODB_CLUSTER_ADMIN_PASSWORD"},
    }
    for doc in scale_out:
        for c in doc.get("spec", {}).get("template", {}).get("spec", {}).get("containers", []):
            for var in c.get("env", []):
                ref = var.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["key"] in documented[ref["name"]], ref
    for user in one(scale_out, "PerconaServerMongoDB", "mongodb")["spec"]["users"]:
        ref = user["passwordSecretRef"]
        assert ref["key"] in documented[ref["name"]], ref
