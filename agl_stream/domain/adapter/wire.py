"""The adapter's edges on the wire: agl.spans record bytes -> LeanSpans, TripletRecord -> bytes.

Why not the codec: fastavro builds every value of a span as a Python object (~65-150 us a span
on this 2-core box), most of it the token-id arrays (each item an Avro union, ~0.6 us an item),
and writes a TripletRecord at ~0.4 us a number. The adapter needs a few fields of each span and
its output is a handful of arrays, so both ends are done here:

* :class:`SpanRecordDecoder` reads an ``agl.Span`` or ``agl.SpanBatch`` body directly into
  :class:`~agl_stream.domain.adapter.lean.LeanSpan` tuples: the fields the adapter reads are
  decoded, everything else is stepped over (strings still checked to be UTF-8, as fastavro
  does; byte runs already read, like a batch's ids and resource, compared instead of parsed),
  and a token-id array is split into its varints by one ``bytes.split`` and mapped to ints
  through a memo (C loops instead of one Python step per item). It is written for one schema
  version of each (their fingerprints below); a test fails when they change.
* :class:`TripletRecordEncoder` writes a TripletRecord as fastavro would (arrays in one block,
  JSON text as the codec dumps it), from writers built from the current schema, token ids
  through a table of varint encodings and log-probabilities with one ``struct.pack``.

Both are exact or step aside: the decoder hands any record it does not take whole (another
schema version, an unusual encoding, anything malformed) to the codec, so what is accepted,
what is refused and with which message stay the codec's (tested on corrupted records); the
encoder hands the codec any record it cannot write the way fastavro does, and any schema with
a type it does not know.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Callable
from typing import Any

from agl_stream.domain.adapter.lean import ADAPTER_KEYS, REWARD_PREFIX, REWARDISH_KEYS, LeanSpan, lean_attributes
from agl_stream.errors import MalformedRecordError
from agl_stream.models import TripletRecord
from agl_stream.models.spans import SPAN_ID_MAX_LENGTH
from agl_stream.wire.avro_primitives import zigzag
from agl_stream.wire.codec import HEADER_SIZE, MAGIC, Codec
from agl_stream.wire.span_records import span_dicts_of

__all__ = [
    "SPAN_BATCH_FINGERPRINT",
    "SPAN_FINGERPRINT",
    "SpanRecordDecoder",
    "TripletRecordEncoder",
    "lean_of_datum",
    "span_dicts_of",
]

SPAN = "agl.Span"
SPAN_BATCH = "agl.SpanBatch"
SPAN_FINGERPRINT = 0x482855A0550023DA
SPAN_BATCH_FINGERPRINT = 0x1B047B30BCBF0B4C
"""The schema versions the decoder reads byte by byte (schemas/Span.avsc, SpanBatch.avsc today)."""


_STATUS_CODES = 3  # agl.StatusCode symbols
_unpack_double = struct.Struct("<d").unpack_from


class _NotFast(Exception):
    """The fast path does not take this record; the codec decides."""


# --------------------------------------------------------------------------------------------
# Reading: primitives (IndexError/struct.error on truncation also mean "not fast")
# --------------------------------------------------------------------------------------------


def _long(data: bytes, pos: int) -> tuple[int, int]:
    byte = data[pos]
    if byte < 0x80:
        return (byte >> 1) ^ -(byte & 1), pos + 1
    value = byte & 0x7F
    shift = 7
    pos += 1
    while True:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            break
        shift += 7
        if shift > 63:
            raise _NotFast  # longer than any long: fastavro's overflow, from the codec path
    if value >> 64:
        raise _NotFast
    return (value >> 1) ^ -(value & 1), pos


def _span_of(data: bytes, pos: int) -> tuple[int, int]:
    """(start, end) of the string or bytes at ``pos``."""
    size, pos = _long(data, pos)
    end = pos + size
    if size < 0 or end > len(data):
        raise _NotFast
    return pos, end


def _text(data: bytes, pos: int) -> tuple[str, int]:
    start, end = _span_of(data, pos)
    return data[start:end].decode(), end


def _skip_text(data: bytes, pos: int, unchecked: list[bytes]) -> int:
    """Step over a string; its bytes go to ``unchecked`` (validated as UTF-8 in one call)."""
    start, end = _span_of(data, pos)
    text = data[start:end]
    if not text.isascii():
        unchecked.append(text)
    return end


def _double(data: bytes, pos: int) -> tuple[float, int]:
    return _unpack_double(data, pos)[0], pos + 8


# --------------------------------------------------------------------------------------------
# Reading: arrays of the attribute item union [long, double, string, boolean, null]
# --------------------------------------------------------------------------------------------

_VARINT_VALUES: dict[bytes, int] = {}
"""Memo: the bytes of a varint (up to 9) -> its zig-zag value. Token ids repeat, so after the
first few arrays almost every id is found here, in a C loop."""
_VARINT_MEMO_MAX = 1 << 18
_EVEN = bytes(range(0, 256, 2))
_HALF = bytes(b >> 1 for b in range(256))


def _longs(data: bytes, pos: int, count: int) -> tuple[list[int], int] | None:
    """``count`` items that are all of the long branch (token ids); None if they are not.

    Each item is a union index 0 (the byte 00) then a varint, which holds no 00 byte unless it
    is the value 0. So splitting on 00 gives the varints themselves, and the memo maps them to
    values; a piece the memo does not know (a new id, a 0, another branch) sends the array
    through the item by item reader, which teaches the memo.
    """
    seg = data[pos : pos + 2 * count]
    values = seg[1::2]
    if len(seg) == 2 * count and values.isascii() and seg[0::2].count(0) == count:
        # Every value one byte (ids < 64): halve them when none is negative (odd).
        if not values.translate(None, _EVEN):
            return list(values.translate(_HALF)), pos + 2 * count
    window = data[pos : pos + 4 * count + 2]
    pieces = window.split(b"\x00", count + 1)
    if len(pieces) == count + 2 and not pieces[0]:
        rest = len(pieces[-1]) + 1  # the separator after the last varint is not the array's
        del pieces[0], pieces[count:]
        ints = list(map(_VARINT_VALUES.get, pieces))
        if None not in ints:
            return ints, pos + len(window) - rest  # type: ignore[return-value]
    return _longs_one_by_one(data, pos, count)


def _longs_one_by_one(data: bytes, pos: int, count: int) -> tuple[list[int], int] | None:
    if len(_VARINT_VALUES) > _VARINT_MEMO_MAX:
        _VARINT_VALUES.clear()
    memo = _VARINT_VALUES
    out: list[int] = []
    for _ in range(count):
        if data[pos] != 0:
            return None  # an item of another branch
        start = pos + 1
        value, pos = _long(data, start)
        if value:  # 0 is the one value whose varint is the separator byte itself
            memo[data[start:pos]] = value
        out.append(value)
    return out, pos


def _item(data: bytes, pos: int, unchecked: list[bytes] | None) -> tuple[Any, int]:
    branch = data[pos]
    pos += 1
    if branch == 0:  # long
        return _long(data, pos)
    if branch == 2:  # double
        return _double(data, pos)
    if branch == 4:  # string
        if unchecked is None:
            return _text(data, pos)
        return None, _skip_text(data, pos, unchecked)
    if branch == 6:  # boolean: fastavro takes any non-zero byte as true
        return data[pos] != 0, pos + 1
    if branch == 8:  # null
        return None, pos
    raise _NotFast


def _array(data: bytes, pos: int, unchecked: list[bytes] | None) -> tuple[list[Any], int]:
    """An array of the item union; ``unchecked`` given: stepped over (strings set aside)."""
    count, start = _long(data, pos)
    if count > 0:  # the usual: token ids, one block of longs, then the end
        got = _longs(data, start, count)
        if got is not None and data[got[1]] == 0:
            return got[0], got[1] + 1
    out: list[Any] = []
    count, pos = _long(data, pos)
    while count:
        if count < 0:
            count = -count
            _, pos = _long(data, pos)  # block size in bytes
        got = _longs(data, pos, count)
        if got is not None:
            items, pos = got
            out += items
        else:
            for _ in range(count):
                item, pos = _item(data, pos, unchecked)
                out.append(item)
        count, pos = _long(data, pos)
    return out, pos


def _value(data: bytes, pos: int) -> tuple[Any, int]:
    """An attribute value: union [string, long, double, boolean, null, array]."""
    branch = data[pos]
    pos += 1
    if branch == 0:
        byte = data[pos]
        if byte < 0x80 and not byte & 1:  # a short string
            end = pos + 1 + (byte >> 1)
            return data[pos + 1 : end].decode(), end
        return _text(data, pos)
    if branch == 2:
        return _long(data, pos)
    if branch == 4:
        return _double(data, pos)
    if branch == 6:
        return data[pos] != 0, pos + 1
    if branch == 8:
        return None, pos
    if branch == 10:
        return _array(data, pos, None)
    raise _NotFast


def _skip_value(data: bytes, pos: int, unchecked: list[bytes]) -> int:
    branch = data[pos]
    pos += 1
    if branch == 0:
        return _skip_text(data, pos, unchecked)
    if branch == 2:
        return _long(data, pos)[1]
    if branch == 4:
        if pos + 8 > len(data):
            raise _NotFast
        return pos + 8
    if branch == 6:
        data[pos]
        return pos + 1
    if branch == 8:
        return pos
    if branch == 10:
        return _array(data, pos, unchecked)[1]
    raise _NotFast


_Step = Callable[[bytes, int, list[bytes]], int]
"""Steps over one value at a position: (data, position, strings to check) -> position after it."""

_KEYS = {key.encode(): key for key in ADAPTER_KEYS}
_REWARDISH = frozenset(key.encode() for key in REWARDISH_KEYS)
_REWARD_PREFIX = REWARD_PREFIX.encode()


def _attributes(data: bytes, pos: int, unchecked: list[bytes]) -> tuple[dict[str, Any], bool, int]:
    """The adapter's attributes of a span's map (see lean.is_adapter_key), stepping over the rest.

    The common encodings (one-byte lengths and counts) are read inline: a function call per
    field was most of the cost.
    """
    kept: dict[str, Any] = {}
    rewardish = False
    keys = _KEYS
    count, pos = _long(data, pos)
    while count:
        if count < 0:
            count = -count
            _, pos = _long(data, pos)
        for _ in range(count):
            byte = data[pos]
            if byte < 0x80 and not byte & 1:
                start, end = pos + 1, pos + 1 + (byte >> 1)
            else:
                start, end = _span_of(data, pos)
            raw = data[start:end]
            key = keys.get(raw)
            if key is None:
                if not raw.startswith(_REWARD_PREFIX):
                    if not raw.isascii():
                        unchecked.append(raw)
                    byte = data[end + 1]
                    if data[end] == 0 and byte < 0x80 and not byte & 1:  # a short string: the usual
                        start, pos = end + 2, end + 2 + (byte >> 1)
                        if not data[start:pos].isascii():
                            unchecked.append(data[start:pos])
                    else:
                        pos = _skip_value(data, end, unchecked)
                    continue
                key = raw.decode()
                rewardish = True
            elif raw in _REWARDISH:
                rewardish = True
            kept[key], pos = _value(data, end)
        count, pos = _long(data, pos)
    return kept, rewardish, pos


def _skip_map(data: bytes, pos: int, unchecked: list[bytes], values: _Step) -> int:
    count, pos = _long(data, pos)
    while count:
        if count < 0:
            count = -count
            _, pos = _long(data, pos)
        for _ in range(count):
            pos = values(data, _skip_text(data, pos, unchecked), unchecked)
        count, pos = _long(data, pos)
    return pos


_CONTEXT = re.compile(rb"\x02\x40[0-9a-f]{32}\x20[0-9a-f]{16}[\x00\x01]\x00")
"""[null, agl.SpanContext] holding a context with hex ids and no trace state: the usual one."""


def _skip_context(data: bytes, pos: int, unchecked: list[bytes]) -> int:
    """agl.SpanContext: trace_id, span_id, is_remote, trace_state (map of strings)."""
    pos = _skip_text(data, _skip_text(data, pos, unchecked), unchecked)
    data[pos]
    return _skip_map(data, pos + 1, unchecked, _skip_text)


def _skip_optional_context(data: bytes, pos: int, unchecked: list[bytes]) -> int:
    branch = data[pos]
    if branch == 0:
        return pos + 1
    if branch != 2:
        raise _NotFast
    found = _CONTEXT.match(data, pos)
    return found.end() if found is not None else _skip_context(data, pos + 1, unchecked)


def _skip_records(data: bytes, pos: int, unchecked: list[bytes], record: _Step) -> int:
    count, pos = _long(data, pos)
    while count:
        if count < 0:
            count = -count
            _, pos = _long(data, pos)
        for _ in range(count):
            pos = record(data, pos, unchecked)
        count, pos = _long(data, pos)
    return pos


def _skip_event(data: bytes, pos: int, unchecked: list[bytes]) -> int:
    """agl.SpanEvent: name, attributes, timestamp [null, double]."""
    pos = _skip_map(data, _skip_text(data, pos, unchecked), unchecked, _skip_value)
    return _optional_double(data, pos)[1]


def _skip_link(data: bytes, pos: int, unchecked: list[bytes]) -> int:
    """agl.SpanLink: context, attributes."""
    return _skip_map(data, _skip_context(data, pos, unchecked), unchecked, _skip_value)


def _optional_double(data: bytes, pos: int) -> tuple[float | None, int]:
    branch = data[pos]
    if branch == 0:
        return None, pos + 1
    if branch == 2:
        return _unpack_double(data, pos + 1)[0], pos + 9
    raise _NotFast


_IDS = re.compile(rb"\x40[0-9a-f]{32}\x20([0-9a-f]{16})")
"""trace_id and span_id as OpenTelemetry writes them (32 and 16 hex digits): the usual case,
read inline; any other id goes the codec's way (lean_of_datum)."""
_unpack_times = struct.Struct("<dxd").unpack_from  # start_time, branch, end_time


