"""The Grafana/Prometheus monitoring wiring, checked without Docker: the compose services and what
they mount, Prometheus's file_sd path against where the roles write their endpoint files, the
provisioned data sources and dashboards, and the SQL renderer the ClickHouse dashboard's
engine test uses (tests/integration/test_grafana_clickhouse.py)."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml  # type: ignore[import-untyped]  # PyYAML (the dev extra) ships no types

from agl_stream import metrics
from agl_stream.config import Settings
from tests.grafana_sql import TimeRange, render

ROOT = Path(__file__).resolve().parents[2]
INFRA = ROOT / "infra"
COMPOSE = INFRA / "docker-compose.yml"
PROMETHEUS = INFRA / "prometheus.yml"
GRAFANA = INFRA / "grafana"
CLICKHOUSE_PLUGIN = "grafana-clickhouse-datasource"
ROLE_SERVICES = {
    "processor",
    "gateway",
    "ingress",
    "triplets",
    "batcher",
    "llm-proxy",
    "inference",
    "trainer",
    "runner",
}


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    loaded = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(loaded, dict)
    return loaded


@pytest.fixture(scope="module")
def prometheus() -> dict[str, Any]:
    loaded = yaml.safe_load(PROMETHEUS.read_text())
    assert isinstance(loaded, dict)
    return loaded


def _mounts(service: dict[str, Any]) -> dict[str, str]:
    """Container path -> source (a named volume, or a path relative to infra/)."""
    found = {}
    for volume in service.get("volumes") or []:
        source, target = str(volume).split(":")[:2]
        found[target] = source
    return found


def _container_path(service: dict[str, Any], host_path: Path) -> PurePosixPath:
    """Where ``host_path`` (under infra/) appears in the container, through a bind mount."""
    for target, source in _mounts(service).items():
        if source.startswith("."):
            mounted = (INFRA / source).resolve()
            if host_path.resolve() == mounted or mounted in host_path.resolve().parents:
                return PurePosixPath(target) / host_path.resolve().relative_to(mounted).as_posix()
    raise AssertionError(f"{host_path} is not mounted")


def _data_dir() -> str:
    match = re.search(r"AGL_DATA_DIR=(\S+)", (INFRA / "Dockerfile").read_text())
    assert match, "the image sets AGL_DATA_DIR"
    return match.group(1)


def test_roles_and_prometheus_share_the_endpoint_folder(compose: dict[str, Any], prometheus: dict[str, Any]) -> None:
    services = compose["services"]
    # Where a role writes its endpoint files in its container (the image's data dir).
    endpoints = str(Settings(data_dir=Path(_data_dir())).run_dir / metrics.ENDPOINTS_DIR)
    assert f"mkdir -p /data/checkpoints {endpoints}" in (INFRA / "Dockerfile").read_text(), (
        "the image creates the folder, so the volume mounted there is the agl user's"
    )
    volumes = {_mounts(services[name]).get(endpoints) for name in ROLE_SERVICES}
    assert len(volumes) == 1 and None not in volumes, f"every role mounts one volume at {endpoints}: {volumes}"
    [volume] = volumes
    assert volume in compose["volumes"]
    assert services["gateway"]["environment"].get("AGL_METRICS_HOST") is not None  # x-agl-env reaches the roles
    assert {r["environment"].get("AGL_METRICS_HOST") for n, r in services.items() if n in ROLE_SERVICES} == {"0.0.0.0"}
    # Prometheus reads the same volume where its file_sd looks.
    [prom_target] = [t for t, s in _mounts(services["prometheus"]).items() if s == volume]
    [roles_job] = [j for j in prometheus["scrape_configs"] if j["job_name"] == "agl-roles"]
    [files] = [c["files"] for c in roles_job["file_sd_configs"]]
    assert [str(PurePosixPath(f).parent) for f in files] == [prom_target] and files[0].endswith("/*.json")
    assert _container_path(services["prometheus"], PROMETHEUS) == PurePosixPath("/etc/prometheus/prometheus.yml")
    assert f"--config.file={_container_path(services['prometheus'], PROMETHEUS)}" in services["prometheus"]["command"]


def _kept(job: dict[str, Any], labels: dict[str, str]) -> bool:
    """Whether ``job``'s keep/drop relabel rules keep a target with ``labels``."""
    for rule in job.get("relabel_configs") or []:
        value = ";".join(labels.get(name, "") for name in rule["source_labels"])
        matches = re.fullmatch(rule["regex"], value) is not None
        if (rule["action"] == "keep" and not matches) or (rule["action"] == "drop" and matches):
            return False
    return True


