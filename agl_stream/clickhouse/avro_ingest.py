"""Hand Avro to ClickHouse as it came off Kafka, so the engine decodes it, not Python.

A sink strips the single-object header (marker + fingerprint) from each record, prefixes the
record's Kafka partition and offset, and concatenates the bodies into one Avro object container
block whose schema is ``{kafka_partition: int, kafka_offset: long, record: <writer schema>}``.
ClickHouse reads that with ``FORMAT Avro`` into a ``Null`` table whose materialized view writes
the real table, so decoding and the record -> row transform are one INSERT in C++.

Everything here is pure: byte layouts, the Avro -> ClickHouse type mapping, DDL text.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from agl_stream.wire.avro_primitives import avro_bytes, zigzag

_PRIMITIVES = {
    "null": "Nothing",
    "boolean": "Bool",
    "int": "Int32",
    "long": "Int64",
    "float": "Float32",
    "double": "Float64",
    "bytes": "String",
    "string": "String",
}
# Types ClickHouse cannot wrap in Nullable: a null branch just means "empty".
_NOT_NULLABLE = ("Array(", "Map(", "Variant(")
_SYNC = b"agl-stream-sink!"  # 16 bytes; any constant works, the block is never appended to


def envelope_schema(record_schema: dict[str, Any]) -> dict[str, Any]:
    """The container's schema: the Kafka position, then the record as its writer wrote it."""
    return {
        "type": "record",
        "name": "SinkEnvelope",
        "namespace": "agl.sink",
        "fields": [
            {"name": "kafka_partition", "type": "int"},
            {"name": "kafka_offset", "type": "long"},
            {"name": "record", "type": record_schema},
        ],
    }


def container_header(record_schema: dict[str, Any]) -> bytes:
    """An Avro object container header (uncompressed) for envelopes of ``record_schema``."""
    schema_json = json.dumps(envelope_schema(record_schema), separators=(",", ":")).encode()
    metadata = (
        zigzag(2)
        + avro_bytes(b"avro.schema")
        + avro_bytes(schema_json)
        + avro_bytes(b"avro.codec")
        + avro_bytes(b"null")
        + zigzag(0)
    )
    return b"Obj\x01" + metadata + _SYNC


def container(header: bytes, rows: Sequence[tuple[int, int, bytes | memoryview]]) -> bytes:
    """One container file: ``header`` plus one block per (partition, offset, Avro body) row.

    A block per row, not one block of all rows: a block says how many objects it holds, and
    the engine reads exactly that many, then skips to the block's end and checks the sync
    marker. So a body with bytes appended after a valid datum (a hostile or broken producer's)
    is one row and its tail is never read, instead of the tail being read as further rows
    (forged rows with offsets the producer chose, and a real row swallowed). The engine takes
    the position columns from here, never from a producer's bytes. ~20 bytes more per row.
    """
    parts: list[bytes | memoryview] = [header]
    for partition, offset, body in rows:
        position = zigzag(partition) + zigzag(offset)
        parts += (_ONE, zigzag(len(position) + len(body)), position, body, _SYNC)
    return b"".join(parts)


_ONE = zigzag(1)


def clickhouse_type(schema: Any, named: dict[str, str] | None = None, namespace: str = "") -> str:
    """The ClickHouse type its Avro input format gives ``schema`` (a parsed, expanded schema)."""
    named = {} if named is None else named
    if isinstance(schema, str):
        if schema in _PRIMITIVES:
            return _PRIMITIVES[schema]
        full = schema if "." in schema else f"{namespace}.{schema}" if namespace else schema
        return named[full]
    if isinstance(schema, list):
        return _union_type(schema, named, namespace)
    kind = schema["type"]
    if kind in _PRIMITIVES:  # {"type": "string", "logicalType": ...}: JSON text and friends
        return _PRIMITIVES[kind]
    if kind == "array":
        return f"Array({clickhouse_type(schema['items'], named, namespace)})"
    if kind == "map":
        return f"Map(String, {clickhouse_type(schema['values'], named, namespace)})"
    name = schema["name"]
    inner_namespace = schema.get("namespace", name.rpartition(".")[0] if "." in name else namespace)
    full = name if "." in name else f"{inner_namespace}.{name}" if inner_namespace else name
    if kind == "enum":
        width = 8 if len(schema["symbols"]) <= 127 else 16
        symbols = ", ".join(f"'{s}' = {i}" for i, s in enumerate(schema["symbols"]))
        result = f"Enum{width}({symbols})"
    elif kind == "fixed":
        result = f"FixedString({schema['size']})"
    elif kind == "record":
        named[full] = "<recursive>"
        fields = ", ".join(
            f"{f['name']} {clickhouse_type(f['type'], named, inner_namespace)}" for f in schema["fields"]
        )
        result = f"Tuple({fields})"
    else:
        raise ValueError(f"unsupported Avro type {kind!r}")
    named[full] = result
    return result


def _union_type(branches: list[Any], named: dict[str, str], namespace: str) -> str:
    types = [clickhouse_type(b, named, namespace) for b in branches if b != "null"]
    nullable = len(types) < len(branches)
    distinct = sorted(set(types))
    if len(distinct) == 1:
        only = distinct[0]
        return f"Nullable({only})" if nullable and not only.startswith(_NOT_NULLABLE) else only
    return f"Variant({', '.join(distinct)})"


def columns_of(record_schema: dict[str, Any]) -> list[tuple[str, str]]:
    """(name, ClickHouse type) of the envelope's columns, as the engine will read them."""
    named: dict[str, str] = {}
    return [
        ("kafka_partition", "Int32"),
        ("kafka_offset", "Int64"),
        ("record", clickhouse_type(record_schema, named)),
    ]


def ingest_ddl(
    database: str, table: str, fingerprint_hex: str, record_schema: dict[str, Any], transform: str
) -> list[str]:
    """DDL of the Null table and materialized view that load ``table`` from envelopes.

    Named after the writer schema's fingerprint: a new schema version gets a new pair and the
    old pair stays valid for data still in flight.
    """
    ingest = f"{database}.{table}_ingest_{fingerprint_hex}"
    columns = ", ".join(f"`{name}` {kind}" for name, kind in columns_of(record_schema))
    return [
        f"CREATE TABLE IF NOT EXISTS {ingest} ({columns}) ENGINE = Null",
        f"CREATE MATERIALIZED VIEW IF NOT EXISTS {ingest}_mv TO {database}.{table} AS "
        f"{transform.format(db=database)} FROM {ingest}",
    ]


def ingest_table(database: str, table: str, fingerprint_hex: str) -> str:
    return f"{database}.{table}_ingest_{fingerprint_hex}"