_new_tuple = tuple.__new__  # LeanSpan(...) without the Python-level __new__ of a NamedTuple


class _Memo:
    """Byte runs already read in this decoder: a span of a batch repeats its batch's rollout
    and attempt ids and, usually, the resource and scope of the spans before it. The same bytes
    read the same way, so a run that matches is stepped over in one comparison."""

    __slots__ = ("attempt_id", "head", "rollout_id", "tail")

    def __init__(self) -> None:
        self.head = b"\xff"  # never a valid start
        self.rollout_id = ""
        self.attempt_id = ""
        self.tail = b"\xff"


def _span(data: bytes, pos: int, unchecked: list[bytes], memo: _Memo) -> tuple[LeanSpan, int]:
    """One agl.Span body, fields in schema order; the usual encodings inline."""
    head = memo.head
    if data.startswith(head, pos):
        rollout_id, attempt_id = memo.rollout_id, memo.attempt_id
        pos += len(head)
    else:
        start = pos
        rollout_id, pos = _text(data, pos)
        attempt_id, pos = _text(data, pos)
        memo.head, memo.rollout_id, memo.attempt_id = data[start:pos], rollout_id, attempt_id
    byte = data[pos]
    if byte < 0x80:
        sequence_id = (byte >> 1) ^ -(byte & 1)
        pos += 1
    else:
        sequence_id, pos = _long(data, pos)
    ids = _IDS.match(data, pos)
    if ids is None:
        raise _NotFast  # span_view's error or acceptance, from the codec path
    span_id = ids[1].decode()
    pos += 50
    branch = data[pos]
    if branch == 0:
        parent_id = None
        pos += 1
    elif branch == 2:
        parent_id, pos = _text(data, pos + 1)
    else:
        raise _NotFast
    byte = data[pos]
    if byte < 0x80 and not byte & 1:
        end = pos + 1 + (byte >> 1)
        name = data[pos + 1 : end].decode()
        pos = end
    else:
        name, pos = _text(data, pos)
    byte = data[pos]  # kind
    if byte < 0x80 and not byte & 1:
        end = pos + 1 + (byte >> 1)
        if not data[pos + 1 : end].isascii():
            unchecked.append(data[pos + 1 : end])
        pos = end
    else:
        pos = _skip_text(data, pos, unchecked)
    if data[pos] not in (0, 2, 4):  # status: status_code (one of 3 symbols), description [null, string]
        raise _NotFast
    branch = data[pos + 1]
    if branch == 0:
        pos += 2
    elif branch == 2:
        pos = _skip_text(data, pos + 2, unchecked)
    else:
        raise _NotFast
    attributes, rewardish, pos = _attributes(data, pos, unchecked)
    if data[pos] == 0 and data[pos + 1] == 0:  # no events, no links
        pos += 2
    else:
        pos = _skip_records(data, pos, unchecked, _skip_event)
        pos = _skip_records(data, pos, unchecked, _skip_link)
    if data[pos] == 2 and data[pos + 9] == 2:
        start_time, end_time = _unpack_times(data, pos + 1)
        pos += 18
    else:
        start_time, pos = _optional_double(data, pos)
        end_time, pos = _optional_double(data, pos)
    pos = _skip_optional_context(data, pos, unchecked)  # context
    pos = _skip_optional_context(data, pos, unchecked)  # parent
    tail = memo.tail
    if data.startswith(tail, pos):  # resource (attributes, schema_url), scope_name, scope_version
        pos += len(tail)
    else:
        start = pos
        pos = _skip_map(data, pos, unchecked, _skip_value)
        for _ in range(3):
            pos = _skip_text(data, pos, unchecked)
        if pos <= len(data) and data[start:pos].isascii():  # only runs known to be UTF-8 are reused
            memo.tail = data[start:pos]
    fields = (rollout_id, attempt_id, sequence_id, span_id, parent_id, name, start_time, end_time)
    return _new_tuple(LeanSpan, (*fields, attributes, rewardish)), pos


