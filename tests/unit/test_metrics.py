"""The metrics' names and labels, the Grafana dashboard against them, the exposition (a real
HTTP server and a guarded app), and the arithmetic of ``agl-stream status`` on numbers."""

from __future__ import annotations

import json
import re
import socket
import urllib.request
from pathlib import Path

import pytest
from fastapi import APIRouter, FastAPI
from prometheus_client import REGISTRY, CollectorRegistry, Counter
from starlette.testclient import TestClient

from agl_stream import metrics
from agl_stream.config import Settings
from agl_stream.http_serving import allowed_hosts, guard
from agl_stream.local import monitor

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "infra" / "grafana" / "agl-stream.json"
LABELS = {
    "role",
    "group",
    "topic",
    "partition",
    "reason",
    "sink",
    "model",
    "outcome",
    "status",
    "api",
    "table",
    "method",
    "route",
}


def test_names_follow_the_conventions() -> None:
    for metric in metrics.ALL:
        [family] = metric.describe()
        assert family.name.startswith("agl_"), family.name
        if family.type == "histogram":
            assert family.name.endswith("_seconds"), family.name
        if family.type == "gauge":
            assert not family.name.endswith(("_total", "_seconds")), family.name
        labels = set(metric._labelnames)
        assert "role" in labels and labels <= LABELS, (family.name, labels)
    names = metrics.exposed_names()
    assert "agl_records_in_total" in names and "agl_fold_seconds_bucket" in names
    assert "agl_consumer_lag_records" in names
    assert all(n.endswith("_total") for n in metrics.exposed_names([metrics.RECORDS_OUT, metrics.DLQ_RECORDS]))


def _exprs(dashboard: dict[str, object]) -> list[str]:
    panels = dashboard["panels"]
    assert isinstance(panels, list)
    return [target["expr"] for panel in panels for target in panel["targets"]]


def test_the_grafana_dashboard_uses_exactly_the_metrics_the_code_defines() -> None:
    exprs = _exprs(json.loads(DASHBOARD.read_text()))
    assert exprs
    defined = metrics.exposed_names()
    used: set[str] = set()
    for expr in exprs:
        # Without grouping clauses and label matchers, an identifier not called as a function is
        # a series name (durations like 5m start with a digit).
        bare = re.sub(r"\b(by|without)\s*\([^)]*\)|\{[^}]*\}", " ", expr)
        for name in re.findall(r"\b([a-zA-Z_:][a-zA-Z0-9_:]*)\b(?!\s*\()", bare):
            assert name in defined, f"{name} in {expr!r} is no metric agl_stream/metrics.py defines"
            used.add(name)
    families = {family.name for metric in metrics.ALL for family in metric.describe()}
    unused = {f for f in families if not any(n.startswith(f) for n in used)}
    assert not unused, f"metrics without a panel: {sorted(unused)}"


def test_reply_topics_count_under_one_label_and_dlq_by_error_type() -> None:
    assert metrics.topic_label("agl.replies.client-7f3a") == "agl.replies"
    assert metrics.topic_label("agl.rollouts") == "agl.rollouts"
    metrics.set_role("unit-dlq")
    before = metrics.DLQ_RECORDS.labels("unit-dlq", "agl.spans", "ValueError")._value.get()
    metrics.count_dlq([("agl.spans", ValueError("a")), ("agl.spans", ValueError("b")), ("agl.spans", KeyError("c"))])
    assert metrics.DLQ_RECORDS.labels("unit-dlq", "agl.spans", "ValueError")._value.get() == before + 2
    assert metrics.DLQ_RECORDS.labels("unit-dlq", "agl.spans", "KeyError")._value.get() >= 1


def test_a_role_without_http_serves_its_metrics_and_says_where(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path)
    with metrics.expose(settings, "unit-role") as url:
        assert url is not None and url.startswith("http://127.0.0.1:")
        [endpoint] = monitor.read_endpoints(settings)
        assert (endpoint.role, endpoint.url, endpoint.token) == ("unit-role", url, False)
        # The file is Prometheus file_sd: a list of target groups with string labels.
        [group] = json.loads(endpoint.path.read_text())
        assert group["targets"] == [url.removeprefix("http://").removesuffix("/metrics")]
        assert group["labels"]["role"] == "unit-role" and group["labels"]["__metrics_path__"] == "/metrics"
        assert all(isinstance(v, str) for v in group["labels"].values())
        assert endpoint.path.parent == tmp_path / "run" / metrics.ENDPOINTS_DIR
        metrics.count_out("agl.rollouts", 3)
        with urllib.request.urlopen(url, timeout=60) as response:
            text = response.read().decode()
        totals, _ = monitor.parse_totals(text)
        assert 'agl_records_out_total{role="unit-role",topic="agl.rollouts"} 3.0' in text
        assert totals["agl_records_out_total"] >= 3
    assert monitor.read_endpoints(settings) == []  # removed on a clean exit
    with metrics.expose(settings.model_copy(update={"metrics": False}), "unit-role") as off:
        assert off is None and monitor.read_endpoints(settings) == []