def test_the_scrape_jobs_split_targets_by_whether_they_take_the_token(
    compose: dict[str, Any], prometheus: dict[str, Any]
) -> None:
    jobs = {j["job_name"]: j for j in prometheus["scrape_configs"]}
    plain = metrics.target_groups("processor", 1, "http://10.0.0.2:41000/metrics", host="h", started=0, token=False)
    http = metrics.target_groups("gateway", 1, "http://127.0.0.1:8642/metrics", host="h", started=0, token=True)
    assert _kept(jobs["agl-roles"], plain[0]["labels"]) and not _kept(jobs["agl-roles"], http[0]["labels"])
    assert "authorization" not in jobs["agl-roles"]
    # The gateway, by the name it answers to, with the token Prometheus has as a secret.
    gateway = compose["services"]["gateway"]["environment"]
    assert jobs["agl-http"]["static_configs"][0]["targets"] == [f"gateway:{gateway['AGL_GATEWAY_PORT']}"]
    assert "gateway" in gateway["AGL_ALLOWED_HOSTS"].split(",")
    secret = PurePosixPath(jobs["agl-http"]["authorization"]["credentials_file"])
    assert (
        secret.parent == PurePosixPath("/run/secrets") and secret.name in compose["services"]["prometheus"]["secrets"]
    )
    # Every agl_* series has its own role label: the target's must not rename it to exported_role.
    assert all(job["honor_labels"] is True for job in jobs.values())


def test_grafana_is_provisioned_from_infra_grafana(compose: dict[str, Any]) -> None:
    grafana = compose["services"]["grafana"]
    assert CLICKHOUSE_PLUGIN in grafana["environment"]["GF_INSTALL_PLUGINS"].split(",")
    assert _container_path(grafana, GRAFANA / "provisioning") == PurePosixPath("/etc/grafana/provisioning")
    for name, source in _mounts(grafana).items():
        assert (source.startswith(".") and (INFRA / source).exists()) or source in compose["volumes"], name
    [sources_file] = (GRAFANA / "provisioning" / "datasources").glob("*.yml")
    sources = {s["type"]: s for s in yaml.safe_load(sources_file.read_text())["datasources"]}
    assert set(sources) == {"prometheus", CLICKHOUSE_PLUGIN}
    prom_port = compose["services"]["prometheus"]["ports"][0].rsplit(":", 1)[1]
    assert sources["prometheus"]["url"] == f"http://prometheus:{prom_port}"
    clickhouse = sources[CLICKHOUSE_PLUGIN]["jsonData"]
    ch_service = compose["services"]["clickhouse"]
    assert clickhouse["host"] == "clickhouse" and str(clickhouse["port"]) == ch_service["ports"][0].rsplit(":", 1)[1]
    assert clickhouse["defaultDatabase"] == ch_service["environment"]["CLICKHOUSE_DB"] == Settings().clickhouse_database
    password = sources[CLICKHOUSE_PLUGIN]["secureJsonData"]["password"]
    secret = re.fullmatch(r"\$__file\{/run/secrets/(\w+)\}", password)
    assert secret and secret.group(1) in grafana["secrets"]
    assert (
        grafana["environment"]["GF_SECURITY_ADMIN_PASSWORD__FILE"].removeprefix("/run/secrets/") in grafana["secrets"]
    )
    # The dashboards' folder is where the provider looks, and every dashboard there uses a provisioned type.
    [providers_file] = (GRAFANA / "provisioning" / "dashboards").glob("*.yml")
    [provider] = yaml.safe_load(providers_file.read_text())["providers"]
    assert PurePosixPath(provider["options"]["path"]) == _container_path(grafana, GRAFANA)
    dashboards = sorted(GRAFANA.glob("*.json"))
    assert {d.name for d in dashboards} >= {"agl-stream.json", "agl-stream-clickhouse.json"}
    for path in dashboards:
        dashboard = json.loads(path.read_text())
        types = {t["datasource"]["type"] for p in dashboard["panels"] for t in p["targets"]}
        assert len(types) == 1 and types <= set(sources), path.name
        [variable] = [v for v in dashboard["templating"]["list"] if v["type"] == "datasource"]
        assert variable["query"] in types, path.name


WHEN = TimeRange(datetime(2025, 1, 2, 3, 4, 5, tzinfo=UTC), datetime(2025, 1, 2, 4, 4, 5, tzinfo=UTC), 30)


def test_macros_expand_as_the_plugin_does() -> None:
    sql = "SELECT $__timeInterval(toDateTime(t)) AS time FROM x WHERE $__timeFilter(ts) AND y >= $__fromTime_ms"
    assert render(sql, WHEN, {}) == (
        "SELECT toStartOfInterval(toDateTime(toDateTime(t)), INTERVAL 30 second) AS time FROM x "
        "WHERE ts >= toDateTime(1735787045) AND ts <= toDateTime(1735790645) "
        "AND y >= fromUnixTimestamp64Milli(1735787045000)"
    )
    assert render("$__dateFilter(d) $__toTime $__interval_s", WHEN, {}) == (
        "d >= toDate('2025-01-02') AND d <= toDate('2025-01-02') toDateTime(1735790645) 30"
    )


def test_variables_are_quoted_as_grafana_formats_them() -> None:
    sql = "SELECT * FROM ${db}.t WHERE a = ${v:sqlstring} AND b = '$v'"
    assert render(sql, WHEN, {"db": "agl", "v": "it's"}) == "SELECT * FROM agl.t WHERE a = 'it''s' AND b = 'it's'"


def test_unknown_macros_and_variables_are_errors() -> None:
    with pytest.raises(ValueError, match="not a macro"):
        render("SELECT $__timeGroup(t, '5m')", WHEN, {})
    with pytest.raises(ValueError, match="takes 1 argument"):
        render("WHERE $__timeFilter(a, b)", WHEN, {})
    with pytest.raises(ValueError, match="no such dashboard variable"):
        render("WHERE x = ${nope}", WHEN, {})