def _fast(data: bytes, batch: bool, memo: _Memo) -> list[LeanSpan]:
    unchecked: list[bytes] = []
    spans: list[LeanSpan] = []
    pos = HEADER_SIZE
    if batch:
        pos = _skip_text(data, _skip_text(data, pos, unchecked), unchecked)  # the batch's rollout and attempt
        count, pos = _long(data, pos)
        while count:
            if count < 0:
                count = -count
                _, pos = _long(data, pos)
            for _ in range(count):
                span, pos = _span(data, pos, unchecked, memo)
                spans.append(span)
            count, pos = _long(data, pos)
    else:
        span, pos = _span(data, pos, unchecked, memo)
        spans.append(span)
    if pos != len(data):
        raise _NotFast
    if unchecked:
        # What fastavro would have decoded: one UTF-8 check for all of it. The separator
        # (ASCII) keeps a sequence cut at the end of one string from completing in the next.
        b"\n".join(unchecked).decode()
    return spans


# --------------------------------------------------------------------------------------------
# The decoder
# --------------------------------------------------------------------------------------------


def _checked_id(datum: dict[str, Any], name: str) -> str:
    value = datum.get(name)
    if not isinstance(value, str) or not 0 < len(value) <= SPAN_ID_MAX_LENGTH:
        raise MalformedRecordError(f"agl.Span: {name} {str(value)[:64]!r} is not 1 to {SPAN_ID_MAX_LENGTH} characters")
    return value


