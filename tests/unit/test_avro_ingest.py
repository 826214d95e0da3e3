"""The Avro container the sink hands to ClickHouse, checked with an independent reader (fastavro)."""

from __future__ import annotations

import io
from typing import Any, cast

import fastavro
from hypothesis import given
from hypothesis import strategies as st

from agl_stream.clickhouse.avro_ingest import clickhouse_type, container, container_header, zigzag
from agl_stream.wire.codec import HEADER_SIZE, Codec
from producers.synthetic_spans import synthetic_span


@given(st.integers(min_value=-(2**63), max_value=2**63 - 1))
def test_zigzag_matches_avro_long_encoding(value: int) -> None:
    out = io.BytesIO()
    fastavro.schemaless_writer(out, "long", value)
    assert zigzag(value) == out.getvalue()


def test_container_is_a_valid_avro_file_of_envelopes() -> None:
    codec = Codec.default()
    schema = codec.contract.schema("agl.Span").expanded
    spans = [synthetic_span(i) for i in range(5)]
    rows = [(i % 2, 1000 + i, codec.encode_dict("agl.Span", s)[HEADER_SIZE:]) for i, s in enumerate(spans)]
    # fastavro types a record as any Avro value; these are the envelope schema's records.
    records = cast("list[dict[str, Any]]", list(fastavro.reader(io.BytesIO(container(container_header(schema), rows)))))
    assert [(r["kafka_partition"], r["kafka_offset"]) for r in records] == [(p, o) for p, o, _ in rows]
    assert [r["record"]["span_id"] for r in records] == [s["span_id"] for s in spans]
    tokens = "gen_ai.usage.input_tokens"
    assert records[0]["record"]["attributes"][tokens] == spans[0]["attributes"][tokens]


def test_empty_container_is_valid() -> None:
    schema = Codec.default().contract.schema("agl.DlqRecord").expanded
    assert list(fastavro.reader(io.BytesIO(container(container_header(schema), [])))) == []


def test_type_mapping_rules() -> None:
    assert clickhouse_type(["null", "string"]) == "Nullable(String)"
    assert clickhouse_type(["null", {"type": "array", "items": "long"}]) == "Array(Int64)"
    assert clickhouse_type(["string", "long", "null"]) == "Variant(Int64, String)"
    assert clickhouse_type({"type": "string", "logicalType": "json"}) == "String"
    record = {"type": "record", "name": "R", "namespace": "x", "fields": [{"name": "a", "type": "int"}]}
    assert clickhouse_type({"type": "array", "items": record}) == "Array(Tuple(a Int32))"
    named: dict[str, str] = {}
    clickhouse_type(record, named)
    assert clickhouse_type("x.R", named) == "Tuple(a Int32)"
    assert clickhouse_type({"type": "enum", "name": "E", "symbols": ["A", "B"]}) == "Enum8('A' = 0, 'B' = 1)"
