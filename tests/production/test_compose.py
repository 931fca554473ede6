"""compose/: the generated docker-compose.yml, validated against the Compose Specification."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import yaml
from typer.testing import CliRunner

from gateway.deploy import ToolError
from gateway.deploy.cli import app
from gateway.deploy.compose import COMPOSE_FILE, DEPLOYMENT_FILE, Deployment, dump, generate

SCHEMA = json.loads((Path(__file__).parent / "data" / "compose-spec.json").read_text())


def _committed() -> dict:
    return yaml.safe_load(COMPOSE_FILE.read_text())


def _tritons(compose: dict) -> dict[str, dict]:
    return {name: s for name, s in compose["services"].items() if name.startswith("triton-")}


def _validate(compose: dict) -> None:
    validator = jsonschema.validators.validator_for(SCHEMA)(SCHEMA)
    errors = sorted(validator.iter_errors(compose), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{list(e.path)}: {e.message}" for e in errors)


def test_committed_compose_file_validates_against_the_compose_spec() -> None:
    _validate(_committed())


def test_committed_compose_file_is_what_deployment_toml_generates() -> None:
    assert COMPOSE_FILE.read_text() == dump(Deployment.load(DEPLOYMENT_FILE)), (
        "compose/docker-compose.yml is stale: run `gateway model-repo compose`"
    )
    result = CliRunner().invoke(app, ["compose", "--check"])
    assert result.exit_code == 0, result.output


def test_the_schema_rejects_a_broken_service() -> None:
    # The vendored schema is strict enough to catch a typo in a service key.
    broken = _committed()
    broken["services"]["redis"]["helthcheck"] = broken["services"]["redis"].pop("healthcheck")
    with pytest.raises(AssertionError, match="helthcheck"):
        _validate(broken)


def test_every_triton_service_has_its_own_gpu() -> None:
    deployment = Deployment.load()
    tritons = _tritons(_committed())
    assigned = []
    for service in tritons.values():
        (device,) = service["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
        assert len(device["device_ids"]) == deployment.tensor_parallel_size
        assigned += device["device_ids"]
    assert sorted(assigned) == sorted(deployment.gpus)
    assert len(set(assigned)) == len(assigned)


def test_every_triton_service_has_a_readiness_check_shm_and_ulimits() -> None:
    for name, service in _tritons(_committed()).items():
        assert "/v2/health/ready" in " ".join(service["healthcheck"]["test"]), name
        assert service["shm_size"]
        assert service["ulimits"]["memlock"] == -1
        assert service["ulimits"]["stack"] == 67108864
        assert "triton" in service["networks"]["default"]["aliases"]


def test_gateway_replica_list_names_every_triton_service() -> None:
    compose = _committed()
    urls = compose["services"]["gateway"]["environment"]["TRITON_GRPC_URLS"].split(",")
    assert sorted(url.split(":")[0] for url in urls) == sorted(_tritons(compose))
    assert all(url.endswith(":8001") for url in urls)


def test_gateway_binder_list_names_every_binder_service() -> None:
    compose = _committed()
    urls = compose["services"]["gateway"]["environment"]["BINDER_URLS"].split(",")
    binders = sorted(n for n in compose["services"] if n.startswith("binder-"))
    assert sorted(u.removeprefix("http://").split(":")[0] for u in urls) == binders


def test_changing_the_gpu_list_changes_the_replicas_and_the_gateway_list() -> None:
    compose = generate(Deployment(gpus=("0", "1", "2", "3")))
    _validate(compose)
    assert sorted(_tritons(compose)) == ["triton-0", "triton-1", "triton-2", "triton-3"]
    urls = compose["services"]["gateway"]["environment"]["TRITON_GRPC_URLS"]
    assert urls == "triton-0:8001,triton-1:8001,triton-2:8001,triton-3:8001"


def test_tensor_parallel_replicas_get_two_gpus_and_run_under_mpi() -> None:
    compose = generate(Deployment(gpus=("0", "1", "2", "3"), tensor_parallel_size=2))
    _validate(compose)
    tritons = _tritons(compose)
    assert len(tritons) == 2
    command = tritons["triton-1"]["command"]
    assert command[:2] == ["mpirun", "--allow-run-as-root"]
    assert command.count("tritonserver") == 2
    assert "--load-model=trtllm_tensorrt_llm" in command
    devices = tritons["triton-1"]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"]
    assert devices == ["2", "3"]


@pytest.mark.parametrize(
    ("deployment", "message"),
    [
        ({"gpus": ("0", "0")}, "listed twice"),
        ({"gpus": ("0", "1", "2"), "tensor_parallel_size": 2}, "do not split"),
        ({"gpus": ()}, "at least one GPU"),
    ],
)
def test_impossible_deployments_are_refused(deployment: dict, message: str) -> None:
    with pytest.raises(ToolError, match=message):
        Deployment(**deployment)


def test_unknown_deployment_key_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "d.toml"
    path.write_text('gpus = ["0"]\nreplicas = 3\n')
    with pytest.raises(ToolError, match="unknown key"):
        Deployment.load(path)


def test_redis_keeps_an_append_only_file_and_mongo_is_a_replica_set() -> None:
    services = _committed()["services"]
    redis = services["redis"]["command"]
    assert redis[redis.index("--appendonly") + 1] == "yes"
    mongo = services["mongo"]
    assert mongo["command"][mongo["command"].index("--replSet") + 1] == "rs0"
    script = Path(COMPOSE_FILE.parent, mongo["volumes"][1].split(":")[0]).resolve()
    assert "rs.initiate" in script.read_text()
    assert any(script.name in part for part in mongo["healthcheck"]["test"])
    for name in ("gateway", "binder-0"):
        assert services[name]["environment"]["MONGO_URL"].endswith("@mongo:27017/?replicaSet=rs0&authSource=admin")


def test_nginx_mounts_the_repository_config() -> None:
    nginx = _committed()["services"]["nginx"]
    source = nginx["volumes"][0].split(":")[0]
    assert (COMPOSE_FILE.parent / source).resolve() == (COMPOSE_FILE.parent.parent / "nginx" / "nginx.conf")


def test_triton_grpc_is_not_published_unless_asked() -> None:
    assert _committed()["services"]["nginx"]["ports"] == ["${NGINX_HTTP_PORT:-80}:80"]
    published = generate(Deployment(gpus=("0",), publish_triton_grpc=True))
    assert "${NGINX_GRPC_PORT:-8001}:8001" in published["services"]["nginx"]["ports"]