def test_a_taken_fixed_port_falls_back_to_a_free_one(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path)
    with metrics.expose(settings, "first") as first:
        assert first is not None
        port = int(first.rsplit(":", 1)[1].split("/")[0])
        with metrics.expose(settings.model_copy(update={"metrics_port": port}), "second") as second:
            assert second is not None and second != first
            assert len(monitor.read_endpoints(settings)) == 2


def test_http_roles_serve_metrics_behind_their_token() -> None:
    app = FastAPI()
    guard(app, allowed_hosts("127.0.0.1"), "s3cret")
    app.add_route("/metrics", metrics.metrics_endpoint, methods=["GET"])
    client = TestClient(app, base_url="http://127.0.0.1")
    assert client.get("/metrics").status_code == 401
    answer = client.get("/metrics", headers={"authorization": "Bearer s3cret"})
    assert answer.status_code == 200 and "text/plain" in answer.headers["content-type"]
    assert "# TYPE agl_records_in_total counter" in answer.text


def test_http_requests_are_timed_by_route_template_and_status() -> None:
    app = FastAPI()
    guard(app, allowed_hosts("127.0.0.1"), "s3cret")
    router = APIRouter(prefix="/v9")

    @router.get("/things/{thing_id}")
    async def thing(thing_id: str) -> dict[str, str]:
        return {"id": thing_id}

    app.include_router(router)
    client = TestClient(app, base_url="http://127.0.0.1")

    def count(route: str, status: str) -> float:
        sample = REGISTRY.get_sample_value(
            "agl_http_request_seconds_count",
            {"role": metrics.role(), "method": "GET", "route": route, "status": status},
        )
        return sample or 0.0

    before_ok, before_refused = count("/v9/things/{thing_id}", "200"), count("unmatched", "401")
    auth = {"authorization": "Bearer s3cret"}
    assert client.get("/v9/things/a1", headers=auth).json() == {"id": "a1"}
    assert client.get("/v9/things/b2", headers=auth).status_code == 200
    assert client.get("/v9/things/c3").status_code == 401  # refused before routing: no route, no id
    assert count("/v9/things/{thing_id}", "200") == before_ok + 2  # ids never become label values
    assert count("unmatched", "401") == before_refused + 1


# -- the status arithmetic ----------------------------------------------------------------------


def _exposition(records_in: float, records_out: float) -> str:
    registry = CollectorRegistry()
    counter_in = Counter("agl_records_in", "", ["role", "group", "topic"], registry=registry)
    counter_in.labels("processor", "agl.processor", "agl.rollouts").inc(records_in * 0.75)
    counter_in.labels("processor", "agl.processor", "agl.store-requests").inc(records_in * 0.25)
    Counter("agl_records_out", "", ["role", "topic"], registry=registry).labels("processor", "agl.x").inc(records_out)
    from prometheus_client import generate_latest

    return generate_latest(registry).decode()


def test_rates_come_from_two_scrapes() -> None:
    totals_1, groups = monitor.parse_totals(_exposition(100, 40))
    totals_2, _ = monitor.parse_totals(_exposition(300, 90))
    assert groups == {"agl.processor"} and totals_1["agl_records_in_total"] == 100
    path, gone, mute = Path("a.json"), Path("b.json"), Path("c.json")
    endpoints = [
        monitor.Endpoint("processor", 1, "http://x/metrics", path),
        monitor.Endpoint("batcher", 2, "http://y/metrics", gone),
        monitor.Endpoint("ingress", 3, "http://z/metrics", mute),
    ]
    first = {path: monitor.Scrape(10.0, totals_1, groups), mute: None}
    second = {path: monitor.Scrape(12.0, totals_2, groups), mute: None}
    views = monitor.role_views(endpoints, first, second, {path: True, gone: False, mute: True})
    by_role = {v.role: v for v in views}
    assert by_role["processor"].in_per_s == 100.0 and by_role["processor"].out_per_s == 25.0
    assert by_role["processor"].state == "up" and by_role["processor"].groups == {"agl.processor"}
    assert by_role["batcher"].state == "exited" and by_role["batcher"].in_per_s is None
    assert by_role["ingress"].state == "not answering"


