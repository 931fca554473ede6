"""compose/prometheus and compose/grafana: Prometheus's scrape configuration and the
provisioned Grafana dashboard. Every query is parsed by Prometheus's own promtool, and
every metric it names is one the code (or Triton / TensorRT-LLM) exports."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.deploy import REPO_ROOT
from gateway.deploy.compose import (
    BINDER_PORT,
    COMPOSE_DIR,
    COMPOSE_FILE,
    GATEWAY_PORT,
    OBSERVABILITY_PROFILE,
    PROMETHEUS_PORT,
    TRITON_METRICS_PORT,
)
from tests.production.test_compose import _validate

DASHBOARD = COMPOSE_DIR / "grafana" / "dashboards" / "triton-gateway.json"
PROMETHEUS_CONFIG = COMPOSE_DIR / "prometheus" / "prometheus.yml"
DATASOURCES = COMPOSE_DIR / "grafana" / "provisioning" / "datasources" / "prometheus.yml"
DASHBOARD_PROVIDERS = COMPOSE_DIR / "grafana" / "provisioning" / "dashboards" / "triton-gateway.yml"
EXTRACTED_PROMTOOL = REPO_ROOT / ".venv" / "prometheus" / "usr" / "bin" / "promtool"

# Where the code defines its metrics (gateway processes and binders).
METRIC_SOURCES = [
    *sorted((REPO_ROOT / "gateway" / "server").rglob("*.py")),
    *sorted((REPO_ROOT / "binder").rglob("*.py")),
]
# Triton's own metrics (docs: Triton "Metrics") and TensorRT-LLM backend's families
# (tensorrtllm_backend docs), as the engines export them on :8002.
TRITON_METRICS = {
    "nv_inference_request_success",
    "nv_inference_request_failure",
    "nv_inference_count",
    "nv_inference_exec_count",
    "nv_inference_pending_request_count",
    "nv_inference_request_duration_us",
    "nv_inference_queue_duration_us",
    "nv_inference_compute_input_duration_us",
    "nv_inference_compute_infer_duration_us",
    "nv_inference_compute_output_duration_us",
    "nv_gpu_utilization",
    "nv_gpu_memory_total_bytes",
    "nv_gpu_memory_used_bytes",
    "nv_gpu_power_usage",
    "nv_cpu_utilization",
    "nv_cpu_memory_used_bytes",
    "nv_trt_llm_request_metrics",
    "nv_trt_llm_runtime_memory_metrics",
    "nv_trt_llm_kv_cache_block_metrics",
    "nv_trt_llm_inflight_batcher_metrics",
    "nv_trt_llm_v1_metrics",
    "nv_trt_llm_general_metrics",
    "nv_trt_llm_disaggregated_serving_metrics",
}
# What the issue asks the dashboard to show (the names its queries must use).
REQUIRED = {
    "gateway_requests_finished_total": "requests by outcome",
    "gateway_backlog": "backlog",
    "gateway_request_latency_seconds_bucket": "latency histogram",
    "gateway_time_to_first_token_seconds_bucket": "TTFT histogram",
    "gateway_replica_inflight": "per-replica in-flight",
    "gateway_replica_healthy": "per-replica health",
    "binder_results_lag": "binder lag",
    "binder_webhook_attempts_total": "webhook outcomes",
    "gateway_http_requests_total": "HTTP requests per route",
    "gateway_http_request_duration_seconds_bucket": "HTTP latency per route",
    "nv_trt_llm_kv_cache_block_metrics": "engines' KV cache",
    "nv_trt_llm_request_metrics": "engines' requests",
}
_DEFINITION = re.compile(
    r"\b(Counter|Gauge|Histogram|Summary|CounterMetricFamily|GaugeMetricFamily)\(\s*"
    r'"([a-zA-Z_:][a-zA-Z0-9_:]*)",\s*"(?:[^"\\]|\\.)*",\s*(?:\[([^\]]*)\])?',
)
_SUFFIXES = {
    "Counter": ["_total"],
    "CounterMetricFamily": ["_total"],
    "Gauge": [""],
    "GaugeMetricFamily": [""],
    "Histogram": ["_bucket", "_sum", "_count"],
    "Summary": ["", "_sum", "_count"],
}
_PROMQL_WORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "bool",
    "and",
    "or",
    "unless",
    "offset",
}


def _defined() -> dict[str, set[str]]:
    """Every sample name the code exports, with the labels its metric has."""
    found: dict[str, set[str]] = {}
    for path in METRIC_SOURCES:
        for kind, name, labels in _DEFINITION.findall(path.read_text()):
            family = name.removesuffix("_total") if kind.startswith("Counter") else name
            label_names = set(re.findall(r'"([a-zA-Z_][a-zA-Z0-9_]*)"', labels or ""))
            for suffix in _SUFFIXES[kind]:
                found[family + suffix] = label_names | ({"le"} if suffix == "_bucket" else set())
    return found


def _dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def _graph_panels() -> list[dict[str, Any]]:
    return [p for p in _dashboard()["panels"] if p["type"] != "row"]


def _exprs() -> list[str]:
    return [target["expr"] for panel in _graph_panels() for target in panel["targets"]]


def _metric_names(expr: str) -> set[str]:
    """The metric names in a PromQL expression: identifiers outside label matchers,
    groupings, ranges and strings, that are not functions or keywords."""
    bare = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    bare = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", bare)
    bare = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", bare)
    names = re.findall(r"(?<![\w.])([a-zA-Z_:][a-zA-Z0-9_:]*)\b(?!\s*\()", bare)
    return {name for name in names if name not in _PROMQL_WORDS}


@pytest.fixture(scope="session")
def promtool(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """$PROMTOOL, promtool on PATH, or the one in Debian's prometheus package (unpacked
    into .venv/prometheus, nothing installed), as tools/get_nginx.sh does for nginx."""
    for candidate in (os.environ.get("PROMTOOL"), shutil.which("promtool"), str(EXTRACTED_PROMTOOL)):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return Path(candidate)
    work = tmp_path_factory.mktemp("promtool")
    download = ["apt-get", "download", "-q", "prometheus"]
    result = subprocess.run(download, cwd=work, capture_output=True, text=True)
    if result.returncode != 0 and os.geteuid() == 0:
        subprocess.run(["apt-get", "update", "-qq"], capture_output=True)
        result = subprocess.run(download, cwd=work, capture_output=True, text=True)
    debs = sorted(work.glob("prometheus_*.deb"))
    if result.returncode != 0 or not debs:
        pytest.fail(f"no promtool: set PROMTOOL, or let apt-get download prometheus work: {result.stderr.strip()}")
    subprocess.run(["dpkg-deb", "-x", str(debs[0]), str(EXTRACTED_PROMTOOL.parents[2])], check=True)
    return EXTRACTED_PROMTOOL


# ---- the dashboard ---------------------------------------------------------------------


def test_the_dashboard_is_a_grafana_dashboard_on_the_provisioned_datasource() -> None:
    dashboard = _dashboard()
    assert dashboard["uid"] and dashboard["title"] and dashboard["schemaVersion"] >= 36
    datasource_uid = yaml.safe_load(DATASOURCES.read_text())["datasources"][0]["uid"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in _graph_panels():
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24 and grid["h"] > 0, panel["title"]
        assert panel["datasource"]["uid"] == datasource_uid, panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert panel["targets"] and len(refs) == len(set(refs)), panel["title"]
        assert all(t["expr"].strip() and t["datasource"]["uid"] == datasource_uid for t in panel["targets"])


def test_every_dashboard_query_is_valid_promql(promtool: Path, tmp_path: Path) -> None:
    # promtool parses recording rules' expressions: one rule per query ($__rate_interval
    # is Grafana's, replaced by a range Prometheus understands).
    rules = [
        {"record": f"dashboard:query_{i}", "expr": expr.replace("$__rate_interval", "5m")}
        for i, expr in enumerate(_exprs())
    ]
    path = tmp_path / "dashboard-rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = subprocess.run([str(promtool), "check", "rules", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(rules)} rules found" in result.stdout


def test_every_metric_the_dashboard_queries_is_exported() -> None:
    exported = set(_defined()) | TRITON_METRICS
    used = {name for expr in _exprs() for name in _metric_names(expr)}
    assert used, "no metric names found in the dashboard's queries"
    assert used <= exported, f"not exported by the code, Triton or TensorRT-LLM: {sorted(used - exported)}"


def test_the_name_extraction_sees_names_and_skips_labels_and_functions() -> None:
    expr = 'histogram_quantile(0.9, sum by (le, route) (rate(a_b_bucket{route=~"x|y"}[5m]))) / on (route) c:d * 1e-9'
    assert _metric_names(expr) == {"a_b_bucket", "c:d"}


def test_the_dashboard_groups_our_metrics_only_by_labels_they_have() -> None:
    defined = _defined()
    for expr in _exprs():
        ours = [name for name in _metric_names(expr) if name in defined]
        grouped = {
            label.strip()
            for labels in re.findall(r"\bby\s*\(([^)]*)\)", expr)
            for label in labels.split(",")
            if label.strip()
        }
        for name in ours:
            # instance and job are Prometheus's own target labels.
            assert grouped <= defined[name] | {"instance", "job"}, f"{expr}: {name} has labels {defined[name]}"


def test_the_dashboard_shows_what_the_issue_asks_for() -> None:
    used = {name for expr in _exprs() for name in _metric_names(expr)}
    missing = {name: what for name, what in REQUIRED.items() if name not in used}
    assert not missing, f"the dashboard does not show: {missing}"


@pytest.mark.parametrize(
    "histogram", ["gateway_request_latency_seconds_bucket", "gateway_time_to_first_token_seconds_bucket"]
)
def test_latency_and_ttft_are_shown_at_p50_p90_and_p99(histogram: str) -> None:
    quantiles = {
        float(q) for expr in _exprs() if histogram in expr for q in re.findall(r"histogram_quantile\(([0-9.]+)", expr)
    }
    assert quantiles >= {0.5, 0.9, 0.99}, quantiles


# ---- Prometheus ------------------------------------------------------------------------


def test_the_prometheus_config_passes_promtool(promtool: Path) -> None:
    result = subprocess.run([str(promtool), "check", "config", str(PROMETHEUS_CONFIG)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(
    ("job", "port", "prefix"),
    [
        ("gateway", GATEWAY_PORT, "gateway"),
        ("binder", BINDER_PORT, "binder-"),
        ("triton", TRITON_METRICS_PORT, "triton-"),
    ],
)
def test_prometheus_finds_every_replica_of_each_service_by_dns(job: str, port: int, prefix: str) -> None:
    jobs = {j["job_name"]: j for j in yaml.safe_load(PROMETHEUS_CONFIG.read_text())["scrape_configs"]}
    [sd] = jobs[job]["dns_sd_configs"]
    assert sd["port"] == port and sd["type"] == "A"
    [name] = sd["names"]
    services = yaml.safe_load(COMPOSE_FILE.read_text())["services"]
    replicas = {n: s for n, s in services.items() if n == prefix or (prefix.endswith("-") and n.startswith(prefix))}
    assert replicas, f"no {prefix}* service"
    for service_name, service in replicas.items():
        # The service's name (its replicas share it) or a network alias every replica has.
        aliases = service.get("networks", {}).get("default", {}).get("aliases", [])
        assert name == service_name or name in aliases, f"{service_name} is not found as {name!r}"


def test_triton_serves_metrics_on_the_port_prometheus_scrapes() -> None:
    services = yaml.safe_load(COMPOSE_FILE.read_text())["services"]
    for name, service in services.items():
        if name.startswith("triton-"):
            assert f"--metrics-port={TRITON_METRICS_PORT}" in service["command"], name


# ---- Grafana provisioning and the compose services -------------------------------------


def _mounts(service: dict[str, Any]) -> dict[str, Path]:
    """container path -> host path of a service's bind mounts (relative to compose/)."""
    mounts = {}
    for volume in service["volumes"]:
        source, target = volume.split(":")[:2]
        if source.startswith("."):
            mounts[target] = (COMPOSE_DIR / source).resolve()
    return mounts


