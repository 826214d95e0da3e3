"""The Avro -> ClickHouse path against the real embedded engine (no Kafka needed here)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from agl_stream.clickhouse.avro_ingest import columns_of, container, container_header
from agl_stream.codec import HEADER_SIZE, Codec
from agl_stream.config import Settings
from agl_stream.kafka.io import Fetched
from consumers.clickhouse_sink import TableSink
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
