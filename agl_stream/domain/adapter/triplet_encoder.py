"""The adapter's output edge: TripletRecord -> the bytes ``codec.encode`` gives, without fastavro's
per-item cost (~0.4 us a number there).

:class:`TripletRecordEncoder` writes a TripletRecord as fastavro would with the codec's writer
compiled from the current schema (``agl_stream.wire.avro_writer``), reading the model's fields
directly, with writers of its own for the arrays that dominate: token ids through a table of
varint encodings, log-probabilities with one ``struct.pack``. It hands the codec any record it
cannot write the way fastavro does.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

from agl_stream.domain.adapter.lean import TokenIds
from agl_stream.models import TripletRecord
from agl_stream.wire.avro_primitives import zigzag
from agl_stream.wire.avro_writer import Declined, Out
from agl_stream.wire.codec import Codec

__all__ = ["TripletRecordEncoder"]

# --------------------------------------------------------------------------------------------
# Writing a TripletRecord
# --------------------------------------------------------------------------------------------

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def _varint(value: int) -> bytes:
    """Zig-zag varint of a long, as fastavro writes it."""
    if not _INT64_MIN <= value <= _INT64_MAX:
        raise Declined  # fastavro's own error, from the codec path
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


def _write_longs(values: Any, out: Out) -> None:
    """An array of longs (token ids: through the table, in C loops; ids read from a record as
    they were read)."""
    if type(values) is TokenIds:
        if values:
            out.append(_size(len(values)))
            out.append(values.varints)
        out.append(b"\x00")
        return
    if type(values) is not list:
        raise Declined
    if values:
        try:
            body = b"".join(map(_VARINTS.__getitem__, values))
            if min(values) < 0:  # a negative index reads from the table's end
                raise IndexError
        except (IndexError, TypeError):
            if set(map(type, values)) != {int}:
                raise Declined from None  # bools, floats: fastavro's conversions, from the codec path
            table, size = _VARINTS, len(_VARINTS)
            body = b"".join([table[value] if 0 <= value < size else _varint(value) for value in values])
        out.append(_size(len(values)))
        out.append(body)
    out.append(b"\x00")


def _write_doubles(values: Any, out: Out) -> None:
    if type(values) is not list:
        raise Declined
    if values:
        if set(map(type, values)) != {float}:
            raise Declined
        out.append(_size(len(values)))
        out.append(struct.pack(f"<{len(values)}d", *values))
    out.append(b"\x00")


class TripletRecordEncoder:
    """TripletRecord -> the bytes ``codec.encode`` gives, without fastavro's per-item cost.

    The writer is built from the current schema (so a field added to the record is written
    too); when it cannot be built, everything is left to the codec (``fast`` False). A record it
    cannot write the way fastavro would (an unexpected type in a field, a type of the schema it
    does not know) is written by the codec.
    """

    def __init__(self, codec: Codec) -> None:
        self.codec = codec
        self.header = codec.contract.schema(TripletRecord.avro_name).header
        self._write: Callable[[Any], bytes] | None
        try:
            self._write = codec.compiled_writer(
                TripletRecord.avro_name,
                from_attributes=True,
                arrays={"long": _write_longs, "double": _write_doubles},
            )
        except (Declined, KeyError, TypeError):
            self._write = None
        self.fast = self._write is not None
        if self.fast:
            _fill_varints()

    def encode(self, record: TripletRecord) -> bytes:
        if self._write is not None:
            try:
                return self.header + self._write(record)
            except (Declined, RecursionError):
                pass  # the codec writes it, or raises its own error
        return self.codec.encode(record)