def test_group_lag_sums_committed_against_the_ends() -> None:
    ends = {("agl.rollouts", 0): 10, ("agl.rollouts", 1): 5, ("agl.spans", 0): 7, ("other", 0): 99}
    committed = {
        "agl.processor": {("agl.rollouts", 0): 8},  # partition 1 never committed: all 5 wait
        "agl.sink.spans": {("agl.spans", 0): 9},  # past the end (topic recreated): 0
    }
    lags = {g.group: g for g in monitor.group_lags(committed, ends)}
    assert lags["agl.processor"].lag == 7 and lags["agl.processor"].partitions == 2
    assert lags["agl.processor"].by_partition == {("agl.rollouts", 0): 2, ("agl.rollouts", 1): 5}
    assert lags["agl.sink.spans"].lag == 0 and lags["agl.sink.spans"].topics == ("agl.spans",)


async def test_status_shows_dead_endpoints_and_no_kafka_without_failing(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path, kafka_bootstrap="127.0.0.1:1")  # nothing listens there
    folder = tmp_path / "run" / "metrics"
    folder.mkdir(parents=True)
    here = socket.gethostname()
    dead = metrics.target_groups(
        "processor", 999999999, "http://127.0.0.1:1/metrics", host=here, started=0, token=False
    )
    (folder / f"processor-{here}-999999999.json").write_text(json.dumps(dead))
    # Another host's process (a container sharing the folder): its pid says nothing here.
    elsewhere = metrics.target_groups("batcher", 1, "http://127.0.0.1:1/metrics", host="other", started=0, token=False)
    (folder / "batcher-other-1.json").write_text(json.dumps(elsewhere))
    (folder / "garbage.json").write_text("{")
    seen = await monitor.observe(settings, interval_s=0.1, kafka_timeout_s=2.0)
    assert [(v.role, v.state) for v in seen.roles] == [("batcher", "not answering"), ("processor", "exited")]
    assert seen.lags == [] and seen.kafka_error
    assert not (folder / f"processor-{here}-999999999.json").exists()  # a dead process's file is cleared
    assert (folder / "batcher-other-1.json").exists()


def test_training_samples_and_trajectory_breaks_are_counted_by_reason() -> None:
    metrics.set_role("unit-samples")
    built = metrics.TRAINING_SAMPLES.labels("unit-samples", "built", "")
    drift = metrics.TRAINING_SAMPLES.labels("unit-samples", "break", "drift")
    before_built, before_drift = built._value.get(), drift._value.get()
    metrics.count_samples(2, {"drift": 1})
    metrics.count_samples(1, {})
    assert built._value.get() == before_built + 3
    assert drift._value.get() == before_drift + 1


def test_endpoint_files_are_file_sd_target_groups_and_read_back(tmp_path: Path) -> None:
    path = tmp_path / "gateway-h-7.json"
    groups = metrics.target_groups("gateway", 7, "http://[::1]:8642/metrics", host="h", started=12.5, token=True)
    assert groups == [
        {
            "targets": ["[::1]:8642"],
            "labels": {
                "role": "gateway",
                "pid": "7",
                "__metrics_path__": "/metrics",
                "__scheme__": "http",
                "__meta_agl_auth": "bearer",
                "__meta_agl_started": "12.500",
                "__meta_agl_host": "h",
            },
        }
    ]
    [endpoint] = metrics.parse_target_groups(json.loads(json.dumps(groups)), path)
    assert endpoint == metrics.Endpoint("gateway", 7, "http://[::1]:8642/metrics", path, host="h", token=True)
    # A group that is not ours (no role or pid label) is skipped; a file that is no list is refused.
    assert metrics.parse_target_groups([{"targets": ["x:1"], "labels": {"job": "other"}}], path) == []
    with pytest.raises(ValueError, match="file_sd"):
        metrics.parse_target_groups({"role": "processor", "pid": 1, "url": "http://x/metrics"}, path)
    with pytest.raises(ValueError, match="no scheme"):
        metrics.target_groups("processor", 1, "127.0.0.1:9464", host="h", started=0, token=False)


def test_a_wildcard_listener_is_advertised_at_a_reachable_address() -> None:
    assert metrics.reachable_host("127.0.0.1") == "127.0.0.1"
    assert metrics.reachable_host("0.0.0.0", lambda name: "10.1.2.3") == "10.1.2.3"
    assert metrics.reachable_host("::", lambda name: "10.1.2.3") == "10.1.2.3"


def test_http_roles_advertise_their_metrics_as_taking_the_token(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path)
    with metrics.advertised(settings, "unit-http", "http://127.0.0.1:8642/metrics") as path:
        [endpoint] = monitor.read_endpoints(settings)
        assert endpoint.path == path and endpoint.token and endpoint.host == socket.gethostname()
    assert not path.exists()
