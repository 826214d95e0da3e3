"""Span -> otel_traces row mapping (pure)."""

from __future__ import annotations

from typing import Any

from agl_stream.clickhouse.rows import SPAN_COLUMNS, attribute_text, span_row


def _span(**overrides: Any) -> dict[str, Any]:
    span: dict[str, Any] = {
        "rollout_id": "ro-000000000001",
        "attempt_id": "at-00000001",
        "sequence_id": 3,
        "trace_id": "a" * 32,
        "span_id": "b" * 16,
        "parent_id": None,
        "name": "openai.chat.completion",
        "kind": "CLIENT",
        "status": {"status_code": "ERROR", "description": "boom"},
        "attributes": {"gen_ai.request.model": "m", "n": 2, "ok": True, "ids": [1, 2], "x": 0.5},
        "events": [{"name": "e", "attributes": {"k": "v"}, "timestamp": 1.5}],
        "links": [
            {
                "context": {
                    "trace_id": "c" * 32,
                    "span_id": "d" * 16,
                    "is_remote": False,
                    "trace_state": {"vendor": "1"},
                },
                "attributes": {},
            }
        ],
        "start_time": 1.0,
        "end_time": 1.25,
        "context": None,
        "parent": None,
        "resource": {"attributes": {"service.name": "agent"}, "schema_url": ""},
        "scope_name": "s",
        "scope_version": "1",
    }
    span.update(overrides)
    return span


def test_row_has_the_otel_exporter_shape() -> None:
    row = dict(zip(SPAN_COLUMNS, span_row(_span(), partition=2, offset=41), strict=True))
    assert row["Timestamp"] == 1_000_000_000
    assert row["Duration"] == 250_000_000
    assert row["SpanKind"] == "Client" and row["StatusCode"] == "Error" and row["StatusMessage"] == "boom"
    assert row["ServiceName"] == "agent"
    assert row["SpanAttributes"] == {"gen_ai.request.model": "m", "n": "2", "ok": "true", "ids": "[1,2]", "x": "0.5"}
    assert row["Events.Timestamp"] == [1_500_000_000] and row["Events.Name"] == ["e"]
    assert row["Links.TraceState"] == ["vendor=1"]
    assert (row["RolloutId"], row["AttemptId"], row["SequenceId"]) == ("ro-000000000001", "at-00000001", 3)
    assert (row["KafkaPartition"], row["KafkaOffset"]) == (2, 41)
    assert row["ParentSpanId"] == ""


def test_open_span_has_zero_duration_and_unset_status() -> None:
    row = dict(zip(SPAN_COLUMNS, span_row(_span(end_time=None, status=None), 0, 0), strict=True))
    assert row["Duration"] == 0 and row["StatusCode"] == "Unset"


def test_attribute_text() -> None:
    assert attribute_text(False) == "false"
    assert attribute_text(None) == ""
    assert attribute_text(["a", 1]) == '["a",1]'
