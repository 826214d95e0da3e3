"""The adapter's output edge: TripletRecord -> the bytes ``codec.encode`` gives, without fastavro's
per-item cost (~0.4 us a number there).

:class:`TripletRecordEncoder` writes a TripletRecord as fastavro would (arrays in one block, JSON
text as the codec dumps it), from writers built from the current schema, token ids through a
table of varint encodings and log-probabilities with one ``struct.pack``. It hands the codec any
record it cannot write the way fastavro does, and any schema with a type it does not know.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

from agl_stream.domain.adapter.lean import TokenIds
from agl_stream.domain.adapter.span_decoder import NotFast
from agl_stream.models import TripletRecord
from agl_stream.wire.avro_primitives import zigzag
from agl_stream.wire.codec import Codec, dump_json

__all__ = ["TripletRecordEncoder"]

# --------------------------------------------------------------------------------------------
# Writing a TripletRecord
# --------------------------------------------------------------------------------------------

_pack_double = struct.Struct("<d").pack
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def _varint(value: int) -> bytes:
    """Zig-zag varint of a long, as fastavro writes it."""
    if not _INT64_MIN <= value <= _INT64_MAX:
        raise NotFast  # fastavro's own error, from the codec path
    return zigzag(value)


_VARINTS: list[bytes] = []
"""Varints of 0 .. 2**18 - 1, filled by the first encoder: token ids (Qwen's 151,936-token and
Gemma's 256,000-token vocabularies included) are written by one table lookup each, in C."""


def _fill_varints() -> None:
    if not _VARINTS:
        one = [bytes((2 * v,)) for v in range(64)]
        two = [bytes((2 * v & 0x7F | 0x80, 2 * v >> 7)) for v in range(64, 1 << 13)]
        three = [bytes((2 * v & 0x7F | 0x80, 2 * v >> 7 & 0x7F | 0x80, 2 * v >> 14)) for v in range(1 << 13, 1 << 18)]
        _VARINTS.extend(one + two + three)


def _size(value: int) -> bytes:
    """The varint of a length or count (from the table when it is there)."""
    return _VARINTS[value] if value < len(_VARINTS) else _varint(value)


_Write = Callable[[Any, list[bytes]], None]
"""Appends the Avro bytes of a value to a list; raises NotFast where fastavro's rules are not
this module's to repeat (other types than the schema's, branches it would have to guess)."""


def _write_string(value: Any, out: list[bytes]) -> None:
    if type(value) is not str:
        raise NotFast
    data = value.encode()
    out.append(_size(len(data)))
    out.append(data)


def _write_long(value: Any, out: list[bytes]) -> None:
    if type(value) is not int:
        raise NotFast  # a bool or a float: fastavro's conversions, from the codec path
    out.append(_varint(value))


def _write_double(value: Any, out: list[bytes]) -> None:
    if type(value) is not float:
        raise NotFast
    out.append(_pack_double(value))


def _write_null(value: Any, out: list[bytes]) -> None:
    if value is not None:
        raise NotFast


def _write_json(value: Any, out: list[bytes]) -> None:
    _write_string(dump_json(value), out)


def _write_longs(values: Any, out: list[bytes]) -> None:
    """An array of longs (token ids: through the table, in C loops; ids read from a record as
    they were read)."""
    if type(values) is TokenIds:
        if values:
            out.append(_size(len(values)))
            out.append(values.varints)
        out.append(b"\x00")
        return
    if type(values) is not list:
        raise NotFast
    if values:
        try:
            body = b"".join(map(_VARINTS.__getitem__, values))
            if min(values) < 0:  # a negative index reads from the table's end
                raise IndexError
        except (IndexError, TypeError):
            if set(map(type, values)) != {int}:
                raise NotFast from None  # bools, floats: fastavro's conversions, from the codec path
            table, size = _VARINTS, len(_VARINTS)
            body = b"".join([table[value] if 0 <= value < size else _varint(value) for value in values])
        out.append(_size(len(values)))
        out.append(body)
    out.append(b"\x00")


def _write_doubles(values: Any, out: list[bytes]) -> None:
    if type(values) is not list:
        raise NotFast
    if values:
        if set(map(type, values)) != {float}:
            raise NotFast
        out.append(_size(len(values)))
        out.append(struct.pack(f"<{len(values)}d", *values))
    out.append(b"\x00")


def _array_writer(item: _Write) -> _Write:
    def write(values: Any, out: list[bytes]) -> None:
        if type(values) is not list:
            raise NotFast
        if values:
            out.append(_size(len(values)))
            for value in values:
                item(value, out)
        out.append(b"\x00")  # fastavro: one block, then the empty one

    return write


def _optional_writer(other: _Write, json_branch: bool) -> _Write:
    def write(value: Any, out: list[bytes]) -> None:
        if value is None:
            out.append(b"\x00")
            return
        if json_branch:
            raise NotFast  # a JSON value in a union: fastavro picks the branch, the codec's way
        out.append(b"\x02")
        other(value, out)

    return write


def _enum_writer(symbols: list[str]) -> _Write:
    index = {symbol: _varint(i) for i, symbol in enumerate(symbols)}

    def write(value: Any, out: list[bytes]) -> None:
        found = index.get(value) if type(value) is str else None
        if found is None:
            raise NotFast
        out.append(found)

    return write


def _record_writer(fields: list[tuple[str, _Write]]) -> _Write:
    def write(value: Any, out: list[bytes]) -> None:
        for name, field_writer in fields:
            field_writer(getattr(value, name), out)

    return write


_PRIMITIVES: dict[str, _Write] = {
    "string": _write_string,
    "long": _write_long,
    "double": _write_double,
    "null": _write_null,
}


def _compile(schema: Any, named: dict[str, _Write], namespace: str) -> _Write:
    """A writer of values of ``schema`` (an expanded schema: named types defined where first
    used); NotFast for a type this module does not write (the codec then writes everything)."""
    if isinstance(schema, str):
        if schema in _PRIMITIVES:
            return _PRIMITIVES[schema]
        full = schema if "." in schema else f"{namespace}.{schema}"
        if full in named:
            return named[full]
        raise NotFast
    if isinstance(schema, list):
        if len(schema) == 2 and schema[0] == "null" and schema[1] != "null":
            other = schema[1]
            json_branch = isinstance(other, dict) and other.get("logicalType") == "json"
            return _optional_writer(_compile(other, named, namespace), json_branch)
        raise NotFast
    kind = schema.get("type")
    if kind == "string" and schema.get("logicalType") == "json":
        return _write_json
    if "logicalType" in schema:
        raise NotFast
    if kind in _PRIMITIVES:
        return _PRIMITIVES[kind]
    if kind == "array":
        items = schema["items"]
        if items == "long":
            return _write_longs
        if items == "double":
            return _write_doubles
        return _array_writer(_compile(items, named, namespace))
    if kind == "enum":
        writer = _enum_writer(list(schema["symbols"]))
        named[_full_name(schema, namespace)] = writer
        return writer
    if kind == "record":
        full = _full_name(schema, namespace)
        inner = full.rpartition(".")[0]
        fields: list[tuple[str, _Write]] = []
        writer = _record_writer(fields)
        named[full] = writer  # before the fields: a field may refer back to it
        fields.extend((f["name"], _compile(f["type"], named, inner)) for f in schema["fields"])
        return writer
    raise NotFast


def _full_name(schema: dict[str, Any], namespace: str) -> str:
    name = str(schema["name"])
    if "." in name:
        return name
    return f"{schema.get('namespace', namespace)}.{name}"


class TripletRecordEncoder:
    """TripletRecord -> the bytes ``codec.encode`` gives, without fastavro's per-item cost.

    The writer is built from the current schema (so a field added to the record is written
    too); a schema with a type it does not know leaves everything to the codec (``fast`` False).
    A record it cannot write the way fastavro would (an unexpected type in a field, a JSON value
    inside a union) is written by the codec.
    """

    def __init__(self, codec: Codec) -> None:
        self.codec = codec
        schema = codec.contract.schema(TripletRecord.avro_name)
        self.header = schema.header
        self._write: _Write | None
        try:
            self._write = _compile(schema.expanded, {}, "")
        except (NotFast, KeyError, TypeError):
            self._write = None
        self.fast = self._write is not None
        if self.fast:
            _fill_varints()

    def encode(self, record: TripletRecord) -> bytes:
        if self._write is not None:
            out = [self.header]
            try:
                self._write(record, out)
            except (NotFast, ValueError, TypeError, UnicodeEncodeError, AttributeError, RecursionError):
                pass  # the codec writes it, or raises its own error
            else:
                return b"".join(out)
        return self.codec.encode(record)