def lean_of_datum(datum: dict[str, Any]) -> LeanSpan:
    """A LeanSpan of a decoded agl.Span dict (the codec's dict form), with the model's checks
    of the ids (models.spans.TraceId: 1 to 128 characters); the Avro schema guarantees every
    type."""
    _checked_id(datum, "trace_id")
    span_id = _checked_id(datum, "span_id")
    attributes, rewardish = lean_attributes(datum["attributes"])
    return LeanSpan(
        datum["rollout_id"],
        datum["attempt_id"],
        datum["sequence_id"],
        span_id,
        datum["parent_id"],
        datum["name"],
        datum["start_time"],
        datum["end_time"],
        attributes,
        rewardish,
    )


class SpanRecordDecoder:
    """agl.spans record bytes -> the LeanSpans in it, in record order.

    Raises CodecError like the codec does (RecordTypeError for a record of another type,
    MalformedRecordError for ids the Span model refuses): a record is good or bad as a
    whole.
    """

    def __init__(self, codec: Codec) -> None:
        self.codec = codec
        current = (codec.fingerprint(SPAN), codec.fingerprint(SPAN_BATCH))
        # Written for these schema versions; any other current schema turns the fast path off.
        self.fast = current == (SPAN_FINGERPRINT, SPAN_BATCH_FINGERPRINT)
        self.fast_records = 0
        self.codec_records = 0
        self._memo = _Memo()

    def decode(self, data: bytes) -> list[LeanSpan]:
        if self.fast and len(data) > HEADER_SIZE and data[:2] == MAGIC:
            fingerprint = int.from_bytes(data[2:HEADER_SIZE], "little")
            if fingerprint == SPAN_BATCH_FINGERPRINT or fingerprint == SPAN_FINGERPRINT:
                try:
                    spans = _fast(data, fingerprint == SPAN_BATCH_FINGERPRINT, self._memo)
                except (_NotFast, IndexError, struct.error, UnicodeDecodeError):
                    pass
                else:
                    self.fast_records += 1
                    return spans
        self.codec_records += 1
        return self.slow(data)

    def slow(self, data: bytes) -> list[LeanSpan]:
        """Through the codec (any schema version it knows; its errors)."""
        return [lean_of_datum(datum) for datum in span_dicts_of(self.codec, data)]


