"""The Avro -> ClickHouse path against the real embedded engine (no Kafka needed here)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from agl_stream.clickhouse.avro_ingest import columns_of, container, container_header
from agl_stream.codec import HEADER_SIZE, Codec
from agl_stream.config import Settings
from agl_stream.kafka.io import Fetched
from agl_stream.models import Attempt, Rollout, RolloutState
from consumers.clickhouse_sink import ROLLOUT_STATE, SPANS, TableSink
from tests.integration.helpers import clickhouse
from tests.unit.test_codec import span_dict

pytestmark = pytest.mark.integration


def _squash(text: str) -> str:
    return "".join(text.split())


def test_type_mapping_matches_what_the_engine_reads(tmp_path: Path) -> None:
    codec = Codec.default()
    schemas = list(codec.contract.known.values())
    with clickhouse(Settings(data_dir=tmp_path)) as ch:
        for schema in schemas:
            path = tmp_path / f"{schema.fingerprint_hex}.avro"
            path.write_bytes(container(container_header(schema.expanded), []))
            engine = [(r[0], _squash(r[1])) for r in ch.query(f"DESCRIBE file('{path}', 'Avro')").result_rows]
            ours = [(name, _squash(kind)) for name, kind in columns_of(schema.expanded)]
            assert engine == ours, schema.name


def test_a_span_becomes_an_otel_traces_row(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path)
    codec = Codec.default()
    span = span_dict()
    raw = codec.encode_dict("agl.Span", span)
    with clickhouse(settings) as ch:
        sink = TableSink(settings, ch)
        sink.prepare_tables()
        sink.prepare_tables()  # idempotent
        record = Fetched("agl.spans", 3, 77, b"k", memoryview(raw)[HEADER_SIZE:], raw, 0)
        sink._insert([record], {})
        result = ch.query("SELECT * FROM agl.otel_traces")
        rows = [dict(zip(result.column_names, r, strict=True)) for r in result.result_rows]
    assert len(rows) == 1
    row: dict[str, Any] = rows[0]
    assert row["Timestamp"].timestamp() == pytest.approx(span["start_time"], abs=1e-6)
    assert row["Duration"] == 750_000_000
    assert (row["TraceId"], row["SpanId"], row["ParentSpanId"]) == (span["trace_id"], span["span_id"], "")
    assert (row["SpanName"], row["SpanKind"]) == ("openai.chat.completion", "SPAN_KIND_CLIENT")
    assert (row["StatusCode"], row["StatusMessage"]) == ("STATUS_CODE_OK", "")
    assert row["ServiceName"] == "agent"
    assert row["ResourceAttributes"] == {"service.name": "agent"}
    assert (row["ScopeName"], row["ScopeVersion"]) == ("scope", "1")
    # The OpenTelemetry Collector exporter's convention: strings as they are, the rest as JSON.
    assert row["SpanAttributes"] == {
        "gen_ai.system": "openai",
        "gen_ai.usage.input_tokens": "12",
        "gen_ai.request.temperature": "1",
        "stream": "false",
        "prompt_token_ids": "[1,2,3]",
        "agentlightning.reward.0.value": "0.5",
        "nothing": "null",
        "mixed": '[true,1,1,"1",null]',
    }
    assert row["Events.Name"] == ["e"] and row["Events.Attributes"] == [{"k": "1"}]
    assert row["Events.Timestamp"][0].timestamp() == pytest.approx(1.5)
    assert row["Links.TraceId"] == ["1" * 32] and row["Links.SpanId"] == ["2" * 16]
    assert row["Links.TraceState"] == ["v=1"] and row["Links.Attributes"] == [{"flag": "true"}]
    assert row["TraceState"] == ""
    assert (row["RolloutId"], row["AttemptId"], row["SequenceId"]) == ("ro-0123456789ab", "at-01234567", 3)
    assert (row["KafkaPartition"], row["KafkaOffset"]) == (3, 77)


def test_an_open_span_has_zero_duration(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path)
    failed = span_dict(end_time=None, status={"status_code": "ERROR", "description": "boom"})
    raw = Codec.default().encode_dict("agl.Span", failed)
    with clickhouse(settings) as ch:
        sink = TableSink(settings, ch)
        sink.prepare_tables()
        sink._insert([Fetched("agl.spans", 0, 0, None, memoryview(raw)[HEADER_SIZE:], raw, 0)], {})
        query = "SELECT Duration, StatusCode, StatusMessage FROM agl.otel_traces"
        [(duration, code, message)] = ch.query(query).result_rows
    assert (duration, code, message) == (0, "STATUS_CODE_ERROR", "boom")


def test_rows_carry_the_policy_version_their_work_ran_with(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path)
    codec = Codec.default()
    tagged, untagged = span_dict(), span_dict()
    tagged["attributes"] = {**tagged["attributes"], "agentlightning.policy_version": 7}
    untagged["span_id"] = "f" * 16

    def attempt(number: int, version: int | None) -> Attempt:
        metadata = {"resources_id": "rs-000000000001", "policy_version": version} if version is not None else None
        return Attempt(
            rollout_id="ro-0123456789ab",
            attempt_id=f"at-0000000{number}",
            sequence_id=number,
            start_time=50.0 + number,
            status="failed" if number == 1 else "succeeded",
            metadata=metadata,
        )

    rollout = Rollout.model_validate(
        {"rollout_id": "ro-0123456789ab", "input": {}, "start_time": 10.0, "status": "succeeded"}
    )
    retried = RolloutState(
        rollout=rollout, attempts=[attempt(1, 4), attempt(2, 5)], version=3, cause_event_id="e", cause_time=1
    )
    fresh = Rollout.model_validate({"rollout_id": "ro-0123456789ac", "input": {}, "start_time": 11.0})
    queued = RolloutState(rollout=fresh, attempts=[], version=1, cause_event_id="e", cause_time=1)
    with clickhouse(settings) as ch:
        spans, states = TableSink(settings, ch, SPANS), TableSink(settings, ch, ROLLOUT_STATE)
        spans.prepare_tables()
        states.prepare_tables()
        spans._insert(_fetched([codec.encode_dict("agl.Span", s) for s in (tagged, untagged)]), {})
        states._insert(_fetched([codec.encode(retried), codec.encode(queued)]), {})
        span_versions = ch.query("SELECT PolicyVersion FROM agl.otel_traces ORDER BY SpanId").result_rows
        attempts = ch.query("SELECT attempt_id, policy_version FROM agl.attempts FINAL ORDER BY 1").result_rows
        rollouts = ch.query("SELECT rollout_id, policy_version FROM agl.rollouts FINAL ORDER BY 1").result_rows
    assert span_versions == [(7,), (None,)]
    assert attempts == [("at-00000001", 4), ("at-00000002", 5)]
    assert rollouts == [("ro-0123456789ab", 5), ("ro-0123456789ac", None)]  # the latest attempt's


def _fetched(raws: list[bytes]) -> list[Fetched[memoryview]]:
    return [Fetched("t", 0, offset, b"k", memoryview(raw)[HEADER_SIZE:], raw, 0) for offset, raw in enumerate(raws)]