def test_grafana_loads_the_dashboard_and_the_datasource_from_its_mounts() -> None:
    services = yaml.safe_load(COMPOSE_FILE.read_text())["services"]
    mounts = _mounts(services["grafana"])
    assert mounts["/etc/grafana/provisioning"] == DATASOURCES.parents[1]
    [provider] = yaml.safe_load(DASHBOARD_PROVIDERS.read_text())["providers"]
    assert mounts[provider["options"]["path"]] == DASHBOARD.parent
    [datasource] = yaml.safe_load(DATASOURCES.read_text())["datasources"]
    assert datasource["url"] == f"http://prometheus:{PROMETHEUS_PORT}"


def test_prometheus_mounts_the_repository_config() -> None:
    prometheus = yaml.safe_load(COMPOSE_FILE.read_text())["services"]["prometheus"]
    assert _mounts(prometheus)["/etc/prometheus/prometheus.yml"] == PROMETHEUS_CONFIG
    assert "--config.file=/etc/prometheus/prometheus.yml" in prometheus["command"]


def test_prometheus_and_grafana_start_only_with_the_observability_profile() -> None:
    services = yaml.safe_load(COMPOSE_FILE.read_text())["services"]
    for name in ("prometheus", "grafana"):
        assert services[name]["profiles"] == [OBSERVABILITY_PROFILE]
        # Loopback only: Prometheus has no authentication, Grafana starts with a default login.
        assert all(port.startswith("127.0.0.1:") for port in services[name]["ports"]), name
    assert not any("profiles" in s for n, s in services.items() if n not in ("prometheus", "grafana"))


def test_the_compose_file_with_the_observability_services_validates() -> None:
    _validate(yaml.safe_load(COMPOSE_FILE.read_text()))