# --------------------------------------------------------------------------------------------
# Writing a TripletRecord
# --------------------------------------------------------------------------------------------

_pack_double = struct.Struct("<d").pack
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def _varint(value: int) -> bytes:
    """Zig-zag varint of a long, as fastavro writes it."""
    if not _INT64_MIN <= value <= _INT64_MAX:
        raise _NotFast  # fastavro's own error, from the codec path
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


_json_text = json.JSONEncoder(ensure_ascii=False, allow_nan=False, sort_keys=True, separators=(",", ":")).encode
"""``codec.dump_json`` without building an encoder per call (json.dumps does, for these options)."""

_Write = Callable[[Any, list[bytes]], None]
"""Appends the Avro bytes of a value to a list; raises _NotFast where fastavro's rules are not
this module's to repeat (other types than the schema's, branches it would have to guess)."""


def _write_string(value: Any, out: list[bytes]) -> None:
    if type(value) is not str:
        raise _NotFast
    data = value.encode()
    out.append(_size(len(data)))
    out.append(data)


def _write_long(value: Any, out: list[bytes]) -> None:
    if type(value) is not int:
        raise _NotFast  # a bool or a float: fastavro's conversions, from the codec path
    out.append(_varint(value))


def _write_double(value: Any, out: list[bytes]) -> None:
    if type(value) is not float:
        raise _NotFast
    out.append(_pack_double(value))


