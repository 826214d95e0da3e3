"""Every query of the ClickHouse Grafana dashboard (infra/grafana/agl-stream-clickhouse.json), as
the plugin would send it (tests/grafana_sql.py), run on the real engine with the project's
migrations applied: each runs, returns the columns its panel shows, and sees the rows it should."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from clickhouse_connect.driver.client import Client

from agl_stream.clickhouse.client import get_client
from agl_stream.clickhouse.migrations import migrate
from agl_stream.config import Settings
from tests.grafana_sql import TimeRange, render

pytestmark = pytest.mark.integration

DASHBOARD = Path(__file__).resolve().parents[2] / "infra" / "grafana" / "agl-stream-clickhouse.json"
NOW = datetime.now(UTC).replace(microsecond=0)
WHEN = TimeRange(NOW - timedelta(hours=1), NOW + timedelta(minutes=1), 60)
EMPTY = {"trace_id": "", "span_name": "", "rollout_id": ""}


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Client]:
    settings = Settings(data_dir=tmp_path_factory.mktemp("grafana"))
    client = get_client(settings)
    try:
        migrate(client, settings.clickhouse_database)
        _seed(client, settings.clickhouse_database)
        yield client
    finally:
        client.close()


def _seed(client: Client, db: str) -> None:
    t = NOW.timestamp() - 600
    client.command(
        f"INSERT INTO {db}.otel_traces (Timestamp, TraceId, SpanId, SpanName, RolloutId, AttemptId, SequenceId, "
        f"KafkaOffset, SpanAttributes) VALUES "
        f"(toDateTime64({t}, 9), 'trace-a', 's1', 'openai.chat.completion', 'ro-1', 'at-1', 1, 1, "
        f"map('agentlightning.policy_version', '3')), "
        f"(toDateTime64({t + 1}, 9), 'trace-a', 's2', 'reward', 'ro-1', 'at-1', 2, 2, map()), "
        f"(toDateTime64({t + 2}, 9), 'trace-b', 's3', 'openai.chat.completion', 'ro-2', 'at-2', 1, 3, map()), "
        f"(toDateTime64({t - 86400}, 9), 'trace-old', 's4', 'reward', 'ro-0', 'at-0', 1, 4, map())"
    )
    client.command(
        f"INSERT INTO {db}.triplet_records (rollout_id, attempt_id, group_id, policy_version, n_triplets, "
        f"final_reward, finish_time, kafka_offset, mode) VALUES "
        f"('ro-1', 'at-1', 'g', 3, 2, 1.0, {t}, 1, 'train'), ('ro-2', 'at-2', 'g', 3, 1, 0.0, {t}, 2, 'train'), "
        f"('ro-3', 'at-3', 'h', 3, 4, 0.5, {t}, 3, 'val'), ('ro-4', 'at-4', 'h', 4, 1, NULL, {t}, 4, NULL)"
    )
    client.command(
        f"INSERT INTO {db}.rollouts (rollout_id, input, start_time, status, config, version, cause_event_id, "
        f"cause_time, finished_time, kafka_partition, kafka_offset) VALUES "
        f"('ro-1', '{{}}', {t - 5}, 'succeeded', '{{}}', 3, 'e', {t}, {t}, 0, 1), "
        f"('ro-2', '{{}}', {t - 5}, 'running', '{{}}', 2, 'e', {t}, NULL, 0, 2)"
    )


def _targets() -> dict[tuple[str, str], dict[str, Any]]:
    dashboard = json.loads(DASHBOARD.read_text())
    return {(panel["title"], target["refId"]): target for panel in dashboard["panels"] for target in panel["targets"]}


def _run(client: Client, title: str, ref: str = "A", **variables: str) -> tuple[list[str], list[tuple[Any, ...]]]:
    target = _targets()[(title, ref)]
    dashboard = json.loads(DASHBOARD.read_text())
    constants = {v["name"]: v["query"] for v in dashboard["templating"]["list"] if v["type"] == "constant"}
    result = client.query(render(target["rawSql"], WHEN, {**constants, **EMPTY, **variables}))
    return list(result.column_names), [tuple(row) for row in result.result_rows]


def test_every_query_runs_with_the_columns_its_format_needs(client: Client) -> None:
    targets = _targets()
    assert len(targets) >= 6
    for (title, ref), target in targets.items():
        assert target["editorType"] == "sql" and target["datasource"]["type"] == "grafana-clickhouse-datasource"
        columns, rows = _run(client, title, ref)
        assert rows, f"{title} {ref}: no rows over the seeded data"
        if target["format"] == 0:  # time series: a time column, then values
            assert columns[0] == "time", (title, ref, columns)
            assert all(isinstance(row[0], datetime) for row in rows), (title, ref)


def test_reward_per_policy_version_and_mode(client: Client) -> None:
    columns, rows = _run(client, "Final reward per policy version and mode")
    assert columns == ["mode", "policy_version", "attempts", "rewarded", "mean_reward"]
    by_key = {(row[0], row[1]): row[2:] for row in rows}
    assert by_key[("train", 3)] == (2, 2, 0.5)
    assert by_key[("val", 3)] == (1, 1, 0.5)
    assert by_key[("unset", 4)][:2] == (1, 0)


def test_throughput_counts_each_kind_per_minute(client: Client) -> None:
    title = "Throughput per minute: rollouts finished, spans, triplets"
    totals = {ref: sum(row[1] for row in _run(client, title, ref)[1]) for ref in ("A", "B", "C")}
    assert totals == {"A": 1, "B": 3, "C": 8}  # one finished rollout; the day-old span is out of range


def test_trace_search_narrows_by_each_variable(client: Client) -> None:
    title = "Trace search (otel_traces)"
    columns, rows = _run(client, title)
    assert columns[:5] == ["Timestamp", "TraceId", "SpanId", "ParentSpanId", "SpanName"]
    assert {"RolloutId", "AttemptId", "duration_ms", "PolicyVersion"} <= set(columns)
    span = columns.index("SpanId")
    assert {row[span] for row in rows} == {"s1", "s2", "s3"}
    assert {row[span] for row in _run(client, title, trace_id="trace-a")[1]} == {"s1", "s2"}
    assert {row[span] for row in _run(client, title, span_name="CHAT")[1]} == {"s1", "s3"}
    assert {row[span] for row in _run(client, title, rollout_id="ro-2")[1]} == {"s3"}
    assert _run(client, title, trace_id="x' OR '1'='1")[1] == []  # a quote stays inside the string
    policy = columns.index("PolicyVersion")
    assert {row[span]: row[policy] for row in rows}["s1"] == 3