def _write_null(value: Any, out: list[bytes]) -> None:
    if value is not None:
        raise _NotFast


def _write_json(value: Any, out: list[bytes]) -> None:
    _write_string(_json_text(value), out)


def _write_longs(values: Any, out: list[bytes]) -> None:
    """An array of longs (token ids: through the table, in C loops)."""
    if type(values) is not list:
        raise _NotFast
    if values:
        try:
            body = b"".join(map(_VARINTS.__getitem__, values))
            if min(values) < 0:  # a negative index reads from the table's end
                raise IndexError
        except (IndexError, TypeError):
            if set(map(type, values)) != {int}:
                raise _NotFast from None  # bools, floats: fastavro's conversions, from the codec path
            table, size = _VARINTS, len(_VARINTS)
            body = b"".join([table[value] if 0 <= value < size else _varint(value) for value in values])
        out.append(_size(len(values)))
        out.append(body)
    out.append(b"\x00")


def _write_doubles(values: Any, out: list[bytes]) -> None:
    if type(values) is not list:
        raise _NotFast
    if values:
        if set(map(type, values)) != {float}:
            raise _NotFast
        out.append(_size(len(values)))
        out.append(struct.pack(f"<{len(values)}d", *values))
    out.append(b"\x00")


def _array_writer(item: _Write) -> _Write:
    def write(values: Any, out: list[bytes]) -> None:
        if type(values) is not list:
            raise _NotFast
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
            raise _NotFast  # a JSON value in a union: fastavro picks the branch, the codec's way
        out.append(b"\x02")
        other(value, out)

    return write


def _enum_writer(symbols: list[str]) -> _Write:
    index = {symbol: _varint(i) for i, symbol in enumerate(symbols)}

    def write(value: Any, out: list[bytes]) -> None:
        found = index.get(value) if type(value) is str else None
        if found is None:
            raise _NotFast
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
    used); _NotFast for a type this module does not write (the codec then writes everything)."""
    if isinstance(schema, str):
        if schema in _PRIMITIVES:
            return _PRIMITIVES[schema]
        full = schema if "." in schema else f"{namespace}.{schema}"
        if full in named:
            return named[full]
        raise _NotFast
    if isinstance(schema, list):
        if len(schema) == 2 and schema[0] == "null" and schema[1] != "null":
            other = schema[1]
            json_branch = isinstance(other, dict) and other.get("logicalType") == "json"
            return _optional_writer(_compile(other, named, namespace), json_branch)
        raise _NotFast
    kind = schema.get("type")
    if kind == "string" and schema.get("logicalType") == "json":
        return _write_json
    if "logicalType" in schema:
        raise _NotFast
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
    raise _NotFast


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
        except (_NotFast, KeyError, TypeError):
            self._write = None
        self.fast = self._write is not None
        if self.fast:
            _fill_varints()

    def encode(self, record: TripletRecord) -> bytes:
        if self._write is not None:
            out = [self.header]
            try:
                self._write(record, out)
            except (_NotFast, ValueError, TypeError, UnicodeEncodeError, AttributeError):
                pass  # the codec writes it, or raises its own error
            else:
                return b"".join(out)
        return self.codec.encode(record)
